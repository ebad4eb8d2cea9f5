"""The EXL3 Triton kernels (strata.kernels.exl3) against the torch reference (strata.quant.exl3),
under TRITON_INTERPRET=1 on CPU with small shapes (tests/gpu/test_kernels_exl3_gpu.py runs the
same checks compiled, at the V4.1 shapes).

Exact (bit for bit): reconstructed Ŵ vs decode_trellis (every codebook, integer and half K);
fused decode vs reconstruct + GEMM; a row alone vs inside M = 5 / 37 (fused and GEMM paths);
MoE grouped pairs vs the single linear per pair (tiles that cross the fused output step's
row sub-blocks too); x·suh → fp16 before the Hadamard.
Tolerance: the butterfly Hadamard vs the reference's matrix product (≤ 1 fp16 ulp after the cast
in rotate_in; ~1e-6 relative in fp32 for rotate_out), hence the linear vs the reference
(relative 2e-3 of the output's max, from fp16 x' ulps and fp32 summation order)."""
from __future__ import annotations

import json
import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first launched

pytest.importorskip("triton")

import strata.quant.exl3 as qexl3  # noqa: E402
from strata.kernels import exl3 as X  # noqa: E402
from strata.kernels import exl3_mma  # noqa: E402
from strata.kernels.moe_grouping import Routing, group_by_expert  # noqa: E402
from strata.model.numerics import Numerics  # noqa: E402
from strata.quant.exl3 import Exl3Linear, _rotate, decode_trellis  # noqa: E402


def trellis_of(kt: int, nt: int, K: float, seed: int, E: int | None = None) -> torch.Tensor:
    L = int(16 * K) if K == int(K) else int(16 * (K - 0.5)) + 8
    g = torch.Generator().manual_seed(seed)
    shape = (kt, nt, L) if E is None else (E, kt, nt, L)
    return torch.randint(-2**15, 2**15, shape, generator=g, dtype=torch.int32).to(torch.int16)


