"""GPU suite: the streaming loader through pinned buffers (pytest -m gpu tests/gpu).

Fails (not skips) without CUDA, like the rest of the GPU suite.
"""
from __future__ import annotations

import pytest
import torch

from strata.checkpoint.loader import TensorLoader
from strata.checkpoint.safetensors_io import CheckpointFolder, write_safetensors
from strata.model.model import Model

pytestmark = pytest.mark.gpu


def test_pieces_through_pinned_buffers_arrive_exactly(tmp_path):
    assert torch.cuda.is_available(), "the GPU suite needs CUDA"
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randint(-128, 127, (n,), generator=g, dtype=torch.int8)
               for i, n in enumerate([1, 4095, 4096, 4097, 3 * 4096 + 17, 100_000])}
    tensors["bf16"] = torch.randn(33, 65, generator=g).to(torch.bfloat16)
    path = tmp_path / "model.safetensors"
    write_safetensors(path, tensors)
    with CheckpointFolder(tmp_path) as folder, \
            TensorLoader("cuda", buffer_bytes=4096, n_buffers=3) as loader:
        # Load everything before synchronising: buffer reuse must wait for earlier copies.
        got = {n: loader.load(folder.info(n)) for n in folder.names()}
        assert loader.pin and len(loader._buffers) == 3
        assert all(b.data.is_pinned() for b in loader._buffers)
        for n, t in got.items():
            assert t.device.type == "cuda"
            assert torch.equal(t.cpu(), tensors[n]), n


def test_model_on_cuda_matches_cpu_weights(tiny_dir, tmp_path):
    assert torch.cuda.is_available(), "the GPU suite needs CUDA"
    loader = TensorLoader("cuda", buffer_bytes=1 << 16)
    model = Model.load(tiny_dir, "cuda", cache_dir=tmp_path, loader=loader)
    with CheckpointFolder(tiny_dir) as folder:
        assert torch.equal(model.embed.cpu(), folder.read("embed.weight"))
        assert torch.equal(model.dspark.markov_head.cpu(),
                           folder.read("mtp.2.markov_head.head.weight"))
