"""The fp8-block / fp4-group kernels and the grouped MoE (strata.kernels.fp8fp4, .moe) against
the torch reference, under TRITON_INTERPRET=1 on CPU (tests/gpu/test_kernels_fp8fp4_gpu.py runs
them compiled at real shapes). Small shapes: the interpreter is slow.

Tolerance (kernel docstring): the kernel and the reference sum the same exact products in fp32
in different orders, so |y − y_ref| ≤ 2·K·2^-24·Σ|x·w| (+ one output ulp for bf16 outputs);
against the exact float64 product the kernel alone is within half of that. Batch invariance
is asserted bit for bit.
"""
from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first launched

from strata.checkpoint.encodings import (dequant_fp4_group, dequant_fp8_block,  # noqa: E402
                                         quant_fp4_group, quant_fp8_block)
from strata.kernels import fp8fp4  # noqa: E402
from strata.kernels.fp8fp4 import forced, quant_matmul, random_stored  # noqa: E402
from strata.kernels.moe import stack_stored  # noqa: E402
from strata.kernels.moe_grouping import group_by_expert  # noqa: E402
from strata.model.moe import ExpertStack  # noqa: E402
from strata.model.numerics import Numerics  # noqa: E402
from strata.quant.linear import Fp4Group32Linear, Fp8Block32Linear  # noqa: E402
from strata.quant.qdq import fp8_act_qdq  # noqa: E402

U = 2.0 ** -24


def dequant(fmt, w, s):
    return dequant_fp8_block(w, s) if fmt == "fp8" else dequant_fp4_group(w, s)


