"""The Engram gate and its update of the stream in one launch (strata.kernels.engram) against
the torch steps (strata.model.engram.gate_update on CPU), under TRITON_INTERPRET=1
(tests/gpu/test_kernels_fused_ops_gpu.py runs it compiled against torch's CUDA ops)."""
from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is first launched

from strata.kernels import engram as kernels  # noqa: E402
from strata.model.engram import gate_update as torch_gate  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gate_and_update_give_the_torch_steps_values(dtype):
    """Copies of a stream whose row width is past a power of two, the keys and value views of
    one projection (strided rows), a row whose dot is exactly zero (copysign keeps +0 at
    +1e-3) and one with a negative dot; each row alone gives its bits in the batch."""
    g = torch.Generator().manual_seed(5)
    T, H, D = 5, 4, 1100
    h = (torch.randn(T, H, D, generator=g) * 2).to(dtype)
    w = torch.randn(H, D, generator=g)
    kv = torch.randn(T, (H + 1) * D, generator=g)
    kv[0, :D] = 0  # row 0, copy 0: the dot is +0
    key, value = kv[:, :H * D].view(T, H, D), kv[:, H * D:]
    got = kernels.gate_update(h, w, key, value, 1e-20)
    want = torch_gate(h, w, key, value, 1e-20)
    assert got.dtype == dtype and got.shape == (T, H, D)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    one = kernels.gate_update(h[3:4], w, key[3:4], value[3:4], 1e-20)
    assert torch.equal(one[0], got[3])


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="engram gate"):
        kernels.gate_update(torch.zeros(2, 4, 8), torch.zeros(4, 8), torch.zeros(2, 4, 8),
                            torch.zeros(2, 7), 1e-6)