def scales(n: int, seed: int, E: int | None = None, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (n,) if E is None else (E, n)
    return (torch.randn(shape, generator=g) * scale).half()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.float16 else t.view(torch.int32)


@pytest.mark.parametrize("K,codebook", [(1, "3inst"), (2, "mcg"), (3, "3inst"), (4, "mul1"),
                                        (5, "mcg"), (6, "mul1"), (7, "3inst"), (8, "mcg"),
                                        (1.5, "mul1"), (2.5, "mul1"), (3.5, "mul1")])
def test_reconstruct_is_bit_exact(K, codebook):
    tr = trellis_of(8, 4, K, seed=int(10 * K))
    got = X.reconstruct(tr, codebook)
    assert got.dtype == torch.float16 and got.shape == (128, 64)
    assert torch.equal(bits(got), bits(decode_trellis(tr, codebook)))


def test_reconstruct_column_slice_and_shapes():
    tr = trellis_of(8, 8, 3, seed=5)
    full = decode_trellis(tr, "mcg")
    assert torch.equal(bits(X.reconstruct(tr, "mcg", n_start=64, n_cols=64)), bits(full[:, 64:]))
    with pytest.raises(ValueError, match="64-aligned"):
        X.reconstruct(tr, "mcg", n_start=16)
    with pytest.raises(ValueError, match="mul1"):
        X.reconstruct(trellis_of(8, 4, 2.5, seed=1), "mcg")
    with pytest.raises(ValueError, match="multiples"):
        X.reconstruct(trellis_of(4, 4, 2, seed=1), "mcg")


def test_split_schedule_is_a_function_of_the_shape():
    for kp, n_p in [(128, 128), (256, 128), (5120, 2304), (2304, 5120), (1280, 32768),
                    (8192, 5120), (5120, 129280)]:
        per, S = X.split_schedule(kp, n_p)
        steps = kp // X.BLOCK_K
        assert 1 <= per <= steps and S == -(-steps // per) and (S - 1) * per < steps
    assert X.split_schedule(256, 128) == (1, 2)  # the small shapes below do split K


@pytest.mark.parametrize("K,codebook", [(2, "mcg"), (2.5, "mul1"), (4, "3inst")])
def test_fused_equals_gemm_and_the_product(K, codebook):
    """Two k-splits (256 × 128); the fused and reconstruct+GEMM paths give the same bits, and
    both equal x'·Ŵ up to fp32 summation order."""
    tr = trellis_of(16, 8, K, seed=3)
    g = torch.Generator().manual_seed(4)
    xr = torch.randn(5, 256, generator=g).half()
    fused = X.exl3_matmul(xr, tr, codebook, "fused")
    gemm = X.exl3_matmul(xr, tr, codebook, "gemm")
    assert torch.equal(bits(fused), bits(gemm))
    w = decode_trellis(tr, codebook).double()
    ref = xr.double() @ w
    bound = (xr.double().abs() @ w.abs()) * (256 * 2.0 ** -22)  # fp32 sums of exact products
    assert bool(((fused.double() - ref).abs() <= bound).all())


def test_gemm_operands_through_tma_are_the_same_matrices(monkeypatch):
    """The GEMM's TMA form (GEMM_TMA: tensor descriptors, Hopper's) against its loads: the
    same bits, a partial row tile included (TMA reads the rows past M as zeros)."""
    tr = trellis_of(8, 16, 2, seed=11)
    xr = torch.randn(131, 128, generator=torch.Generator().manual_seed(12)).half()
    assert X._gemm_tma(xr)
    tma = X.exl3_matmul(xr, tr, "mul1", "gemm")
    monkeypatch.setattr(X, "GEMM_TMA", False)
    assert torch.equal(bits(X.exl3_matmul(xr, tr, "mul1", "gemm")), bits(tma))


def test_gemm_joined_operand_is_the_same_matrix(monkeypatch):
    """The GEMM's JOIN_B form (GPUs without wgmma: Ŵ's column pairs joined so the dot operand
    gets the decode's layout) multiplies by the same Ŵ: same bits as the plain load here."""
    tr = trellis_of(8, 16, 2, seed=9)
    xr = torch.randn(3, 128, generator=torch.Generator().manual_seed(10)).half()
    plain = X.exl3_matmul(xr, tr, "mul1", "gemm")
    monkeypatch.setattr(X, "_join_b", lambda t: True)
    assert torch.equal(bits(X.exl3_matmul(xr, tr, "mul1", "gemm")), bits(plain))


def test_rows_are_batch_invariant():
    """A row alone (M = 1) == the same row inside M = 5 and M = FUSED_MAX_ROWS + 5, fused and
    GEMM paths alike (auto picks fused at ≤ FUSED_MAX_ROWS, GEMM above: the big M crosses the
    switch and spans two fused row tiles)."""
    tr = trellis_of(8, 16, 3, seed=7)
    g = torch.Generator().manual_seed(8)
    M = X.FUSED_MAX_ROWS + 5
    rows = torch.randn(M, 128, generator=g).half()
    alone = X.exl3_matmul(rows[20:21], tr, "mcg")
    in5 = X.exl3_matmul(torch.cat([rows[:2], rows[20:21], rows[30:32]]), tr, "mcg")
    assert M > X.BLOCK_M
    inM_gemm = X.exl3_matmul(rows, tr, "mcg")
    inM_fused = X.exl3_matmul(rows, tr, "mcg", "fused")
    for other in (in5[2], inM_gemm[20], inM_fused[20]):
        assert torch.equal(bits(alone[0]), bits(other))
    assert torch.equal(bits(inM_gemm), bits(inM_fused))


def test_linear_paths_are_bit_identical():
    """The whole linear: fused kernel finishing its column blocks (arrival counters) == the
    reconstruct + GEMM + rotate_out path, with bias and a trimmed output; rows alone == in M=37.
    M = 37 spans three FINISH_ROWS sub-blocks of the fused output step, the last one partial:
    every row must come out once, in its place (rotate_out finishes each row on its own)."""
    tr = trellis_of(16, 8, 2.5, seed=70)
    suh, svh, bias = scales(256, 71, scale=0.1), scales(128, 72), scales(100, 73)
    x = torch.randn(37, 250, generator=torch.Generator().manual_seed(74))
    fused = X.exl3_linear(x[:5], tr, suh, svh, "mul1", 100, bias, path="fused")
    gemm = X.exl3_linear(x[:5], tr, suh, svh, "mul1", 100, bias, path="gemm")
    assert fused.shape == (5, 100) and torch.equal(bits(fused), bits(gemm))
    assert 2 * X.FINISH_ROWS < 37 < 3 * X.FINISH_ROWS and 37 <= X.FUSED_MAX_ROWS
    auto37 = X.exl3_linear(x, tr, suh, svh, "mul1", 100, bias)  # ≤ FUSED_MAX_ROWS: fused
    gemm37 = X.exl3_linear(x, tr, suh, svh, "mul1", 100, bias, path="gemm")
    assert torch.equal(bits(auto37), bits(gemm37))
    assert torch.equal(bits(auto37[:5]), bits(fused))
    again = X.exl3_linear(x[3:4], tr, suh, svh, "mul1", 100, bias)  # counters were reset
    assert torch.equal(bits(again[0]), bits(fused[3]))
    last = X.exl3_linear(x[36:37], tr, suh, svh, "mul1", 100, bias)
    assert torch.equal(bits(last[0]), bits(auto37[36]))


def test_rotate_in_matches_the_reference():
    """fp16(x·suh) is bit-identical; the butterfly Hadamard then differs from the reference's
    matrix product by at most one fp16 ulp, in few elements."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(7, 256, generator=g) * 3
    suh = scales(256, 10, scale=0.5)
    got = X.rotate_in(x, suh)
    ref = _rotate((x * suh.float()).half().float()).half()
    diff = (got.float() - ref.float()).abs()
    ulp = torch.finfo(torch.float16).eps * ref.float().abs().clamp(min=2**-14)
    assert bool((diff <= ulp).all())
    assert (diff > 0).float().mean() < 0.02
    # batch invariance, and a narrower input is zero-extended
    assert torch.equal(bits(X.rotate_in(x[3:4], suh)[0]), bits(got[3]))
    narrow = X.rotate_in(x[:, :200], suh)
    xz = torch.nn.functional.pad(x[:, :200], (0, 56))
    assert torch.equal(bits(narrow), bits(X.rotate_in(xz, suh)))
    # the CUDA decode kernel's input: the same values, each 128-block in fragment order
    frag = X.rotate_in(x, suh, fragment_order=True)
    assert torch.equal(bits(frag), bits(exl3_mma.fragment_order(got)))


def test_rotate_out_matches_the_reference():
    g = torch.Generator().manual_seed(11)
    part = torch.randn(3, 6, 256, generator=g)
    svh = scales(256, 12)
    bias = torch.randn(200, generator=g).half()
    got = X.rotate_out(part, svh, bias, out_features=200, out_dtype=torch.float32)
    y = X.sum_partials(part)
    ref = (_rotate(y) * svh.float())[:, :200] + bias.float()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    alone = X.rotate_out(part[:, 4:5], svh, bias, out_features=200)
    assert torch.equal(bits(alone[0]), bits(got[4]))
    bf = X.rotate_out(part, svh, None, out_dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and bf.shape == (6, 256)


@pytest.fixture
def kernels_on_cpu():
    old = qexl3.KERNELS
    qexl3.KERNELS = "always"
    yield
    qexl3.KERNELS = old


def test_exl3_linear_forward_uses_the_kernels(kernels_on_cpu):
    """Exl3Linear.forward with KERNELS='always' (CPU, interpreter) vs the reference path:
    padded input/output, bias, dtypes; rows batch-invariant through the module."""
    tr = trellis_of(8, 16, 2.5, seed=13)
    lin = Exl3Linear(tr, scales(128, 14, scale=0.2), scales(256, 15), "mul1",
                     out_features=200, in_features=100, bias=scales(200, 16))
    g = torch.Generator().manual_seed(17)
    x = torch.randn(3, 100, generator=g)
    nx = Numerics()
    got = lin.forward(x, nx)
    qexl3.KERNELS = "never"
    ref = lin.forward(x, nx)
    qexl3.KERNELS = "always"
    assert got.shape == ref.shape == (3, 200) and got.dtype == torch.float32
    assert float((got - ref).abs().max()) <= 2e-3 * float(ref.abs().max())
    assert torch.equal(bits(lin.forward(x[1:2], nx)[0]), bits(got[1]))
    y16 = lin.forward(x.bfloat16(), nx, out_dtype=torch.bfloat16)
    assert y16.dtype == torch.bfloat16 and y16.shape == (3, 200)
    assert lin.forward(x[:0], nx).shape == (0, 200)


def test_model_calls_dispatch(kernels_on_cpu):
    """lin(x, nx) (how the model calls linears) is the class's own forward: the kernels when
    they run, the rotated-activation reference otherwise."""
    lin = Exl3Linear(trellis_of(8, 8, 2, seed=60), scales(128, 61, scale=0.2), scales(128, 62),
                     "mcg", 128, 128)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(63))
    nx = Numerics()
    fused = lin(x, nx)
    assert torch.equal(fused, lin.forward(x, nx))
    qexl3.KERNELS = "auto"
    ref = lin(x, nx)
    assert torch.equal(ref, lin.forward(x, nx)) and not torch.equal(ref, fused)
    torch.testing.assert_close(fused, ref, rtol=0, atol=2e-3 * float(ref.abs().max()))


def test_kernel_switch_values():
    old = qexl3.KERNELS
    try:
        qexl3.KERNELS = "bogus"
        with pytest.raises(ValueError, match="KERNELS"):
            qexl3._use_kernels(torch.zeros(1))
        qexl3.KERNELS = "auto"
        assert not qexl3._use_kernels(torch.zeros(1))  # CPU: the reference path
    finally:
        qexl3.KERNELS = old


def test_moe_grouped_pairs_equal_the_single_linear():
    """Gate and up (two weight sets) in one grouped launch: every (token, slot) pair equals
    exl3_linear of its expert bit for bit, and does not depend on the other pairs."""
    E, kt, nt = 4, 8, 8
    sets = [(trellis_of(kt, nt, 2, seed=20 + w, E=E), scales(128, 30 + w, E, 0.2),
             scales(128, 40 + w, E)) for w in range(2)]
    idx = torch.tensor([[0, 3], [3, 2], [0, 3]])
    g = torch.Generator().manual_seed(21)
    x = torch.randn(3, 128, generator=g)
    gate, up = X.exl3_moe_linear(x, idx, sets, "mcg")
    assert gate.shape == up.shape == (3, 2, 128)
    for (tr, suh, svh), out in zip(sets, (gate, up)):
        # the single linear of each expert over all tokens (its rows are batch-invariant:
        # test_rows_are_batch_invariant), compared pair by pair
        ref = {e: X.exl3_linear(x, tr[e], suh[e], svh[e], "mcg") for e in (0, 2, 3)}
        for t in range(3):
            for s in range(2):
                assert torch.equal(bits(ref[int(idx[t, s])][t]), bits(out[t, s])), (t, s)
    # token 1 alone: same bits as inside the step (its pairs shared tiles with tokens 0 and 2)
    g1, u1 = X.exl3_moe_linear(x[1:2], idx[1:2], sets, "mcg")
    assert torch.equal(bits(g1[0]), bits(gate[1])) and torch.equal(bits(u1[0]), bits(up[1]))


def test_moe_tiles_cross_the_finish_sub_blocks():
    """The fused output step finishes a tile in FINISH_ROWS sub-blocks, only those holding
    pairs: a tile of 17 pairs (one expert, crossing a sub-block boundary), one of 15 and two
    of a single pair, two weight sets; every pair equals its expert's GEMM-path linear (an
    output step per row, independent of the fused one) bit for bit."""
    E = 4
    sets = [(trellis_of(8, 8, 2, seed=90 + w, E=E), scales(128, 92 + w, E, 0.2),
             scales(128, 94 + w, E)) for w in range(2)]
    T = X.FINISH_ROWS + 1
    idx = torch.tensor([[0, 1 if t == 3 else 2 if t == 9 else 3] for t in range(T)])
    groups = group_by_expert(idx, E, X.BLOCK_M)
    used = groups.tile_expert >= 0
    assert sorted((groups.tile_rows[used] >= 0).sum(1).tolist()) == [1, 1, T - 2, T]
    x = torch.randn(T, 128, generator=torch.Generator().manual_seed(96))
    routing = Routing(idx, E)
    outs = X.exl3_moe_linear(x, idx, sets, "mcg", routing=routing)
    # (the Triton kernel's tiles here: the call made that grouping, and the same one)
    assert torch.equal(routing.groups(X.BLOCK_M).tile_rows, groups.tile_rows)
    with pytest.raises(ValueError, match="routing for ids"):
        X.exl3_moe_linear(x[:3], idx[:3], sets, "mcg", routing=routing)
    for (tr, suh, svh), out in zip(sets, outs):
        ref = {e: X.exl3_linear(x, tr[e], suh[e], svh[e], "mcg", path="gemm") for e in range(E)}
        for t in range(T):
            for s in range(2):
                assert torch.equal(bits(ref[int(idx[t, s])][t]), bits(out[t, s])), (t, s)


def test_moe_split_loop_and_chunking_keep_the_bits(monkeypatch):
    """Two K splits (256 × 128): the split-parallel launch with the folded output step, the
    split-loop launch (programs run the splits themselves; for many pairs), in 64- and
    128-pair tiles, and token chunks all give the single linear's bits."""
    E = 3
    sets = [(trellis_of(16, 8, 2, seed=80 + w, E=E), scales(256, 82 + w, E, 0.1),
             scales(128, 84 + w, E)) for w in range(2)]
    idx = torch.tensor([[2, 0], [1, 2], [2, 1]])
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(86))
    assert X.split_schedule(256, 128)[1] == 2
    ref = [{e: X.exl3_linear(x, tr[e], suh[e], svh[e], "mcg") for e in range(E)}
           for tr, suh, svh in sets]
    runs = [X.exl3_moe_linear(x, idx, sets, "mcg")]
    monkeypatch.setattr(X, "MOE_SPLIT_LOOP_PAIRS", 0)
    runs.append(X.exl3_moe_linear(x, idx, sets, "mcg"))
    monkeypatch.setattr(X, "MOE_LOOP_BLOCK_M", 128)
    runs.append(X.exl3_moe_linear(x, idx, sets, "mcg"))
    monkeypatch.setattr(X, "MOE_MAX_PAIRS", 4)  # chunks of 2 tokens
    runs.append(X.exl3_moe_linear(x, idx, sets, "mcg"))
    for outs in runs:
        for w in range(2):
            for t in range(3):
                for s in range(2):
                    assert torch.equal(bits(outs[w][t, s]), bits(ref[w][int(idx[t, s])][t]))


