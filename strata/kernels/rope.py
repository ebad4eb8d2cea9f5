"""Interleaved RoPE in one launch on CUDA (the torch definition is strata.model.rope.apply_rope,
~13 launches there). Same operations in the same order — the tail in fp32, a·c − b·s and
a·s + b·c each product rounded then the sum (no fused multiply-add), one rounding to x's
dtype, the head copied — so the result has the torch path's bits.

`cos_sin`: a forward's cos/sin table (strata.model.rope.rope_cos_sin, six launches there: the
positions' cast, the angles, cos, sin and two casts) in one: the angle as the fp64 product,
cos and sin in fp64 (CUDA's libdevice, as torch's), each rounded once to fp32."""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch definition is used
    triton = None


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


if triton is not None:
    from strata.kernels import pdl
    from strata.kernels.mhc import _round_out
    from strata.kernels.pdl import wait_then_release

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, M, d, sx_t, sx_m, so_t, so_m,
                     sc_t, sign, RD2: tl.constexpr, BH: tl.constexpr, BP: tl.constexpr,
                     PDL: tl.constexpr):
        wait_then_release(PDL)
        row = tl.program_id(0)
        t = (row // M).to(tl.int64)
        m = (row % M).to(tl.int64)
        xrow = x_ptr + t * sx_t + m * sx_m
        orow = out_ptr + t * so_t + m * so_m
        nh = d - 2 * RD2
        dt = out_ptr.dtype.element_ty
        for h0 in range(0, nh, BH):  # the head channels, unchanged (cast as torch casts)
            k = h0 + tl.arange(0, BH)
            tl.store(orow + k, _round_out(tl.load(xrow + k, mask=k < nh).to(tl.float32), dt),
                     mask=k < nh)
        p = tl.arange(0, BP)
        pm = p < RD2
        a = tl.load(xrow + nh + 2 * p, mask=pm, other=0.0).to(tl.float32)
        b = tl.load(xrow + nh + 2 * p + 1, mask=pm, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + t * sc_t + p, mask=pm, other=0.0)
        s = tl.load(sin_ptr + t * sc_t + p, mask=pm, other=0.0) * sign
        tl.store(orow + nh + 2 * p, _round_out(a * c - b * s, dt), mask=pm)
        tl.store(orow + nh + 2 * p + 1, _round_out(a * s + b * c, dt), mask=pm)


if triton is not None:
    @triton.jit
    def _cos_sin_kernel(pos_ptr, freq_ptr, cos_ptr, sin_ptr, RD2: tl.constexpr,
                        BP: tl.constexpr, PDL: tl.constexpr):
        wait_then_release(PDL)
        t = tl.program_id(0).to(tl.int64)
        p = tl.arange(0, BP)
        pm = p < RD2
        ang = tl.load(pos_ptr + t).to(tl.float64) * tl.load(freq_ptr + p, mask=pm, other=0.0)
        tl.store(cos_ptr + t * RD2 + p, tl.cos(ang).to(tl.float32), mask=pm)
        tl.store(sin_ptr + t * RD2 + p, tl.sin(ang).to(tl.float32), mask=pm)


def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As strata.model.rope.rope_cos_sin: inv_freq [rd/2] fp64, positions [T] int → cos, sin
    [T, rd/2] fp32."""
    T, rd2 = positions.numel(), inv_freq.numel()
    cos = torch.empty((T, rd2), dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    if T and rd2:
        _cos_sin_kernel[(T,)](positions.contiguous(), inv_freq.double().contiguous(), cos, sin,
                              RD2=rd2, BP=triton.next_power_of_2(rd2), num_warps=1,
                              **pdl.args(positions.device))
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               inverse: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """As strata.model.rope.apply_rope: x [T, ..., d], cos/sin [T, rd/2] fp32."""
    T, d = x.shape[0], x.shape[-1]
    rd2 = cos.shape[-1]
    x3 = x.reshape(T, -1, d)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    M = x3.shape[1]
    out = torch.empty((T, M, d), dtype=out_dtype or x.dtype, device=x.device)
    if T * M:
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        _rope_kernel[(T * M,)](x3, cos, sin, out, M, d, x3.stride(0), x3.stride(1),
                               out.stride(0), out.stride(1), cos.stride(0),
                               -1.0 if inverse else 1.0, RD2=rd2, BH=256,
                               BP=triton.next_power_of_2(rd2), num_warps=2,
                               enable_fp_fusion=False, **pdl.args(out.device))
    return out.view(x.shape)
