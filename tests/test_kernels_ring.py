"""A position ring's one-launch write (strata.kernels.ring) against PositionRing's torch
path, under TRITON_INTERPRET=1 on CPU (tests/gpu/test_kernels_fused_ops_gpu.py runs it
compiled)."""
from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is first launched

from strata.kernels.ring import ring_write  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_write_stores_the_torch_paths_rows_and_tags(dtype):
    """Rows at positions mod size (a write that wraps), cast as torch casts (ties to even),
    tags = positions; slots not written keep their contents."""
    g = torch.Generator().manual_seed(1)
    size, shape = 8, (2, 300)  # a row past one block
    rows = torch.randn(size, *shape, generator=g).to(dtype)
    tags = torch.arange(size, dtype=torch.long) - 20
    src = torch.randn(5, *shape, generator=g) * 10
    src[0, 0, 0] = 1 + 3 * 2 ** -8  # rounds up in bf16 (to even)
    positions = torch.arange(13, 18)  # slots 5, 6, 7, 0, 1
    want_rows, want_tags = rows.clone(), tags.clone()
    want_rows[positions % size] = src.to(dtype)
    want_tags[positions % size] = positions
    ring_write(rows, tags, positions, src)
    assert torch.equal(rows, want_rows) and torch.equal(tags, want_tags)


def test_a_mismatched_write_is_refused():
    rows, tags = torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="ring write"):
        ring_write(rows, tags, torch.arange(2), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="ring write"):
        ring_write(rows, tags, torch.arange(5), torch.zeros(5, 3))