def test_moe_with_the_experts_split_schedule(monkeypatch):
    """target_programs (the grouped weights' schedule, exl3.GROUPED_TARGET_PROGRAMS): one split
    instead of the default two here; each pair equals its expert's linear under the same
    target, in the split-parallel and split-loop launches and in token chunks."""
    E = 3
    sets = [(trellis_of(16, 8, 2, seed=90 + w, E=E), scales(256, 92 + w, E, 0.1),
             scales(128, 94 + w, E)) for w in range(2)]
    idx = torch.tensor([[2, 0], [1, 2], [2, 1]])
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(96))
    assert X.split_schedule(256, 128) == (1, 2) and X.split_schedule(256, 128, 1) == (2, 1)
    runs = [X.exl3_moe_linear(x, idx, sets, "mcg", target_programs=1)]
    monkeypatch.setattr(X, "MOE_MAX_PAIRS", 4)  # chunks of 2 tokens
    runs.append(X.exl3_moe_linear(x, idx, sets, "mcg", target_programs=1))
    monkeypatch.setattr(X, "MOE_SPLIT_LOOP_PAIRS", 0)
    runs.append(X.exl3_moe_linear(x, idx, sets, "mcg", target_programs=1))
    ref = [{e: X.exl3_linear(x, tr[e], suh[e], svh[e], "mcg", target_programs=1)
            for e in range(E)} for tr, suh, svh in sets]
    for outs in runs:
        for w in range(2):
            for t in range(3):
                for s in range(2):
                    assert torch.equal(bits(outs[w][t, s]), bits(ref[w][int(idx[t, s])][t]))