def order_bound(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """2·K·u·Σ_k|x_k·w_k| per output: two fp32 summation orders of the same exact terms."""
    return 2 * x.shape[-1] * U * (x.double().abs() @ W.double().abs().T)


def assert_within(got, ref, bound, ulps: float):
    """|got − ref| ≤ bound + ulps bf16 ulps of ref (an ulp of y is at most 2^-7·|y|)."""
    got, ref = got.double(), ref.double()
    tol = bound * 1.0001 + ulps * 2.0 ** -7 * ref.abs() + 1e-30
    excess = (got - ref).abs() - tol
    assert (excess <= 0).all(), f"max excess {excess.max().item():.3e}"


# ------------------------------------------------------------------------------ plain GEMM
SHAPES = [("fp8", 96, 160), ("fp8", 40, 70), ("fp8", 33, 256), ("fp4", 64, 256),
          ("fp4", 48, 96)]


@pytest.mark.parametrize("fmt,N,K", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_matches_exact_and_reference(fmt, N, K, dtype):
    w, s = random_stored(fmt, N, K, "cpu", seed=N + K)
    W = dequant(fmt, w, s)
    g = torch.Generator().manual_seed(K)
    x = (torch.randn(7, K, generator=g) * 3).to(dtype)
    exact = x.double() @ W.double().T
    bound = order_bound(x, W)
    for out_dtype in (torch.float32, dtype):
        got = quant_matmul(x, w, s, fmt, out_dtype)
        assert got.dtype == out_dtype and got.shape == (7, N)
        bf16_out = out_dtype == torch.bfloat16
        # rounded to nearest even: within half an ulp of the fp32 sum
        assert_within(got, exact, bound / 2, 0.5 if bf16_out else 0)
        # the reference: dense copy in the operand dtype, fp32 accumulation (torch bmm)
        ref = (x.float() @ W.to(dtype).float().T).to(out_dtype)
        assert_within(got, ref, bound, 1 if bf16_out else 0)


@pytest.mark.parametrize("fmt,N,K,split", [("fp8", 40, 320, 2), ("fp4", 64, 384, 3),
                                             ("fp8", 33, 512, 4)])
def test_matmul_split_k(fmt, N, K, split):
    """Split K (fixed per weight): still within the bound, and batch-invariant bit for bit."""
    cfg = fp8fp4.Config(block_n=32, block_k=128, split_k=split)
    w, s = random_stored(fmt, N, K, "cpu", seed=K)
    W = dequant(fmt, w, s)
    x = torch.randn(20, K, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = quant_matmul(x, w, s, fmt, out_dtype, cfg)
        bf16_out = out_dtype == torch.bfloat16
        assert_within(got, x.double() @ W.double().T, order_bound(x, W) / 2,
                      0.5 if bf16_out else 0)
        for r in (0, 19):
            assert torch.equal(quant_matmul(x[r:r + 1], w, s, fmt, out_dtype, cfg), got[r:r + 1])


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_decode_is_exact(fmt):
    """x = one-hot rows picks single weights: the kernel's in-register decode == the LUT
    decoder (encodings.dequant_*) bit for bit, every e4m3 / e2m1 code, several scales."""
    K = 256 if fmt == "fp8" else 32
    N = 64
    g = torch.Generator().manual_seed(1)
    if fmt == "fp8":
        w = torch.arange(N * K, dtype=torch.int64).remainder(256).to(torch.uint8).view(N, K)
        w[(w & 0x7F) == 0x7F] = 0x7E  # NaN codes decode differently (module docstring)
        s = torch.randint(100, 150, (N // 32, K // 32), generator=g, dtype=torch.uint8)
        w = w.view(torch.float8_e4m3fn)
    else:
        w = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8).view(torch.int8)
        s = torch.randint(100, 150, (N, K // 32), generator=g, dtype=torch.uint8)
    W = dequant(fmt, w, s)
    for dtype in (torch.float32, torch.bfloat16):
        eye = torch.eye(K, dtype=dtype)
        assert torch.equal(quant_matmul(eye, w, s, fmt, torch.float32), W.T)


def test_matmul_strided_rows_view_and_shape_check():
    """A Linear.rows() slice (non-contiguous strides) and a transposed x view."""
    w, s = random_stored("fp8", 128, 96, "cpu", seed=3)
    lin = Fp8Block32Linear(w, s).rows(32, 96)
    x = torch.randn(96, 5).T  # [5, 96], strides (1, 5)
    got = quant_matmul(x, lin.weight, lin.scale, "fp8", torch.float32)
    W = lin.dequantize()
    assert_within(got, x.double() @ W.double().T, order_bound(x, W) / 2, 0)
    w4, s4 = random_stored("fp4", 96, 64, "cpu", seed=4)
    lin4 = Fp4Group32Linear(w4, s4).rows(16, 80)
    x4 = torch.randn(3, 64)
    W4 = lin4.dequantize()
    got4 = quant_matmul(x4, lin4.weight, lin4.scale, "fp4", torch.float32)
    assert_within(got4, x4.double() @ W4.double().T, order_bound(x4, W4) / 2, 0)
    with pytest.raises(ValueError, match="do not match"):
        quant_matmul(torch.zeros(2, 70), w4, s4, "fp4", torch.float32)


@pytest.mark.parametrize("fmt,N,K", [("fp8", 70, 200), ("fp4", 40, 192)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_batch_invariance(fmt, N, K, dtype):
    """A row alone == the same row inside M=5 and M=37 (other tiles, other lanes), bit for bit."""
    w, s = random_stored(fmt, N, K, "cpu", seed=5)
    g = torch.Generator().manual_seed(6)
    big = (torch.randn(37, K, generator=g) * 2).to(dtype)
    full = quant_matmul(big, w, s, fmt, dtype)
    five = quant_matmul(big[30:35], w, s, fmt, dtype)
    assert torch.equal(five, full[30:35])
    for r in (0, 17, 32, 36):
        assert torch.equal(quant_matmul(big[r:r + 1], w, s, fmt, dtype), full[r:r + 1])
    # the same row at another lane of a tile, with other neighbours
    shuffled = big[torch.tensor([36, 5, 17, 0, 32])]
    got = quant_matmul(shuffled, w, s, fmt, dtype)
    assert torch.equal(got, full[torch.tensor([36, 5, 17, 0, 32])])


def test_fp8_qdq_kernel_is_bit_exact():
    """The MoE epilogue's in-kernel fp8 activation qdq == quant.qdq.fp8_act_qdq, including
    round-half-even ties, e4m3 subnormals, the 1e-4 amax floor and power-of-two amaxes."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40, 64, generator=g) * torch.logspace(-7, 4, 40)[:, None]
    # ties: scale 1 blocks (amax 448) holding exact midpoints of the e4m3 grid
    ties = torch.tensor([448.0, 1.0625, 1.1875, 17.0, 19.0, 0.0146484375, 0.0029296875,
                         0.0009765625, -2.5 * 2.0 ** -9, -3.5 * 2.0 ** -9, 240.0, -416.0])
    x[0, :12] = ties
    x[0, 12:32] = 0.5
    x[1, :32] = 0.0  # all-zero block: floor
    x[2, :32] = 448.0 * 2.0 ** -3  # power-of-two boundary of amax/448
    x[2, 32:64] = torch.nextafter(torch.tensor(448.0 * 2.0 ** -3), torch.tensor(1e9))
    got = fp8fp4.fp8_act_qdq_kernel(x)
    assert torch.equal(got, fp8_act_qdq(x))


# ------------------------------------------------------------------------ Linear dispatch
def _linears(seed: int):
    g = torch.Generator().manual_seed(seed)
    w8, s8 = quant_fp8_block(torch.randn(96, 128, generator=g) * 0.05)
    w4, s4 = quant_fp4_group(torch.randn(64, 128, generator=g) * 0.05)
    return [Fp8Block32Linear(w8, s8), Fp4Group32Linear(w4, s4)]


@pytest.mark.parametrize("mode", ["reference", "vendor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_forced_kernel_vs_reference(mode, dtype):
    nx = Numerics(mode=mode, act_dtype=dtype)
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(6, 128, generator=g) * 4).to(dtype)
    for lin in _linears(9):
        W = lin.dequantize()
        for out_dtype, act_quant in ((None, True), (torch.float32, True), (None, False)):
            ref = lin(x, nx, out_dtype, act_quant)  # CPU: the reference path, not forced
            assert torch.equal(ref, super(type(lin), lin).forward(x, nx, out_dtype, act_quant))
            with forced():
                got = lin(x, nx, out_dtype, act_quant)
                got_f = lin.forward(x, nx, out_dtype, act_quant)
            assert torch.equal(got, got_f)
            assert got.dtype == ref.dtype and got.shape == ref.shape
            xin = fp8_act_qdq(x) if (nx.quantize and act_quant) else x
            cd = torch.float32 if out_dtype == torch.float32 else dtype
            bound = order_bound(xin.to(cd), W)
            assert_within(got, ref, bound, 1 if got.dtype == torch.bfloat16 else 0)
    for lin in _linears(9):  # the kernel path never materialises a dense copy
        with forced():
            lin(x, nx)
        assert not lin._dense


# ----------------------------------------------------------------------------- grouped MoE
class _Cfg:
    hidden_size, moe_intermediate_size, swiglu_limit = 96, 64, 10.0


class _Reader:
    """Just enough of a WeightReader for ExpertStack: experts quantized from random weights."""

    def __init__(self, fmt: str, seed: int) -> None:
        self.fmt, self.gen = fmt, torch.Generator().manual_seed(seed)

    def linear(self, prefix: str, out_features: int, in_features: int):
        w = torch.randn(out_features, in_features, generator=self.gen) * 0.15
        if self.fmt == "fp8":
            return Fp8Block32Linear(*quant_fp8_block(w))
        return Fp4Group32Linear(*quant_fp4_group(w))


def _stack(fmt: str, n_experts: int = 6) -> ExpertStack:
    return ExpertStack(_Cfg(), _Reader(fmt, 10 + len(fmt)), "ffn.experts", n_experts)


def _routing(T: int, E: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if T > 4:
        idx[: T // 2, 0] = 1  # one popular expert: more than BLOCK_M pairs when T ≥ 32
    return idx, 0.3 + torch.rand(T, k, generator=g)


def assert_moe_close(got: torch.Tensor, ref: torch.Tensor, nx: Numerics) -> None:
    """fp32 reference numerics: only summation order and silu's exp differ (≤ 2e-5 of the
    largest output). bf16 or vendor numerics round intermediates (w1/w3 products and the
    outputs to bf16, activations to fp8), and a tiny fp32 difference can move one rounding by
    a step: then an output may move by up to 3e-2 of the largest, but such flips are rare —
    at most 2% of the outputs may differ by more than one bf16 ulp."""
    scale = ref.abs().max().item()
    d = (got - ref).abs()
    if nx.act_dtype == torch.float32 and not nx.quantize:
        assert d.max().item() <= 2e-5 * scale, d.max().item() / scale
        return
    assert d.max().item() <= 3e-2 * scale, d.max().item() / scale
    off = (d > 2.0 ** -7 * ref.abs() + 1e-6 * scale).float().mean().item()
    assert off <= 0.02, off


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
@pytest.mark.parametrize("mode", ["reference", "vendor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_grouped_vs_reference_expert_stack(fmt, mode, dtype):
    stack = _stack(fmt)
    assert stack.format == fmt
    nx = Numerics(mode=mode, act_dtype=dtype)
    g = torch.Generator().manual_seed(11)
    for T in (1, 20):  # the gather path (T·k ≤ 16) and the grouped one of the reference
        x = (torch.randn(T, 96, generator=g) * 6).to(dtype)
        idx, w = _routing(T, 6, 2, seed=T)
        ref = stack.forward(x, idx, w, nx)  # CPU, not forced: the reference
        with forced():
            got = stack.forward(x, idx, w, nx)
        assert got.dtype == torch.float32 and got.shape == (T, 96)
        assert_moe_close(got, ref, nx)


def test_moe_grouped_never_dequantizes_and_stacks_views():
    stack = _stack("fp4")
    x = torch.randn(4, 96)
    idx, w = _routing(4, 6, 2, seed=1)
    with forced():
        stack.forward(x, idx, w, Numerics())
    assert not stack._dense  # no dense() on the kernel path
    st = stack.stored()
    assert st["w1"].weight.shape == (6, 64, 48) and st["w2"].scale.shape == (6, 96, 2)
    for e, lin in enumerate(stack.linears["w1"]):  # the Linears view the stack: held once
        assert lin.weight.data_ptr() == st["w1"].weight[e].data_ptr()
        assert lin.scale.data_ptr() == st["w1"].scale[e].data_ptr()
    with pytest.raises(ValueError, match="expected fp4 or fp8"):
        from strata.quant.linear import DenseLinear
        stack_stored([DenseLinear(torch.zeros(4, 4))])


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
@pytest.mark.parametrize("mode", ["reference", "vendor"])
def test_moe_pair_independent_of_tile_mates(fmt, mode):
    """A token's output is bit-identical alone (T=1), among 37 tokens (a popular expert spills
    over several tiles) and in another order (other lanes, other tile mates)."""
    stack = _stack(fmt)
    nx = Numerics(mode=mode, act_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(12)
    T = 37
    x = (torch.randn(T, 96, generator=g) * 6).to(torch.bfloat16)
    idx, w = _routing(T, 6, 2, seed=2)
    groups = group_by_expert(idx, 6, fp8fp4.BLOCK_M)
    assert (groups.tile_expert == 1).sum() >= 2  # expert 1 spans several tiles
    with forced():
        full = stack.forward(x, idx, w, nx)
        for t in (5, 36):
            assert torch.equal(stack.forward(x[t:t + 1], idx[t:t + 1], w[t:t + 1], nx),
                               full[t:t + 1])
        perm = torch.randperm(T, generator=g)
        assert torch.equal(stack.forward(x[perm], idx[perm], w[perm], nx), full[perm])


@pytest.mark.parametrize("mode", ["reference", "vendor"])
def test_moe_tiny_fixture_experts(tiny_dir, mode):
    """The tiny checkpoint's fp4 experts (layer 0), loaded as the model loads them."""
    from strata.model.model import Model
    model = Model.load(tiny_dir, "cpu", Numerics(mode=mode))
    stack = model.layers[0].ffn.experts
    assert stack.format == "fp4"
    D, E = model.cfg.hidden_size, stack.n_experts
    g = torch.Generator().manual_seed(13)
    for T in (2, 12):
        x = torch.randn(T, D, generator=g) * 12
        idx, w = _routing(T, E, 2, seed=T + 50)
        nx = Numerics(mode=mode)
        ref = stack.forward(x, idx, w, nx)
        with forced():
            got = stack.forward(x, idx, w, nx)
        assert_moe_close(got, ref, nx)


def test_tiny_model_forward_with_forced_kernels(tiny_dir):
    """The whole tiny model (vendor numerics: every fp8/fp4 Linear incl. the fp32-output shared
    expert w2, the grouped experts) with the kernels forced vs the CPU reference. (The chunk /
    decode bit-identity of whole forwards is the GPU suite's parity ladder: slow here.)"""
    from strata.model.model import Model
    from util import random_tokens
    model = Model.load(tiny_dir, "cpu", Numerics(mode="vendor"))
    tokens = random_tokens(4, seed=3)
    ref = model.forward(tokens, model.new_state(64))[0]
    with forced():
        got = model.forward(tokens, model.new_state(64))[0]
    assert torch.isfinite(got).all()
    err = (got - ref).abs().max().item()
    assert err <= 1e-4 * ref.abs().max().item(), err


# ------------------------------------------------------------------ EXL3 experts (dispatch)
class _Exl3Cfg:
    hidden_size, moe_intermediate_size, swiglu_limit = 128, 128, 10.0


class _Exl3Reader:
    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def linear(self, prefix: str, out_features: int, in_features: int):
        from strata.quant.exl3 import Exl3Linear
        tr = torch.randint(-2**15, 2**15, (in_features // 16, out_features // 16, 32),
                           generator=self.gen, dtype=torch.int32).to(torch.int16)
        suh = (torch.randn(in_features, generator=self.gen) * 0.3).half()
        svh = (torch.randn(out_features, generator=self.gen) * 0.3).half()
        return Exl3Linear(tr, suh, svh, "mcg", out_features, in_features)


def test_exl3_experts_dispatch_to_the_grouped_exl3_kernel():
    """EXL3 experts go through kernels.exl3.exl3_moe_linear (when its KERNELS switch says so):
    close to the dense reference, a token bit-identical alone and in the batch, no dense()."""
    import strata.quant.exl3 as qexl3
    stack = ExpertStack(_Exl3Cfg(), _Exl3Reader(20), "ffn.experts", 4)
    assert stack.format == "exl3"
    nx = Numerics(act_dtype=torch.float32)
    g = torch.Generator().manual_seed(21)
    x = torch.randn(3, 128, generator=g) * 4
    idx, w = _routing(3, 4, 2, seed=22)
    old = qexl3.KERNELS
    try:
        qexl3.KERNELS = "always"
        got = stack.forward(x, idx, w, nx)
        assert not stack._dense
        assert torch.equal(stack.forward(x[1:2], idx[1:2], w[1:2], nx), got[1:2])
        qexl3.KERNELS = "never"
        ref = stack.forward(x, idx, w, nx)
    finally:
        qexl3.KERNELS = old
    # fp16 rotated activations (Exl3Linear's numerics) vs the dense fp32 reference
    assert (got - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()


def test_row_slices_keep_the_whole_weights_kernel_order(monkeypatch):
    """Tensor parallelism cuts a weight's rows; the kernel's split-K comes from the weight's
    shape, so a slice must keep the whole weight's configuration to sum each row in the same
    order (forced kernels under the interpreter; a small SPLIT_TARGET makes the two shapes'
    own splits differ)."""
    from strata.model.numerics import Numerics
    from strata.runtime.parallel_tp import slice_out
    monkeypatch.setattr(fp8fp4, "SPLIT_TARGET", 16)
    N, K = 256, 2048
    f8 = fp8fp4.FORMATS["fp8"]
    assert fp8fp4.config_for(f8, N, K).split_k != fp8fp4.config_for(f8, N // 2, K).split_k
    g = torch.Generator().manual_seed(21)
    w = (torch.randint(0, 256, (N, K), generator=g, dtype=torch.int32).to(torch.uint8) & 0x77)
    s = torch.full((N // 32, K // 32), 120, dtype=torch.uint8)
    full = Fp8Block32Linear(w.view(torch.float8_e4m3fn), s)
    half = slice_out(full, N // 2, N)
    assert half.kernel_config == fp8fp4.config_for(f8, N, K)
    x = torch.randn(3, K, generator=g)
    nx = Numerics()
    with fp8fp4.forced():
        y_full = full(x, nx, torch.float32)
        y_half = half(x, nx, torch.float32)
    assert torch.equal(y_half, y_full[:, N // 2:])
