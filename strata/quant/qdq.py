"""Quantise-dequantise simulations of the vendor numerics (spec §2.9).

Why: the vendor path rounds GEMM activations to fp8 and the window KV, compressed KV and
indexer q/k to fp8/fp4 before use. These roundings move attention top-k picks, so an fp32
oracle that wants to agree with the vendor (or with HF's "QAT semantics") must apply them.
Each function computes in float32 with torch ops, works on any leading dims, blocks along the
last dim (which must be a multiple of the block), and returns the input's dtype.

Scales follow the spec's formulas: ratios like amax/448 are float32 divisions, and
ceil(log2(.)) is taken exactly via frexp (the vendor's bit-twiddled log2-ceil is exact too).
"""

from __future__ import annotations

import torch

from strata.checkpoint.encodings import FP4_MAX, FP8_MAX, ceil_log2, e2m1_round

__all__ = ["e2m1_round", "fp8_act_qdq", "fp4_qdq_e4m3_scale", "fp4_qdq_ue8m0"]

FP8_AMAX_FLOOR = 1e-4
FP4_E4M3_AMAX_FLOOR = 6.0 * 2.0**-9  # makes the smallest scale 2^-9, the least e4m3 subnormal
FP4_UE8M0_AMAX_FLOOR = 6.0 * 2.0**-126  # makes the smallest scale 2^-126, the least normal float32


def _check(x: torch.Tensor, block: int, what: str) -> None:
    if x.dim() == 0 or x.shape[-1] % block:
        raise ValueError(f"{what}: last dim of shape {tuple(x.shape)} must be a multiple of block {block}")
    if not x.is_floating_point():
        raise ValueError(f"{what}: expected a floating tensor, got {x.dtype}")


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """float32 view [..., D/block, block] of x (D = last dim, a multiple of block)."""
    return x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _kernel(x: torch.Tensor) -> bool:
    """On CUDA one launch (strata.kernels.qdq, the same bits) instead of 17–27 torch kernels."""
    from strata.kernels import qdq as kqdq
    return kqdq.available(x) and x.dtype in (torch.float32, torch.bfloat16, torch.float16)


def _pow2_of_int(e: torch.Tensor) -> torch.Tensor:
    """2^e as float32 for int32 e, exact (ldexp of 1)."""
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e)


def fp8_act_qdq(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Per-`block` e4m3 qdq with a power-of-two scale: GEMM activations and the window KV.

    amax = max(|x|, 1e-4); scale = 2^ceil(log2(amax/448)); q = e4m3_rne(clamp(x/scale, ±448)).
    """
    _check(x, block, "fp8_act_qdq")
    if _kernel(x):
        from strata.kernels import qdq as kqdq
        return kqdq.qdq(x, kqdq.FP8_ACT, block, FP8_AMAX_FLOOR)
    xb = _blocks(x, block)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR)
    scale = _pow2_of_int(ceil_log2(amax / FP8_MAX))
    q = (xb / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return (q * scale).reshape(x.shape).to(x.dtype)


def fp4_qdq_e4m3_scale(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """Per-`block` e2m1 qdq with an e4m3 scale: the compressed KV.

    scale = e4m3_rne(max(amax, 6*2^-9) / 6) (saturating at 448); q = e2m1_rne(clamp(x/scale, ±6)).
    Note: when the scale lands in e4m3's subnormal range this is not always idempotent (the
    coarse scale can leave the block max rounding below 6); for normal scales it is.
    """
    _check(x, block, "fp4_qdq_e4m3_scale")
    if _kernel(x):
        from strata.kernels import qdq as kqdq
        return kqdq.qdq(x, kqdq.FP4_E4M3, block, FP4_E4M3_AMAX_FLOOR)
    xb = _blocks(x, block)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp_min(FP4_E4M3_AMAX_FLOOR)
    scale = (amax / FP4_MAX).clamp(max=FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    q = e2m1_round((xb / scale).clamp(-FP4_MAX, FP4_MAX))
    return (q * scale).reshape(x.shape).to(x.dtype)


def fp4_qdq_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Per-`block` e2m1 qdq with a power-of-two scale: the indexer's q and k.

    scale = 2^ceil(log2(max(amax, 6*2^-126) / 6)); q = e2m1_rne(clamp(x/scale, ±6)).
    """
    _check(x, block, "fp4_qdq_ue8m0")
    if _kernel(x):
        from strata.kernels import qdq as kqdq
        return kqdq.qdq(x, kqdq.FP4_UE8M0, block, FP4_UE8M0_AMAX_FLOOR)
    xb = _blocks(x, block)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp_min(FP4_UE8M0_AMAX_FLOOR)
    scale = _pow2_of_int(ceil_log2(amax / FP4_MAX))
    q = e2m1_round((xb / scale).clamp(-FP4_MAX, FP4_MAX))
    return (q * scale).reshape(x.shape).to(x.dtype)
