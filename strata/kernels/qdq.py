"""The vendor numerics' quantise-dequantise steps (strata.quant.qdq) in one launch each on CUDA.

In torch each is 17–27 small kernels (abs, amax, the scale's division and exact log2, the
rounding, the casts); a decode step runs one per layer for the window KV and more for the
compressed KV and the indexer's q and k — several hundred launches per step. Here a program
takes ROWS blocks of a contiguous tensor and writes the same bits as the torch definition:
every division is IEEE round-to-nearest (div_rn), the exact ceil(log2) is read from the
float's bits, and the fp8/fp4 roundings are spelled out in integer and fp32 arithmetic that
is exact (no fused multiply-adds). Signed zeros follow the input's sign, as torch's.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch definitions are used
    triton = None

FP8_ACT, FP4_E4M3, FP4_UE8M0 = 0, 1, 2  # strata.quant.qdq's three functions
ROWS = 16


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


if triton is not None:
    from strata.kernels import pdl
    from strata.kernels.fp8fp4 import _e4m3_rne, _signed_like
    from strata.kernels.mhc import _round_out
    from strata.kernels.pdl import wait_then_release

    @triton.jit
    def _ceil_log2(r):
        """Exact ceil(log2(r)) of a positive normal float32 (a power of two is its own)."""
        b = r.to(tl.int32, bitcast=True)
        return ((b >> 23) & 0xFF) - 127 + ((b & 0x7FFFFF) != 0).to(tl.int32)

    @triton.jit
    def _pow2(e):
        """2^e as float32 for e in [-126, 127], exact."""
        return ((e + 127) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _rint(v):
        """Round 0 ≤ v < 2^22 to an integer, ties to even (the fp32 add rounds at ulp 1)."""
        return (v + 8388608.0) - 8388608.0

    @triton.jit
    def _e2m1_rne(a):
        """|y| ≤ 6 to the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even code
        (strata.checkpoint.encodings.e2m1_round: the grid is even within each binade)."""
        return tl.where(a < 2.0, _rint(a * 2.0) * 0.5,
                        tl.where(a < 4.0, _rint(a), _rint(a * 0.5) * 2.0))

    @triton.jit
    def _qdq_kernel(x_ptr, o_ptr, n_blocks, FLOOR: tl.constexpr, FMT: tl.constexpr,
                    BLOCK: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
        wait_then_release(PDL)
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        live = (rows < n_blocks)[:, None]
        offs = rows[:, None] * BLOCK + cols[None, :]
        x = tl.load(x_ptr + offs, mask=live, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        amax = tl.maximum(amax, FLOOR)
        if FMT == 0:    # fp8_act_qdq: 2^ceil(log2(amax / 448)), e4m3
            e = _ceil_log2(tl.math.div_rn(amax, 448.0))
            y = tl.minimum(tl.abs(x) * _pow2(-e)[:, None], 448.0)
            q = _e4m3_rne(y) * _pow2(e)[:, None]
        elif FMT == 1:  # fp4_qdq_e4m3_scale: e4m3(min(amax / 6, 448)), e2m1
            s = _e4m3_rne(tl.minimum(tl.math.div_rn(amax, 6.0), 448.0))
            y = tl.minimum(tl.math.div_rn(tl.abs(x), s[:, None]), 6.0)
            q = _e2m1_rne(y) * s[:, None]
        else:           # fp4_qdq_ue8m0: 2^ceil(log2(amax / 6)), e2m1
            e = _ceil_log2(tl.math.div_rn(amax, 6.0))
            y = tl.minimum(tl.abs(x) * _pow2(-e)[:, None], 6.0)
            q = _e2m1_rne(y) * _pow2(e)[:, None]
        q = _signed_like(q, x)  # -0.0 stays negative, as in torch
        tl.store(o_ptr + offs, _round_out(q, o_ptr.dtype.element_ty), mask=live)


def qdq(x: torch.Tensor, fmt: int, block: int, floor: float) -> torch.Tensor:
    """One of strata.quant.qdq's functions (fmt FP8_ACT / FP4_E4M3 / FP4_UE8M0, with its
    block and amax floor) on x, in x's dtype; the caller has checked the shape (last dim a
    multiple of block)."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"qdq kernel: unsupported dtype {x.dtype}")
    xc = x.contiguous()
    out = torch.empty_like(xc)
    n_blocks = xc.numel() // block
    if n_blocks:
        _qdq_kernel[(triton.cdiv(n_blocks, ROWS),)](xc, out, n_blocks, FLOOR=floor, FMT=fmt,
                                                    BLOCK=block, ROWS=ROWS,
                                                    enable_fp_fusion=False,
                                                    **pdl.args(x.device))
    return out.view(x.shape)
