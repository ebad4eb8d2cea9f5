"""The one-launch qdq kernel (strata.kernels.qdq) against the torch definitions in
strata.quant.qdq, bit for bit (signed zeros included), under TRITON_INTERPRET=1 on CPU
(tests/gpu/test_kernels_fused_ops_gpu.py runs it compiled). Small shapes: the interpreter
is slow."""
from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is first launched

from strata.kernels import qdq as kqdq  # noqa: E402
from strata.quant import qdq  # noqa: E402
from util import qdq_hard_values as hard_values  # noqa: E402

CASES = {  # format: (torch definition, kernel id, block, amax floor)
    "fp8_act": (qdq.fp8_act_qdq, kqdq.FP8_ACT, 32, qdq.FP8_AMAX_FLOOR),
    "fp4_e4m3": (qdq.fp4_qdq_e4m3_scale, kqdq.FP4_E4M3, 16, qdq.FP4_E4M3_AMAX_FLOOR),
    "fp4_ue8m0": (qdq.fp4_qdq_ue8m0, kqdq.FP4_UE8M0, 32, qdq.FP4_UE8M0_AMAX_FLOOR),
}


@pytest.mark.parametrize("fmt", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_torch_definition(fmt, dtype):
    ref, fid, block, floor = CASES[fmt]
    x = hard_values(block)
    if dtype == torch.bfloat16:
        # Triton's interpreter loads bf16 subnormals wrongly (3·2^-133 reads as 2^-127); a
        # GPU's load is exact, and the GPU test keeps them
        x[9:11] = 1e-30
    x = x.to(dtype).view(12, 2, block)  # leading dims as a caller has them
    got = kqdq.qdq(x, fid, block, floor)
    want = ref(x)  # (on CPU: the torch definition)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))


def test_a_strided_input_and_an_empty_one():
    ref, fid, block, floor = CASES["fp8_act"]
    x = hard_values(block).t().contiguous().t()  # non-contiguous view of the same values
    assert torch.equal(kqdq.qdq(x, fid, block, floor), ref(x))
    empty = torch.zeros(0, block)
    assert kqdq.qdq(empty, fid, block, floor).shape == (0, block)
