"""y = x·Wᵀ straight from the checkpoint's stored bytes: fp8 e4m3 + ue8m0 scale per 32×32 tile
(dense weights) and packed fp4 e2m1 + ue8m0 scale per 32 along K (routed experts).

Each program decodes its [BLOCK_N, BLOCK_K] weight tile in registers (bytes → exact float →
× 2^(s−127) → the operand dtype) and multiplies it with a [BLOCK_M, BLOCK_K] activation tile
with `tl.dot` into an fp32 accumulator. No dense copy of W is ever written to memory.

Batch invariance (the engine asserts bit-identical logits across decode, verify and prefill):
- ONE configuration per weight (`config_for`): BLOCK_M = 16 for every M (decode rows are
  padded with masked zero rows); BLOCK_N, BLOCK_K, the K split, warps and stages depend only on
  the weight's format and shape, never on M; `M` is not specialised on, so one compiled kernel
  serves every M. BLOCK_M = 16 with 4 warps keeps Triton on mma.sync (m16n8k16) on Hopper (no
  wgmma, whose accumulation could differ).
- Each (row, column) is reduced by one program per K range, walking its range upwards in
  BLOCK_K steps, each step one `tl.dot` accumulating into the same fp32 registers. The MMA
  computes every element from its row and column only, so a row's result does not depend on
  the other rows of its tile, on its position in the tile, on M or on the grid.
- Split K (plain GEMM, narrow weights only): a fixed number S of K ranges per weight, each
  from zero; the S fp32 partials are added in range order (`_split_sum_kernel`).
- fp4 tiles run as two dots per step (even K columns with the low nibbles, odd with the high
  ones), always in that order.
- The grouped MoE kernels (strata.kernels.moe) run the same K walk on rows gathered by
  (token, slot) pair, so a pair's result does not depend on its tile mates either.

Exactness vs the torch reference (dequantize to the compute dtype, then row_matmul):
- A dequantized weight q·2^(s−127) has ≤ 4 significant bits, so it is exact in bf16 and fp32
  whenever it is an fp32 normal (|w| ≥ 2^-126) and its scale byte is ≤ 240 (|w| < 2^116):
  every real checkpoint. Scale byte 255 (NaN) gives NaN, as the reference.
- bf16 operands: the products are exact in fp32 and accumulated in fp32, exactly the
  reference's math; only the summation order differs. fp32 operands (reference numerics with
  fp32 activations) use `input_precision="ieee"` (FMA, no TF32 rounding).
- Tolerance: |y − y_ref| ≤ 2·K·2^-24·Σ_k|x_k·w_k| (two fp32 summation orders of the same exact
  terms), plus one ulp of the output dtype when the output is bf16 (an fp32 sum on either side
  of a bf16 rounding boundary). tests/test_kernels_fp8fp4.py checks that bound.
- Launched with enable_fp_fusion=False: no multiply-add contraction, so the in-kernel fp8
  activation qdq and SwiGLU round exactly as written (whatever Triton's default).
- A NaN-coded e4m3 byte (0x7F/0xFF; no quantiser writes one) decodes as ±480 under the
  interpreter (bit decoding), as NaN on the GPU (hardware conversion).

CPU runs use the torch reference unless kernels are forced (`forced()` or
STRATA_FORCE_QKERNELS=1), which tests use under TRITON_INTERPRET=1. The interpreter multiplies
bf16 tiles as the integers it stores them as, so there the operands go to fp32 first (exact:
same products, same fp32 accumulation).

`fp8fp4_cases()` gives CUDA benchmark cases for strata.bench.kernels.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference path is used
    triton = None

FP8, FP4 = 0, 1
FORMATS = {"fp8": FP8, "fp4": FP4}
BLOCK_M = 16  # rows per program, whatever M (decode rows are masked padding of one tile)

_force = os.environ.get("STRATA_FORCE_QKERNELS", "") == "1"


def kernels_enabled(x: torch.Tensor) -> bool:
    """Whether fp8/fp4 products of x run through these kernels: always on CUDA, on CPU only
    when forced (tests, under TRITON_INTERPRET=1)."""
    return triton is not None and (x.is_cuda or _force)


@contextlib.contextmanager
def forced(on: bool = True) -> Iterator[None]:
    """Force (or forbid forcing) the kernels on CPU tensors within the block."""
    global _force
    old, _force = _force, on
    try:
        yield
    finally:
        _force = old


@dataclass(frozen=True)
class Config:
    block_n: int
    block_k: int
    split_k: int = 1  # K ranges reduced separately, then summed in split order (plain GEMM)
    num_warps: int = 4
    num_stages: int = 3


SPLIT_TARGET = 512  # programs a decode GEMV should have to fill the GPU's SMs


def config_for(fmt: int, n: int, k: int) -> Config:
    """The one configuration of a weight: from its format and shape only — never from M.

    Narrow weights (wkv 5120→512, wq_a 5120→1280) have too few column tiles to stream W at
    full bandwidth in decode, so K is split into a fixed number of ranges (a power of two,
    each ≥ 4 K blocks); that is a property of the weight, so the summation order stays the
    same for every M."""
    block_n, block_k = (32 if n <= 8192 else 64), 128
    tiles = -(-n // block_n)
    k_blocks = -(-k // block_k)
    split = 1
    while split * 2 * tiles <= SPLIT_TARGET and split * 2 * 4 <= k_blocks:
        split *= 2
    return Config(block_n=block_n, block_k=block_k, split_k=split)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    if t.element_size() != 1:
        raise ValueError(f"expected 1-byte storage, got {t.dtype}")
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


if triton is not None:
    @triton.jit
    def _pow2_bits(e):
        """2^e as float32 from int32 e in [-126, 127] (exact; bit construction)."""
        return ((e + 127) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _scale(sb, OFFSET: tl.constexpr):
        """2^(sb − 127 + OFFSET) per ue8m0 scale byte sb (int32); byte 255 → NaN."""
        s = _pow2_bits(tl.minimum(tl.maximum(sb - 127 + OFFSET, -126), 127))
        return tl.where(sb == 255, float("nan"), s)

    @triton.jit
    def _e2m1_x2p14(n):
        """4-bit e2m1 codes (int32) → value·2^-14 as float32, exactly: the code's 3 magnitude
        bits placed as fp16 exponent+mantissa make value·2^-14 (code 1 = 0.5 becomes the fp16
        subnormal 2^-15, which the fp16→fp32 conversion keeps)."""
        h = (((n & 7) << 9) | ((n & 8) << 12)).to(tl.uint16)
        return h.to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _cast(v, DT: tl.constexpr, ON_GPU: tl.constexpr):
        """float32 v → DT with round-to-nearest-even. (The interpreter truncates fp32 → bf16,
        so there the rounding is done on the bits first; then the cast is exact.)"""
        if DT == tl.bfloat16:
            if not ON_GPU:
                b = v.to(tl.int32, bitcast=True)
                v = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        return v.to(DT)

    @triton.jit
    def _dot(a, b_nk, acc, IP: tl.constexpr, ON_GPU: tl.constexpr):
        """acc + a·b_nkᵀ with fp32 accumulation."""
        if ON_GPU:
            return tl.dot(a, tl.trans(b_nk), acc, input_precision=IP)
        # interpreter: its dot multiplies bf16 storage as integers; fp32 is exact for bf16.
        return tl.dot(a.to(tl.float32), tl.trans(b_nk.to(tl.float32)), acc, input_precision="ieee")

    @triton.jit
    def _accumulate(acc, x_ptr, xrow, rmask, sxm, sxk, w_ptr, s_ptr, offs_n, N, K, k_lo, k_hi,
                    swn, swk, ssn, ssk,
                    FMT: tl.constexpr, OP: tl.constexpr, IP: tl.constexpr, ON_GPU: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """acc[BLOCK_M, BLOCK_N] += x[xrow, k_lo:k_hi]·W[offs_n, k_lo:k_hi]ᵀ, walked upwards in
        BLOCK_K steps (k_lo a multiple of BLOCK_K; columns ≥ K masked)."""
        SG: tl.constexpr = BLOCK_K // 32
        HK: tl.constexpr = BLOCK_K // 2
        nmask = offs_n < N
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_g = k0 // 32 + tl.arange(0, SG)
            if FMT == 0:
                srow = offs_n // 32
            else:
                srow = offs_n
            sb = tl.load(s_ptr + srow[:, None] * ssn + offs_g[None, :] * ssk,
                         mask=nmask[:, None] & (offs_g[None, :] * 32 < K), other=127).to(tl.int32)
            if FMT == 0:
                offs_k = k0 + tl.arange(0, BLOCK_K)
                kmask = offs_k < K
                wb = tl.load(w_ptr + offs_n[:, None] * swn + offs_k[None, :] * swk,
                             mask=nmask[:, None] & kmask[None, :], other=0)
                if ON_GPU:  # hardware e4m3 conversion: exact (NaN bytes → NaN)
                    q = wb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                    sc = _scale(sb, 0)
                else:  # e4m3 bits as fp16 exponent+mantissa: value·2^-8, exact
                    wi = wb.to(tl.int32)
                    q = (((wi & 0x7F) << 7) | ((wi & 0x80) << 8)).to(tl.uint16).to(
                        tl.float16, bitcast=True).to(tl.float32)
                    sc = _scale(sb, 8)
                w = tl.reshape(tl.reshape(q, (BLOCK_N, SG, 32)) * sc[:, :, None],
                               (BLOCK_N, BLOCK_K)).to(OP)
                xt = tl.load(x_ptr + xrow[:, None] * sxm + offs_k[None, :] * sxk,
                             mask=rmask[:, None] & kmask[None, :], other=0.0).to(OP)
                acc = _dot(xt, w, acc, IP, ON_GPU)
            else:
                offs_j = k0 // 2 + tl.arange(0, HK)  # packed byte j holds columns 2j (low), 2j+1
                jmask = offs_j * 2 < K
                wb = tl.load(w_ptr + offs_n[:, None] * swn + offs_j[None, :] * swk,
                             mask=nmask[:, None] & jmask[None, :], other=0).to(tl.int32) & 0xFF
                sc = _scale(sb, 14)[:, :, None]
                lo = tl.reshape(tl.reshape(_e2m1_x2p14(wb & 0xF), (BLOCK_N, SG, 16)) * sc,
                                (BLOCK_N, HK)).to(OP)
                hi = tl.reshape(tl.reshape(_e2m1_x2p14(wb >> 4), (BLOCK_N, SG, 16)) * sc,
                                (BLOCK_N, HK)).to(OP)
                xm = rmask[:, None] & jmask[None, :]
                xbase = x_ptr + xrow[:, None] * sxm + (2 * offs_j)[None, :] * sxk
                xe = tl.load(xbase, mask=xm, other=0.0).to(OP)
                xo = tl.load(xbase + sxk, mask=xm, other=0.0).to(OP)
                acc = _dot(xe, lo, acc, IP, ON_GPU)
                acc = _dot(xo, hi, acc, IP, ON_GPU)
        return acc

    @triton.jit
    def _e4m3_rne(y):
        """Round float32 y (|y| ≤ 448) to the nearest e4m3fn value, ties to even."""
        ay = tl.abs(y)
        b = ay.to(tl.int32, bitcast=True)
        # normal e4m3 (|y| ≥ 2^-6): keep 3 mantissa bits, round half to even on the bits
        nrm = ((b + 0x7FFFF + ((b >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        # subnormal e4m3 (|y| < 2^-6): multiples of 2^-9; the fp32 add rounds at ulp 2^-9
        sub = (ay + 16384.0) - 16384.0
        r = tl.where(ay < 0.015625, sub, nrm)
        return _signed_like(r, y)

    @triton.jit
    def _signed_like(mag, x):
        """mag (≥ 0, float32) with x's sign bit. Not where(x < 0, -mag, mag): Triton negates
        as 0 - mag, which turns a zero magnitude into +0 where the torch cast keeps -0."""
        sign = (x.to(tl.int32, bitcast=True) >> 31) << 31
        return (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _fp8_act_qdq_tile(a, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """quant.qdq.fp8_act_qdq on each row's 32-column blocks of a [BLOCK_M, BLOCK_N] tile:
        scale = 2^ceil(log2(max(amax, 1e-4)/448)), taken from amax's bits (exact, no division:
        for amax = m·2^E, m ∈ [1, 2), the exponent is E − 8 + (m > 1.75))."""
        a3 = tl.reshape(a, (BLOCK_M, BLOCK_N // 32, 32))
        amax = tl.maximum(tl.max(tl.abs(a3), axis=2), 1e-4)
        bits = amax.to(tl.int32, bitcast=True)
        e = (bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        y = tl.minimum(tl.maximum(a3 * _pow2_bits(-e)[:, :, None], -448.0), 448.0)
        q = _e4m3_rne(y) * _pow2_bits(e)[:, :, None]
        return tl.reshape(q, (BLOCK_M, BLOCK_N))

    @triton.jit
    def _fp8_qdq_kernel(x_ptr, o_ptr, R, BLOCK_N: tl.constexpr):
        """Test hook: the in-kernel fp8 activation qdq on an [R, BLOCK_N] fp32 tensor."""
        rows = tl.program_id(0) * 16 + tl.arange(0, 16)
        cols = tl.arange(0, BLOCK_N)
        m = (rows < R)[:, None]
        a = tl.load(x_ptr + rows[:, None] * BLOCK_N + cols[None, :], mask=m, other=0.0)
        tl.store(o_ptr + rows[:, None] * BLOCK_N + cols[None, :], _fp8_act_qdq_tile(a, 16, BLOCK_N),
                 mask=m)

    @triton.jit(do_not_specialize=["M"])
    def _linear_kernel(x_ptr, w_ptr, s_ptr, o_ptr, M, N, K, k_per_split,
                       sxm, sxk, swn, swk, ssn, ssk, som, son, sos,
                       FMT: tl.constexpr, OP: tl.constexpr, IP: tl.constexpr,
                       ON_GPU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
        """out[split, rows, cols] (an fp32 partial per K range when split, else the output)."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(2)
        rmask = rows < M
        k_lo = split * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _accumulate(acc, x_ptr, rows, rmask, sxm, sxk, w_ptr, s_ptr, offs_n, N, K,
                          k_lo, k_hi, swn, swk, ssn, ssk, FMT, OP, IP, ON_GPU, BLOCK_N, BLOCK_K)
        tl.store(o_ptr + split * sos + rows[:, None] * som + offs_n[None, :] * son,
                 _cast(acc, o_ptr.dtype.element_ty, ON_GPU),
                 mask=rmask[:, None] & (offs_n < N)[None, :])

    @triton.jit
    def _split_sum_kernel(p_ptr, o_ptr, total, SPLIT: tl.constexpr, ON_GPU: tl.constexpr,
                          BLOCK: tl.constexpr):
        """o = Σ_z p[z] over the split partials, z = 0, 1, … in order, per element."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < total
        acc = tl.load(p_ptr + offs, mask=m, other=0.0)
        for z in tl.static_range(1, SPLIT):
            acc += tl.load(p_ptr + z * total + offs, mask=m, other=0.0)
        tl.store(o_ptr + offs, _cast(acc, o_ptr.dtype.element_ty, ON_GPU), mask=m)

    @triton.jit
    def _moe_kernel(x_ptr, w_ptr, s_ptr, w3_ptr, s3_ptr, o_ptr, rw_ptr, tile_e_ptr, tile_r_ptr,
                    N, K, X_DIV, limit,
                    sxm, sxk, swe, swn, swk, sse, ssn, ssk, som, son,
                    FMT: tl.constexpr, OP: tl.constexpr, IP: tl.constexpr,
                    ON_GPU: tl.constexpr, GATED: tl.constexpr, QUANT: tl.constexpr,
                    ROUND_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
        """One tile of ≤ BLOCK_M (token, slot) pairs that share an expert (moe_grouping).

        GATED: h[pair] = fp8?(swiglu(x_t·W1ᵀ, x_t·W3ᵀ)·weight[pair]) over N = I columns, x row
        t = pair // X_DIV. Otherwise: out[pair] = h[pair]·W2ᵀ. w3/s3 share w/s's strides."""
        tile = tl.program_id(0)
        e = tl.load(tile_e_ptr + tile)
        if e < 0:
            return
        pairs = tl.load(tile_r_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
        rmask = pairs >= 0
        pairs = tl.where(rmask, pairs, 0)
        xrow = pairs // X_DIV
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        e64 = e.to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _accumulate(acc, x_ptr, xrow, rmask, sxm, sxk, w_ptr + e64 * swe, s_ptr + e64 * sse,
                          offs_n, N, K, 0, K, swn, swk, ssn, ssk, FMT, OP, IP, ON_GPU, BLOCK_N,
                          BLOCK_K)
        if GATED:
            acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc3 = _accumulate(acc3, x_ptr, xrow, rmask, sxm, sxk, w3_ptr + e64 * swe,
                               s3_ptr + e64 * sse, offs_n, N, K, 0, K, swn, swk, ssn, ssk,
                               FMT, OP, IP, ON_GPU, BLOCK_N, BLOCK_K)
            g = acc
            v = acc3
            if ROUND_BF16:  # the reference's w1/w3 products come out in the activation dtype
                g = _cast(g, tl.bfloat16, ON_GPU).to(tl.float32)
                v = _cast(v, tl.bfloat16, ON_GPU).to(tl.float32)
            g = tl.minimum(g, limit)
            v = tl.minimum(tl.maximum(v, -limit), limit)
            a = g / (1.0 + tl.exp(-g)) * v
            a = a * tl.load(rw_ptr + pairs, mask=rmask, other=0.0)[:, None]
            if QUANT:
                a = _fp8_act_qdq_tile(a, BLOCK_M, BLOCK_N)
            acc = a
        tl.store(o_ptr + pairs[:, None] * som + offs_n[None, :] * son,
                 _cast(acc, o_ptr.dtype.element_ty, ON_GPU),
                 mask=rmask[:, None] & (offs_n < N)[None, :])


_TL_OP = {}
if triton is not None:
    _TL_OP = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _ip(op: torch.dtype) -> str:
    return "ieee" if op == torch.float32 else "tf32"  # (tf32 is a no-op for bf16 operands)


def quant_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fmt: str,
                 out_dtype: torch.dtype, config: Config | None = None) -> torch.Tensor:
    """x [M, K] · Wᵀ → [M, N] in out_dtype, W given as stored: fp8 [N, K] + scale
    [ceil(N/32), ceil(K/32)], or packed fp4 [N, K/2] + scale [N, K/32].

    The operands are x's dtype (bf16 or fp32) and the weight decoded exactly to it; callers
    pass bf16 whenever x's values are exact in bf16 (then the products are exact either way).
    `config` overrides the weight's configuration (tests); keep it fixed for a weight.
    """
    if triton is None:
        raise RuntimeError("quant_matmul needs triton")
    f = FORMATS[fmt]
    M, K = x.shape
    N = weight.shape[0]
    kw = weight.shape[1] * (2 if f == FP4 else 1)
    if kw != K:
        raise ValueError(f"quant_matmul: x {list(x.shape)} and {fmt} weight "
                         f"{list(weight.shape)} do not match")
    if x.dtype not in _TL_OP:
        raise ValueError(f"quant_matmul: activation dtype {x.dtype}: expected bf16 or fp32")
    out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    w, s = _as_bytes(weight), _as_bytes(scale)
    cfg = config or config_for(f, N, K)
    split = cfg.split_k
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.block_k), split) * cfg.block_k
    dst = out if split == 1 else torch.empty((split, M, N), dtype=torch.float32,
                                             device=x.device)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, cfg.block_n), split)
    _linear_kernel[grid](x, w, s, dst, M, N, K, k_per_split, x.stride(0), x.stride(1),
                         w.stride(0), w.stride(1), s.stride(0), s.stride(1),
                         dst.stride(-2), dst.stride(-1), dst.stride(0) if split > 1 else 0,
                         FMT=f, OP=_TL_OP[x.dtype], IP=_ip(x.dtype), ON_GPU=x.is_cuda,
                         BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                         num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                         enable_fp_fusion=False)
    if split > 1:
        total = M * N
        _split_sum_kernel[(triton.cdiv(total, 1024),)](dst, out, total, SPLIT=split,
                                                       ON_GPU=x.is_cuda, BLOCK=1024,
                                                       enable_fp_fusion=False)
    return out


