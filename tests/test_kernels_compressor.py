"""The ratio-2 compressor's pooling in one launch (strata.kernels.compressor) against
Compressor.forward's torch path, under TRITON_INTERPRET=1 on CPU
(tests/gpu/test_kernels_fused_ops_gpu.py runs it compiled against torch's CUDA ops)."""
from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is first launched

from strata.kernels import compressor as kernels  # noqa: E402
from strata.model.compressor import entry_indices  # noqa: E402
from strata.runtime.state import PositionRing  # noqa: E402
from util import compressor_pool as torch_pool  # noqa: E402


@pytest.mark.parametrize("first, T", [(7, 1), (8, 1), (5, 6), (0, 9), (20, 30)])
def test_pooling_gives_the_torch_steps_values(first, T):
    """Decode rows completing a group (odd first) or starting one (even), a verify window
    from mid-group, a prefill from position 0 (nothing from the ring) and a chunk longer than
    the ring (its earlier rows read before they are written): each entry's softmax-weighted
    sum of its two rows, from the tail ring or the forward, the last group's missing row
    clamped to the forward's last."""
    g = torch.Generator().manual_seed(first * 31 + T)
    hd, size = 300, 16  # channels past a power of two; a ring shorter than the last chunk
    ring = PositionRing(size, (2, hd), torch.float32, "cpu", keep=1)
    ring.rows.copy_(torch.randn(size, 2, hd, generator=g) * 3)
    positions = torch.arange(first, first + T)
    k = torch.randn(T, hd, generator=g) * 2
    gate = torch.randn(T, hd, generator=g) * 4
    entries = entry_indices(2, positions)
    got = kernels.pool(ring.rows, k, gate, positions, entries, 2)
    want = torch_pool(ring, k, gate, positions, entries, 2)
    assert got.shape == want.shape == (entries.numel(), hd)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


def test_a_mismatched_pool_is_refused():
    ring = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="compressor pool"):
        kernels.pool(ring, torch.zeros(2, 8), torch.zeros(2, 7), torch.arange(2),
                     torch.arange(1), 2)
