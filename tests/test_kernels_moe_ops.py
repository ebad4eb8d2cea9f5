"""The MoE's one-launch small steps (strata.kernels.moe_ops) against the torch definitions,
under TRITON_INTERPRET=1 on CPU (tests/gpu/test_kernels_fused_ops_gpu.py runs them compiled).
The slot sum is bit-exact; routing picks the same experts in the same order; the SwiGLU and
the routing weights agree to fp32 rounding (Triton's exp and log are not torch's)."""
from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first launched

from strata.kernels import moe_ops  # noqa: E402
from strata.model.moe import swiglu  # noqa: E402
from util import route_reference as torch_route  # noqa: E402


def test_routing_picks_the_same_experts_in_the_same_order():
    g = torch.Generator().manual_seed(0)
    T, E, k = 5, 48, 6
    logits = torch.randn(T, E, generator=g) * 4
    logits[0, 30:] = 50.0              # above softplus's threshold: ties, lowest index first
    logits[1] = -30.0                  # far below zero: tiny scores, the bias decides
    logits[2, ::3] = logits[2, 1]      # exact ties inside the scores
    bias = torch.randn(E, generator=g) * 0.1
    bias[7] = -0.0
    idx, w = moe_ops.route(logits, bias, 1.5, k, 2.5)
    ref_idx, ref_w = torch_route(logits, bias, 1.5, k, 2.5)
    assert idx.dtype == torch.int64 and torch.equal(idx, ref_idx)
    torch.testing.assert_close(w, ref_w, rtol=2e-6, atol=1e-30)
    # equal scores (no bias to part them): the lowest index first
    assert moe_ops.route(logits[:1], torch.zeros(E), 1.5, k, 2.5)[0][0].tolist() == \
        list(range(30, 36))
    # a token's picks do not depend on the batch
    assert torch.equal(moe_ops.route(logits[3:4], bias, 1.5, k, 2.5)[0], idx[3:4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [False, True])
def test_swiglu_matches_the_torch_definition(dtype, weighted):
    g = torch.Generator().manual_seed(1)
    gate = (torch.randn(3, 6, 40, generator=g) * 8).to(dtype)
    up = (torch.randn(3, 6, 40, generator=g) * 8).to(dtype)
    w = torch.rand(3, 6, generator=g) if weighted else None
    got = moe_ops.swiglu(gate, up, 7.0, dtype, w)
    want = swiglu(gate, up, 7.0)
    if weighted:
        want = want * w.unsqueeze(-1)
    want = want.to(dtype)
    assert got.dtype == dtype and got.shape == gate.shape
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-6)
    torch.testing.assert_close(got, want, **tol)
    # rows alone equal rows in a batch
    assert torch.equal(moe_ops.swiglu(gate[1:2], up[1:2], 7.0, dtype,
                                      None if w is None else w[1:2]), got[1:2])


def test_the_routed_and_shared_outputs_join_as_torch_adds_and_casts():
    """The slot sum's join with the shared expert's output: torch's fp32 add and cast, ties
    to even and −0 + −0 included (one slot: the routed sum is the slot itself)."""
    g = torch.Generator().manual_seed(5)
    routed = torch.randn(5, 1100, generator=g) * 30  # past one block
    shared = torch.randn(5, 1100, generator=g)
    routed[0, :2] = torch.tensor([1.0, -0.0])
    shared[0, :2] = torch.tensor([3 * 2 ** -8, -0.0])  # a tie (rounds to even: up); −0 + −0
    for dtype in (torch.bfloat16, torch.float32):
        got = moe_ops.slot_sum(routed[:, None], shared, dtype)
        want = (routed + shared).to(dtype)
        assert got.dtype == dtype and torch.equal(got, want)
        assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_slot_sum_is_the_torch_loop_bit_for_bit():
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        y = (torch.randn(4, 6, 70, generator=g) * 100).to(dtype)
        want = y.float()[:, 0]
        for s in range(1, 6):
            want = want + y.float()[:, s]
        assert torch.equal(moe_ops.slot_sum(y), want)
        # with the shared expert's output: join's sum and rounding in the same launch
        shared = torch.randn(4, 70, generator=g) * 100
        for out in (torch.bfloat16, torch.float32):
            assert torch.equal(moe_ops.slot_sum(y, shared, out),
                               (want + shared).to(out)), (dtype, out)
        assert torch.equal(moe_ops.slot_sum(y, dtype=torch.bfloat16), want.to(torch.bfloat16))
    with pytest.raises(ValueError, match="plus"):
        moe_ops.slot_sum(y, shared[:, :-1])