def fp8_act_qdq_kernel(x: torch.Tensor) -> torch.Tensor:
    """The MoE epilogue's fp8 activation qdq on x [R, C] fp32 (C a power of two ≥ 32), for
    tests: must equal quant.qdq.fp8_act_qdq bit for bit."""
    out = torch.empty_like(x)
    R, C = x.shape
    _fp8_qdq_kernel[(triton.cdiv(R, 16),)](x.contiguous(), out, R, BLOCK_N=C,
                                           enable_fp_fusion=False)
    return out


# --------------------------------------------------------------------------------- benchmarks


def fp8fp4_cases() -> list[tuple[str, Callable[[], Callable[[], torch.Tensor]]]]:
    """CUDA timing cases for strata.bench.kernels: (name, builder); a builder allocates random
    stored weights + activations on the GPU and returns the callable to time (bf16
    activations and outputs, reference numerics). GEMM cases at rows 1, 2, 6, 512; grouped
    MoE cases (384 fp4 experts, 6 per token, gate+up+SwiGLU+down+slot sum) at 1, 2, 6, 512
    tokens."""
    cases = []
    for name, fmt, n, k in GEMM_SHAPES:
        for m in (1, 2, 6, 512):
            cases.append((f"{fmt} {name} {k}->{n} M={m}", _gemm_builder(fmt, n, k, m)))
    for t in (1, 2, 6, 512):
        cases.append((f"fp4 moe E=384 k=6 5120->2304->5120 T={t}", _moe_builder(t)))
    return cases