def test_moe_per_pair_inputs_and_trim():
    """The down projection's form: one input per pair ([T, k, k_in]), trimmed output."""
    E = 3
    tr = trellis_of(8, 8, 2.5, seed=50, E=E)
    suh, svh = scales(128, 51, E, 0.2), scales(128, 52, E)
    idx = torch.tensor([[2, 0], [2, 1]])
    g = torch.Generator().manual_seed(53)
    x = torch.randn(2, 2, 100, generator=g).bfloat16()
    (y,) = X.exl3_moe_linear(x, idx, [(tr, suh, svh)], "mul1", out_features=96,
                             out_dtype=torch.bfloat16)
    assert y.shape == (2, 2, 96) and y.dtype == torch.bfloat16
    for t, s in ((0, 0), (1, 1)):
        e = int(idx[t, s])
        ref = X.exl3_linear(x[t, s:s + 1], tr[e], suh[e], svh[e], "mul1", 96,
                            out_dtype=torch.bfloat16)
        assert torch.equal(ref[0].view(torch.int16), y[t, s].view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_down_projection_of_a_swiglu_input(monkeypatch, dtype):
    """The down projection with its SwiGLU made in the rotation (exl3.SwiGLU): the bits of
    moe_ops.swiglu's rows (clamped gates and ups, routing weights) through the same grouped
    linear — trimmed input (k_in 100 of 128: zero-extended), and in token chunks too."""
    from strata.kernels import moe_ops
    E = 3
    tr = trellis_of(8, 8, 2.5, seed=60, E=E)
    suh, svh = scales(128, 61, E, 0.2), scales(128, 62, E)
    idx = torch.tensor([[2, 0], [2, 1], [1, 0]])
    g = torch.Generator().manual_seed(63)
    gate = (torch.randn(3, 2, 100, generator=g) * 6).to(dtype)  # (past the limit: clamped)
    up = (torch.randn(3, 2, 100, generator=g) * 6).to(dtype)
    weight = torch.rand(3, 2, generator=g)
    limit = 7.0
    a = moe_ops.swiglu(gate, up, limit, dtype, weight)
    assert (gate > limit).any() and (up.abs() > limit).any()
    (want,) = X.exl3_moe_linear(a, idx, [(tr, suh, svh)], "mul1", out_dtype=dtype)
    (got,) = X.exl3_moe_linear(gate, idx, [(tr, suh, svh)], "mul1", out_dtype=dtype,
                               swiglu=X.SwiGLU(up, weight, limit))
    assert torch.equal(bits(got), bits(want))
    monkeypatch.setattr(X, "MOE_MAX_PAIRS", 2)  # chunks of one token
    (chunked,) = X.exl3_moe_linear(gate, idx, [(tr, suh, svh)], "mul1", out_dtype=dtype,
                                   swiglu=X.SwiGLU(up, weight, limit))
    assert torch.equal(bits(chunked), bits(want))
    with pytest.raises(ValueError, match="SwiGLU input"):
        X.exl3_moe_linear(gate, idx, [(tr, suh, svh)], "mul1",
                          swiglu=X.SwiGLU(up[:2], weight, limit))


def test_dot_order_guard(monkeypatch):
    """The exactness guard's rule (the lowering itself is checked on the GPU): on Hopper only
    wgmma passes; elsewhere the first kernel's lowering binds every later one on that GPU."""
    monkeypatch.setattr(X, "_DOT_ORDER", {})
    X._record_dot_order((9, 0), "wgmma", "exl3 fused kernel")
    X._record_dot_order((9, 0), "wgmma", "exl3 gemm kernel")
    with pytest.raises(RuntimeError, match="need wgmma"):
        X._record_dot_order((9, 0), "mma.sync kWidth 4", "exl3 gemm kernel")
    X._record_dot_order((12, 0), "mma.sync kWidth 4", "exl3 fused kernel")
    with pytest.raises(RuntimeError, match="exl3 fused kernel to mma.sync kWidth 4"):
        X._record_dot_order((12, 0), "mma.sync kWidth 2", "exl3 gemm kernel")
    # told not to use wgmma (DISABLE_MMA_V3, as Triton reads it), Hopper binds like the rest
    monkeypatch.setattr(X, "_DOT_ORDER", {})
    monkeypatch.setenv("DISABLE_MMA_V3", "True")
    X._record_dot_order((9, 0), "mma.sync kWidth 2", "exl3 fused kernel")
    with pytest.raises(RuntimeError, match="exl3 fused kernel to mma.sync kWidth 2"):
        X._record_dot_order((9, 0), "wgmma", "exl3 gemm kernel")

    class Compiled:  # a compiled kernel's text as triton exposes it (asm dict)
        def __init__(self, ttgir, ptx):
            self.asm = {"ttgir": ttgir, "ptx": ptx}
    assert X.dot_lowering(Compiled("", "wgmma.mma_async.sync")) == "wgmma"
    assert X.dot_lowering(Compiled("#ttg.dot_op<{opIdx = 1, kWidth = 4}>", "mma.sync")) == \
        "mma.sync kWidth 4"


def test_dot_order_is_what_triton_compiles_for_the_gpu():
    """dot_order compiles the fused kernel for a GPU (no GPU needed; a process without the
    interpreter, which replaces the kernels): wgmma on Hopper, mma.sync elsewhere and on Hopper
    under DISABLE_MMA_V3 — kWidth 2 from Triton 3.8 on, the CUDA kernel's order — and the GEMM
    kernel in the form it takes there (Ŵ through a join) lowers the same way: the premise of
    every EXL3 path giving the same bits on an RTX PRO 6000 (sm_120) or an RTX 4090 (sm_89)."""
    import subprocess
    import sys
    import triton
    script = """
import sys, json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from strata.kernels import exl3 as X
def gemm(arch):
    sig = {n: "constexpr" if n in ("BM", "BN", "BK", "JOIN_B", "TMA") else "*fp16" if n in
           ("x_ptr", "w_ptr", "x_desc", "w_desc") else "*fp32" if n == "y_ptr" else "i32"
           for n in X._gemm_kernel.arg_names}
    c = triton.compile(ASTSource(fn=X._gemm_kernel, signature=sig, constexprs=dict(
        BM=X.GEMM_BLOCK_M, BN=X.GEMM_BLOCK_N, BK=X.BLOCK_K, JOIN_B=True, TMA=False)),
        target=GPUTarget("cuda", arch, 32), options=dict(num_warps=X.GEMM_NUM_WARPS,
        num_stages=X.GEMM_NUM_STAGES))
    return X.dot_lowering(c)
caps = [(12, 0), (8, 9), (9, 0)]
print(json.dumps({"dot": [X.dot_order(c) for c in caps], "gemm": [gemm(120), gemm(89)]}))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # (silences Triton 3.9's notice; options set it)

    def run(**extra):
        out = subprocess.run([sys.executable, "-c", script], env={**env, **extra},
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    got = run()
    order = got["dot"][0]
    assert got == {"dot": [order, order, "wgmma"], "gemm": [order, order]}, triton.__version__
    assert run(DISABLE_MMA_V3="1")["dot"][2] == order
    version = tuple(int(p) for p in triton.__version__.split(".")[:2])
    if version >= (3, 8):  # (kernels.md, session 38: 3.6 gave kWidth 4, 3.8 and 3.9 kWidth 2)
        assert order == "mma.sync kWidth 2", triton.__version__
    elif version == (3, 6):
        assert order == "mma.sync kWidth 4"


def test_the_gemms_split_sums_stay_adds_when_a_split_is_one_step():
    """wkv's and wo_a's schedules give the prefill GEMM splits of one k-step. Compiled for
    sm_90 as a launch compiles it (per_split = 1 as given, pointers and row strides aligned),
    each split's chain must still be added to the total by its own add: Triton's launcher
    makes an integer 1 a constant unless told not to, and with a constant 1 its combine pass
    folds `total + tl.dot(a, b, 0)` into `tl.dot(a, b, total)` — other bits than the decode
    kernels' (session 43, on the device). No GPU needed; a process without the interpreter."""
    import subprocess
    import sys
    script = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from strata.kernels import exl3 as X
fixed = set(X._gemm_kernel.do_not_specialize)
names = X._gemm_kernel.arg_names
consts = dict(BM=X.GEMM_BLOCK_M, BN=X.GEMM_BLOCK_N, BK=X.BLOCK_K, JOIN_B=False, TMA=True)
if "per_split" not in fixed and names.index("per_split") not in fixed:
    consts["per_split"] = 1  # (what the launcher makes of a 1)
desc = {"x_desc": f"tensordesc<fp16[{X.GEMM_BLOCK_M}, {X.BLOCK_K}]>",
        "w_desc": f"tensordesc<fp16[{X.BLOCK_K}, {X.GEMM_BLOCK_N}]>"}
sig = {n: "constexpr" if n in consts else desc[n] if n in desc else "*fp16" if n in
       ("x_ptr", "w_ptr") else "*fp32" if n == "y_ptr" else "i32" for n in names}
attrs = {(names.index(n),): [["tt.divisibility", 16]]
         for n in ("x_ptr", "w_ptr", "y_ptr", "sx_row", "sw_row", "sy_row")}
c = triton.compile(ASTSource(fn=X._gemm_kernel, signature=sig, constexprs=consts, attrs=attrs),
                   target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=X.GEMM_NUM_WARPS, num_stages=X.GEMM_NUM_STAGES))