GEMM_SHAPES = [("expert_w13", "fp4", 2304, 5120), ("expert_w2", "fp4", 5120, 2304),
               ("wq_b", "fp8", 32768, 1280), ("wo_b", "fp8", 5120, 8192),
               ("head", "fp8", 129280, 5120)]


def case_bytes(name: str) -> int:
    """Weight bytes a case streams at least once (for GB/s), from its name."""
    for n_, fmt, n, k in GEMM_SHAPES:
        if f" {n_} " in name:
            return n * k // (2 if fmt == "fp4" else 1) + n * k // (32 if fmt == "fp4" else 1024)
    return 0


def random_stored(fmt: str, n: int, k: int, device, seed: int = 0,
                  experts: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random stored bytes of a weight (finite codes; scale bytes put |w| around 2^-6..2^-1),
    optionally stacked over `experts`; generated on `device`."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    lead = () if experts is None else (experts,)

    def bytes_(shape, lo, hi):
        return torch.randint(lo, hi, shape, generator=g, dtype=torch.uint8, device=device)
    if fmt == "fp8":
        w = bytes_((*lead, n, k), 0, 256)
        w[(w & 0x7F) == 0x7F] = 0  # no NaN codes
        s = bytes_((*lead, -(-n // 32), -(-k // 32)), 116, 124)
        return w.view(torch.float8_e4m3fn), s
    return bytes_((*lead, n, k // 2), 0, 256).view(torch.int8), bytes_((*lead, n, k // 32),
                                                                       118, 126)


def _gemm_builder(fmt: str, n: int, k: int, m: int) -> Callable[[], Callable[[], torch.Tensor]]:
    def build() -> Callable[[], torch.Tensor]:
        w, s = random_stored(fmt, n, k, "cuda")
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        return lambda: quant_matmul(x, w, s, fmt, torch.bfloat16)
    return build


def _moe_builder(T: int, E: int = 384, k: int = 6, D: int = 5120,
                 I: int = 2304) -> Callable[[], Callable[[], torch.Tensor]]:
    def build() -> Callable[[], torch.Tensor]:
        from strata.kernels.moe import StoredExperts, moe_grouped_slots
        from strata.model.moe import slot_sum
        from strata.model.numerics import Numerics
        st = [StoredExperts("fp4", *random_stored("fp4", n_, k_, "cuda", seed=i, experts=E))
              for i, (n_, k_) in enumerate(((I, D), (I, D), (D, I)))]
        g = torch.Generator(device="cuda").manual_seed(T)
        idx = torch.stack([torch.randperm(E, generator=g, device="cuda")[:k] for _ in range(T)])
        w = torch.rand(T, k, generator=g, device="cuda")
        x = torch.randn(T, D, generator=g, device="cuda", dtype=torch.bfloat16)
        nx = Numerics(act_dtype=torch.bfloat16)
        return lambda: slot_sum(moe_grouped_slots(x, idx, w, st[0], st[1], st[2], 10.0, nx))
    return build


def main() -> None:
    """python -m strata.kernels.fp8fp4 [substring]: time the cases (CUDA; triton do_bench
    median) and print µs and weight GB/s."""
    import sys
    import triton.testing
    want = sys.argv[1] if len(sys.argv) > 1 else ""
    print(f"{'case':52s} {'µs':>10s} {'GB/s':>8s}")
    for name, build in fp8fp4_cases():
        if want not in name:
            continue
        fn = build()
        fn()
        torch.cuda.synchronize()
        us = 1e3 * float(triton.testing.do_bench(fn, warmup=25, rep=100))
        nb = case_bytes(name)
        print(f"{name:52s} {us:10.1f} {nb / us / 1e3 if nb else float('nan'):8.0f}")
        del fn
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ Linear entry


def linear_forward(weight: torch.Tensor, scale: torch.Tensor, fmt: str, x: torch.Tensor, nx,
                   out_dtype: torch.dtype | None, act_quant: bool,
                   config: Config | None = None) -> torch.Tensor:
    """Fp8Block32Linear / Fp4Group32Linear.forward through the kernel, with the reference's
    numerics: vendor fp8 activation point, compute dtype (fp32 when an fp32 output is asked
    for, else the activation dtype), output cast to out_dtype or the activation dtype.
    `config`: the configuration to keep (a row slice of a weight keeps the whole weight's, so
    its rows sum in the same order — tensor parallelism's exactness)."""
    from strata.quant.qdq import fp8_act_qdq
    quant = nx.quantize and act_quant
    if quant:
        x = fp8_act_qdq(x)
    cd = torch.float32 if out_dtype == torch.float32 else nx.act_dtype
    xc = x.to(cd)
    # bf16 operands whenever the values are exact in bf16: same exact products as fp32 ones.
    exact_bf16 = cd == torch.bfloat16 or quant or x.dtype == torch.bfloat16
    xo = xc.to(torch.bfloat16) if exact_bf16 else xc
    lead, K = xo.shape[:-1], xo.shape[-1]
    y = quant_matmul(xo.reshape(-1, K), weight, scale, fmt, cd, config=config)
    return y.view(*lead, y.shape[-1]).to(out_dtype or nx.act_dtype)


if __name__ == "__main__":
    main()