ttgir = c.asm["ttgir"]
print(json.dumps({"dots": ttgir.count("warp_group_dot "), "adds": ttgir.count("arith.addf")}))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # (silences Triton 3.9's notice; options set it)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["dots"] >= 1 and got["adds"] >= 1, got


def test_cuda_order_reason_asks_once_and_never_inside_a_capture(monkeypatch):
    """The CUDA kernel's gate on a GPU (mocked: no GPU here — the capability, the lowering and
    the probe are stand-ins; the GPU suite runs the probe): Hopper needs nothing; elsewhere
    the order must be mma.sync kWidth 2 and the probe agree, asked once per device, and not
    from inside a CUDA graph capture (the Triton kernels run meanwhile)."""
    probes = []
    capturing = [False]
    monkeypatch.setattr(X, "_MMA_ORDER", {})
    monkeypatch.setattr(X, "_DOT_ORDER", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: {0: (9, 0), 1: (12, 0),
                                                                        2: (8, 9)}[i])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(X, "dot_order", lambda cap: {(12, 0): "mma.sync kWidth 2",
                                                     (8, 9): "mma.sync kWidth 4"}[cap])
    monkeypatch.setattr(X, "_probe_reason", lambda i: probes.append(i))
    assert X.cuda_order_reason(0) is None and probes == []
    capturing[0] = True
    assert "not run inside a graph capture" in X.cuda_order_reason(1)
    capturing[0] = False
    assert X.cuda_order_reason(1) is None and X.cuda_order_reason(1) is None
    assert probes == [1]
    assert X.cuda_order_reason(2) == ("this Triton lowers the EXL3 kernels' tl.dot to mma.sync "
                                      "kWidth 4 on sm_89 (the CUDA kernel's order is mma.sync "
                                      "kWidth 2's)")
    assert probes == [1]
    monkeypatch.setattr(X, "_MMA_ORDER", {})
    monkeypatch.setattr(X, "_probe_reason", lambda i: "bits differ")
    assert X.cuda_order_reason(1) == "bits differ"

    def refused(i):
        raise RuntimeError("exl3_mma: cuLaunchKernelEx failed with CUDA error 1")
    monkeypatch.setattr(X, "_MMA_ORDER", {})
    monkeypatch.setattr(X, "_probe_reason", refused)
    assert X.cuda_order_reason(1) == \
        "its probe failed (exl3_mma: cuLaunchKernelEx failed with CUDA error 1)"
    # a Triton that cannot compile the probe for this GPU: the Triton kernels run, no error

    def fails(cap):
        raise RuntimeError("no such target")
    monkeypatch.setattr(X, "_MMA_ORDER", {})
    monkeypatch.setattr(X, "dot_order", fails)
    assert "an unknown order (RuntimeError: no such target)" in X.cuda_order_reason(1)
    # the reason stands in front of the kernel's own checks
    x = torch.zeros(1, 256)
    tr = torch.zeros(16, 16, 20, dtype=torch.int16)
    assert X._mma_why_not(x, 5, 2, 256, torch.float32, None, tr, 8) == "not on CUDA"


def test_bench_smoke(tmp_path):
    """The kernel benchmark's harness logic on CPU (tiny shapes, interpreter)."""
    from strata.bench.kernels import main as bench_main
    out = tmp_path / "k.json"
    assert bench_main(["--smoke", "--chain", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["smoke"] is True and data["rows"]
    row = data["rows"][0]
    for key in ("shape", "K", "codebook", "rows", "path", "median_us", "gweights_per_s",
                "trellis_gb_per_s"):
        assert key in row
    assert row["chain_us"] > 0 and row["chain_copies"] == 2  # (--chain: back to back)
    # the row kernel's cases against torch.bmm (smoke: tiny shapes)
    assert [r["case"] for r in data["rowwise"]] == ["smoke_qk", "smoke_pv", "smoke_softmax_pv",
                                                    "index_scores_smoke",
                                                    "index_candidates_smoke", "mhc_smoke"]
    assert all(r["ours_us"] > 0 and r["blas_us"] > 0 for r in data["rowwise"])
    assert "row kernel case" in (tmp_path / "k.md").read_text()
    # the indexer's selection against torch's top-k (smoke: one tiny case)
    assert [r["case"] for r in data["selection"]] == ["selection_smoke"]
    assert all(r["ours_us"] > 0 and r["torch_topk_sort_us"] > 0 and r["exact_torch_us"] > 0
               for r in data["selection"])
    assert "indexer selection" in (tmp_path / "k.md").read_text()
    assert data["checks"]["reconstruct_bit_exact"] is True
    assert (tmp_path / "k.md").read_text().startswith("|")
    from strata.errors import StrataError
    with pytest.raises(StrataError, match="--shapes expert_w13: not a shape of this run"):
        bench_main(["--smoke", "--shapes", "expert_w13"])  # (smoke has its own shapes)


def test_bench_merges_an_earlier_peer_run(tmp_path):
    """--peer-results merges the JSON lines of a separate --peer-child run (made in its own
    device step) into our rows: speed-ups, Ŵ exactness against the peer, the targets."""
    from strata.bench.kernels import main as bench_main
    peer = tmp_path / "peer.jsonl"
    peer.write_text(
        '{"version": "1.6.5"}\n'
        '{"check": {"shape": "smoke", "K": 2.5, "codebook": "mul1", "bit_exact": false}}\n'
        '{"row": {"shape": "smoke", "K": 2.5, "rows": 1, "path": "fused", '
        '"peer_linear_us": 1e9, "peer_chain_us": 1e-9}}\n')
    out = tmp_path / "k.json"
    assert bench_main(["--smoke", "--chain", "--peer-results", str(peer),
                       "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["peer"].startswith("exllamav3 1.6.5") and str(peer) in data["meta"]["peer"]
    row = data["rows"][0]
    assert row["speedup_linear"] == 1e9 / row["linear_us"]
    assert row["speedup_chain"] == 1e-9 / row["chain_us"]
    assert data["checks"]["peer_reconstruct_bit_exact"] is False
    target = data["targets"][0]
    assert target["met_linear"] is True and target["met_chain"] is False
    md = (tmp_path / "k.md").read_text()
    assert "Targets met (the whole linear, ours against exllamav3's): 1/1 (1 row 1/1)." in md
    assert (f"Targets met with both chained: 0/1 (1 row 0/1). Short: smoke K 2.5, 1 row: "
            f"{row['speedup_chain']:.3f}.") in md
    # the same merge into a run measured earlier (ours while the peer's extension built)
    plain, merged = tmp_path / "plain.json", tmp_path / "merged.json"
    assert bench_main(["--smoke", "--json", str(plain)]) == 0
    assert json.loads(plain.read_text())["meta"]["peer"] == "skipped"
    assert bench_main(["--results", str(plain), "--peer-results", str(peer),
                       "--json", str(merged)]) == 0
    again = json.loads(merged.read_text())
    assert again["rows"][0]["speedup_linear"] == 1e9 / again["rows"][0]["linear_us"]
    assert again["targets"][0]["met_linear"] is True


def test_bench_small_shapes_run_by_name_only():
    """The attention's small lone linears (wq_a, wkv, a wo_a group) are benched when named,
    beside the issue's shapes; the default run keeps the issue's five."""
    import argparse
    from strata.bench import kernels as K
    p = argparse.ArgumentParser()
    K.add_arguments(p)
    named = K._cases(p.parse_args(["--shapes", "wq_a,wkv,expert_w2", "--ks", "4"]), False)
    assert [(c[0], c[1], c[2], c[3]) for c in named] == [
        ("wq_a", 5120, 1280, 4.0), ("wkv", 5120, 512, 4.0), ("expert_w2", 2304, 5120, 4.0)]
    assert {c[0] for c in K._cases(p.parse_args([]), False)} == set(K.SHAPES)


def test_bench_peer_runs_in_a_child_and_its_absence_is_reported(tmp_path):
    """exllamav3 runs in its own process (a crash there must not take the benchmark down):
    here it is not installed, so the real child exits cleanly and the merge names why."""
    import argparse
    from strata.bench import kernels as K
    p = argparse.ArgumentParser()
    K.add_arguments(p)
    args = p.parse_args(["--shapes", "expert_w2", "--ks", "2", "--rows", "1", "--device", "cpu",
                         "--peer-timeout", "120"])
    argv = K._peer_argv(args)
    assert argv[argv.index("--shapes") + 1] == "expert_w2" and "--peer-child" in argv
    rows = [{"shape": "expert_w2", "K": 2.0, "rows": 1, "path": "fused", "median_us": 1.0,
             "linear_us": 2.0}]
    checks: dict = {}
    status = K._merge_peer(args, rows, checks)
    assert status.startswith("unavailable: ModuleNotFoundError"), status
    assert "speedup_linear" not in rows[0] and not checks


def test_bench_peer_results_survive_a_killed_child(tmp_path):
    """The child appends each result as it gets it; what a killed child wrote (its last line cut
    short) is still read and merged."""
    from strata.bench import kernels as K
    lines = tmp_path / "peer.jsonl"
    lines.write_text(
        '{"version": "1.6.5"}\n'
        '{"check": {"shape": "expert_w2", "K": 2.0, "codebook": "mul1", "bit_exact": true}}\n'
        '{"row": {"shape": "expert_w2", "K": 2.0, "rows": 1, "path": "fused", '
        '"peer_linear_us": 30.0, "linear_max_rel_diff_vs_peer": 0.001}}\n'
        '{"row": {"shape": "expert_w2", "K": 2.0, "ro')
    res = K._read_peer_lines(lines)
    assert res["version"] == "1.6.5" and len(res["rows"]) == 1 and res["checks"][0]["bit_exact"]
    assert K._read_peer_lines(tmp_path / "missing.jsonl") == {"version": None, "rows": [],
                                                               "checks": []}
    rows = [{"shape": "expert_w2", "K": 2.0, "rows": 1, "path": "fused", "median_us": 12.0,
             "linear_us": 20.0},
            {"shape": "expert_w2", "K": 2.0, "rows": 6, "path": "fused", "median_us": 12.0,
             "linear_us": 20.0}]
    checks: dict = {}
    status = K._apply_peer(res, rows, checks, "ran past 250 s")
    assert status == "exllamav3 1.6.5 (in a child process), partial: the child ran past 250 s"
    assert rows[0]["speedup_linear"] == 1.5 and rows[0]["linear_max_rel_diff_vs_peer"] == 0.001
    assert "speedup_linear" not in rows[1] and checks["peer_reconstruct_bit_exact"] is True


def test_column_slices_keep_the_whole_weights_split_order(kernels_on_cpu, monkeypatch):
    """Tensor parallelism cuts a weight's output columns; the split schedule comes from the
    weight's shape, so a slice keeps the whole weight's and sums each column in the same order
    (a small TARGET_PROGRAMS makes the two shapes' own schedules differ)."""
    from strata.runtime.parallel_tp import slice_out
    monkeypatch.setattr(X, "TARGET_PROGRAMS", 8)
    assert X.split_schedule(512, 256) != X.split_schedule(512, 128)
    lin = Exl3Linear(trellis_of(32, 16, 2, seed=70), scales(512, 71, scale=0.2),
                     scales(256, 72), "mcg", 256, 512)
    half = slice_out(lin, 128, 256)
    assert half.sched_cols == 256
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(73))
    nx = Numerics()
    assert torch.equal(half(x, nx, torch.float32), lin(x, nx, torch.float32)[:, 128:])


def test_linear_groups_run_as_one_grouped_launch(kernels_on_cpu, monkeypatch):
    """wo_a's groups (strata.quant.groups): a decode-sized call runs them as one grouped
    launch whose every (row, group) output is the group's own linear on that row, bit for bit
    (the groups take the grouped launch's split schedule, alone too); the groups' tensors are
    stacked once, each linear then viewing its slice; groups that do not share a codebook run
    one by one, on a lone linear's schedule."""
    from strata.quant.groups import LinearGroups
    G, nx = 3, Numerics("vendor", torch.bfloat16)
    lins = [Exl3Linear(trellis_of(16, 8, 3, seed=70 + g), scales(256, 80 + g, scale=0.2),
                       scales(128, 90 + g), "3inst", out_features=120, in_features=256)
            for g in range(G)]
    x = torch.randn(5, G, 256, generator=torch.Generator().manual_seed(71)).bfloat16()
    monkeypatch.setattr(X, "GROUPED_TARGET_PROGRAMS", 1)  # (one split here; a lone linear's: 2)
    groups = LinearGroups(lins)
    assert all(lin.target_programs == 1 for lin in lins)
    assert X.split_schedule(256, 128, 1)[1] == 1 < X.split_schedule(256, 128)[1]
    want = torch.cat([lin(x[:, g], nx, act_quant=False) for g, lin in enumerate(lins)], dim=1)
    for T in (1, 5):
        got = groups(x[:T], nx)
        assert got.shape == (T, G * 120) and torch.equal(bits(got), bits(want[:T]))
    assert groups._stack and all(lin.trellis.data_ptr() == groups._stack.trellis[g].data_ptr()
                                 for g, lin in enumerate(lins))
    other = Exl3Linear(trellis_of(16, 8, 3, seed=72), scales(256, 73, scale=0.2),
                       scales(128, 74), "mcg", out_features=120, in_features=256)
    mixed = LinearGroups(lins[:2] + [other])
    assert mixed(x[:2], nx).shape == (2, G * 120) and mixed._stack is None
    assert other.target_programs is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_inverse_rope_in_the_input_rotation(kernels_on_cpu, monkeypatch, dtype):
    """Attention's output rotated back inside wo_a's input rotation (InverseRope): the bits
    of apply_rope(o, cos, sin, inverse=True, out_dtype) — the torch definition here — and
    then the linear, in rotate_in (both layouts), exl3_linear's fused and GEMM paths, the
    grouped launch (and its token chunks) and LinearGroups' every path; the torch reference
    applies it first; cos/sin that do not fit the rows are refused."""
    from strata.model.rope import InverseRope
    from strata.quant.groups import LinearGroups
    T, G, hd, rd2 = 5, 3, 64, 8  # (4 heads a group, each with a 16-channel rotated tail)
    nx = Numerics("vendor", dtype)
    gen = torch.Generator().manual_seed(300)
    o = torch.randn(T, G, 4 * hd, generator=gen) * 3
    ang = torch.arange(T, dtype=torch.float64)[:, None] * 0.7 ** torch.arange(rd2)[None, :]
    rope = InverseRope(torch.cos(ang).float(), torch.sin(ang).float(), hd, dtype)
    flat = rope.apply(o)  # (the torch definition on the CPU)
    assert not torch.equal(flat.float(), o.to(dtype).float())  # (the tails did turn)
    lins = [Exl3Linear(trellis_of(16, 8, 3, seed=310 + g), scales(256, 320 + g, scale=0.2),
                       scales(128, 330 + g), "3inst", out_features=120, in_features=256)
            for g in range(G)]
    for frag in (False, True):
        assert torch.equal(bits(X.rotate_in(o[:, 1], lins[1].suh, frag, rope=rope)),
                           bits(X.rotate_in(flat[:, 1], lins[1].suh, frag)))
    for path in ("fused", "gemm"):
        want = X.exl3_linear(flat[:, 2], lins[2].trellis, lins[2].suh, lins[2].svh, "3inst",
                             120, out_dtype=dtype, path=path)
        got = X.exl3_linear(o[:, 2], lins[2].trellis, lins[2].suh, lins[2].svh, "3inst",
                            120, out_dtype=dtype, path=path, rope=rope)  # (rows G·256 apart)
        assert torch.equal(bits(got), bits(want))
    groups = LinearGroups(lins)
    want = groups(flat, nx)
    assert torch.equal(bits(groups(o[:2], nx, InverseRope(rope.cos[:2], rope.sin[:2], hd,
                                                           dtype))), bits(want[:2]))
    monkeypatch.setattr(X, "MOE_MAX_PAIRS", G)  # the grouped launch in chunks of one token
    assert torch.equal(bits(groups(o, nx, rope)), bits(want))
    monkeypatch.setattr(X, "FUSED_MAX_ROWS", 4)  # a prefill-sized call: a GEMM per group
    assert groups._grouped_exl3(o) is None
    assert torch.equal(bits(groups(o, nx, rope)), bits(want))
    other = Exl3Linear(trellis_of(16, 8, 3, seed=340), scales(256, 341, scale=0.2),
                       scales(128, 342), "mcg", out_features=120, in_features=256)
    mixed = LinearGroups(lins[:2] + [other])  # (not one shape: rotated back first)
    assert torch.equal(bits(mixed(o, nx, rope)), bits(mixed(flat, nx)))
    monkeypatch.setattr(qexl3, "KERNELS", "never")  # the reference
    assert torch.equal(bits(lins[0](o[:, 0], nx, rope=rope)), bits(lins[0](flat[:, 0], nx)))
    with pytest.raises(ValueError, match="inverse RoPE"):
        X.rotate_in(o[:, 0], lins[0].suh, rope=InverseRope(rope.cos[:2], rope.sin[:2], hd,
                                                           dtype))


def test_a_linear_set_runs_as_one_grouped_launch(kernels_on_cpu, monkeypatch):
    """Linears of one shape on one input (the shared expert's w1 and w3): a decode-sized call
    runs them as one grouped launch — each a weight set of one expert — giving each linear's
    own output bit for bit, in the asked dtype, for a flat and a batched input; a set whose
    codebooks differ and a prefill-sized call run the linears one by one; linears on their own
    split target run grouped on it, and two different targets one by one."""
    from strata.model.numerics import Numerics
    from strata.quant.groups import LinearSet
    calls = []
    grouped = X.exl3_moe_linear
    monkeypatch.setattr(X, "exl3_moe_linear", lambda *a, **k: calls.append(1) or grouped(*a, **k))
    nx = Numerics("vendor", torch.bfloat16)
    w1, w3 = (Exl3Linear(trellis_of(8, 8, 3, seed=s), scales(128, s + 1, scale=0.2),
                         scales(128, s + 2), "mul1", out_features=120, in_features=100)
              for s in (170, 180))
    x = torch.randn(5, 100, generator=torch.Generator().manual_seed(171)).bfloat16()
    pair = LinearSet([w1, w3])
    for xs, dt in ((x[:1], None), (x, torch.float32), (x[:4].view(2, 2, 100), None)):
        got = pair(xs, nx, dt)
        want = [w1(xs, nx, dt), w3(xs, nx, dt)]
        assert all(g.shape == w.shape and g.dtype == w.dtype and torch.equal(bits(g), bits(w))
                   for g, w in zip(got, want))
    assert len(calls) == 3
    other = Exl3Linear(trellis_of(8, 8, 3, seed=190), scales(128, 191, scale=0.2),
                       scales(128, 192), "mcg", out_features=120, in_features=100)
    mixed = LinearSet([w1, other])
    got = mixed(x, nx)
    assert torch.equal(bits(got[1]), bits(other(x, nx))) and mixed._one_launch is False
    monkeypatch.setattr(X, "FUSED_MAX_ROWS", 4)
    assert torch.equal(bits(pair(x, nx)[0]), bits(w1(x, nx))) and len(calls) == 3
    deep = [Exl3Linear(trellis_of(16, 8, 3, seed=s), scales(256, s + 1, scale=0.2),
                       scales(128, s + 2), "mul1", out_features=120, in_features=256)
            for s in (200, 210)]
    for lin in deep:
        lin.target_programs = 1  # (one split; a lone linear's schedule has two)
    xd = torch.randn(2, 256, generator=torch.Generator().manual_seed(201)).bfloat16()
    got = LinearSet(deep)(xd, nx)
    assert len(calls) == 4 and all(torch.equal(bits(g), bits(lin(xd, nx)))
                                   for g, lin in zip(got, deep))
    deep[1].target_programs = None
    assert LinearSet(deep)(xd, nx) and len(calls) == 4


def test_a_linear_sets_weights_share_one_launchs_target():
    """A ragged set's launch aims at TARGET_PROGRAMS programs in all: each of its W EXL3
    weights of one input width, K and codebook takes TARGET_PROGRAMS // W as its own split
    target (so its lone calls keep the set's bits), a weight in two sets the smaller share;
    a weight alone in its kind, or not in any set, keeps the lone default (None)."""
    from strata.quant.groups import LinearSet

    def lin(s, codebook="mul1", k=3):
        return Exl3Linear(trellis_of(8, 8, k, seed=s), scales(128, s + 1, scale=0.2),
                          scales(128, s + 2), codebook, out_features=120, in_features=100)
    a, b, c, odd, alone = lin(400), lin(410), lin(420), lin(430, "mcg"), lin(440)
    LinearSet([a, b, odd])
    assert a.target_programs == b.target_programs == X.TARGET_PROGRAMS // 2
    assert odd.target_programs is None and alone.target_programs is None
    LinearSet([a, b, c])  # (a and b in a second, larger set: its smaller share)
    assert a.target_programs == b.target_programs == c.target_programs == X.TARGET_PROGRAMS // 3
    LinearSet([a, lin(450)])  # (a larger share never raises a weight's target)
    assert a.target_programs == X.TARGET_PROGRAMS // 3
    # the share changes a real weight's schedule: V4.1's wkv (5120 → 512) in the attention's
    # set of two runs 20 splits of two k-steps, not 40 of one
    assert X.split_schedule(5120, 512) == (1, 40)
    assert X.split_schedule(5120, 512, X.TARGET_PROGRAMS // 2) == (2, 20)


def test_linear_sets_of_three_and_of_mixed_widths(kernels_on_cpu):
    """Three linears of one shape in separate, unevenly placed allocations (the DSpark
    stages' wkv) run as one grouped launch on one stacked copy of each tensor, every output
    its linear's own; linears of mixed widths with an output dtype each (attention's
    projections of u: a ragged set on the CUDA kernel, tests/gpu) run linear by linear here,
    in their asked dtypes."""
    from strata.model.numerics import Numerics
    from strata.quant.groups import LinearSet
    nx = Numerics("vendor", torch.bfloat16)

    def lin(n, s):
        return Exl3Linear(trellis_of(8, n // 16, 3, seed=s), scales(128, s + 1, scale=0.2),
                          scales(n, s + 2), "mul1", out_features=n - 8, in_features=100)
    three = []
    for s in (300, 310, 320):
        three.append(lin(128, s))
        torch.zeros(1000 * (s - 299))  # (uneven gaps between the allocations)
    x = torch.randn(3, 100, generator=torch.Generator().manual_seed(301)).bfloat16()
    sets = [(l.trellis.unsqueeze(0), l.suh.unsqueeze(0), l.svh.unsqueeze(0)) for l in three]
    stacked = X._stack_sets(sets)
    assert stacked.str_set and stacked.ssuh_set and stacked.ssvh_set  # (evenly spaced copies)
    s3 = LinearSet(three)
    assert s3._grouped_exl3(x)
    for g, l in zip(s3(x, nx), three):
        assert torch.equal(bits(g), bits(l(x, nx)))
    mixed = [lin(128, 330), lin(256, 340), lin(128, 350)]
    dtypes = [None, torch.float32, torch.float32]
    got = LinearSet(mixed)(x, nx, dtypes)
    assert [g.dtype for g in got] == [torch.bfloat16, torch.float32, torch.float32]
    for g, l, d in zip(got, mixed, dtypes):
        assert torch.equal(bits(g), bits(l(x, nx, d)))


def test_set_plans_are_dropped_least_recently_used_first(monkeypatch):
    """The ragged-set plan cache (kernels/exl3._set_plan) keeps its most recently used plans:
    at its limit the least recently used goes, a hit moves a plan to the back, and a plan is
    remembered (here None: no CUDA set kernel on the CPU) rather than remade. (A captured
    graph holds the plans it read: strata.captures, tests/test_graphs.py.)"""
    from collections import OrderedDict
    monkeypatch.setattr(X, "SET_PLANS_KEPT", 2)
    monkeypatch.setattr(X, "_SET_PLANS", OrderedDict())
    # (a CPU build of torch cannot ask whether a stream captures: none does here)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    made = []
    real = X._make_set_plan
    monkeypatch.setattr(X, "_make_set_plan", lambda x2, w, cb: made.append(x2.shape[0])
                        or real(x2, w, cb))
    w = [X.SetWeight(trellis_of(8, 8, 2, seed=1), scales(128, 2), scales(128, 3), 128,
                     torch.float16)]
    for M in (1, 2, 1, 3, 1, 2):
        assert X._set_plan(torch.zeros(M, 128, dtype=torch.float16), w, "3inst") is None
    assert made == [1, 2, 3, 2]  # (M = 1 was used last before 3 came: 2 went)
    assert [k[0] for k in X._SET_PLANS] == [1, 2]
