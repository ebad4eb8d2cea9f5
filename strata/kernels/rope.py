"""Interleaved RoPE in one launch on CUDA (the torch definition is strata.model.rope.apply_rope,
~13 launches there). Same operations in the same order — the tail in fp32, a·c − b·s and
a·s + b·c each product rounded then the sum (no fused multiply-add), one rounding to x's
dtype, the head copied — so the result has the torch path's bits. In place, only the tail is
read and written.

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


# Rows (of d channels) a program: 8 for a prefill chunk's (a [8, 128] tile of the head's copy,
# 8 tails at once), 1 up to SMALL rows — a decode step's 64 query heads in 64 programs (H100,
# session 45: 8 rows a program took ~0.3 µs more a decode call than one)
ROWS, SMALL = 8, 256


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


if triton is not None:
    from strata.kernels import pdl
    from strata.kernels.mhc import _round_out
    from strata.kernels.pdl import wait_then_release

    @triton.jit
    def rotate_pair_channel(x, partner, c, s, first):
        """One channel of a pair (a, b) rotated to (a·c − b·s, a·s + b·c): x is a where
        `first`, else b, and `partner` the other; s carries the rotation's sign. Each
        product rounded, then the sum (kernels launched without fp fusion) — the rotation
        of every RoPE kernel here (_rope_kernel; exl3's rotate_in of an attention output)."""
        return tl.where(first, x * c - partner * s, partner * s + x * c)

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, R, M, d, sx_t, sx_m, so_t, so_m,
                     sc_t, sign, RD2: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr,
                     BP: tl.constexpr, COPY_HEAD: tl.constexpr, PDL: tl.constexpr):
        # BR of the R = T·M rows a program; COPY_HEAD: the head channels copied to out (not
        # in place), cast as torch casts
        wait_then_release(PDL)
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        live = r < R
        t = (r // M).to(tl.int64)
        m = (r % M).to(tl.int64)
        xrow = (x_ptr + t * sx_t + m * sx_m)[:, None]
        orow = (out_ptr + t * so_t + m * so_m)[:, None]
        nh = d - 2 * RD2
        dt = out_ptr.dtype.element_ty
        if COPY_HEAD:
            for h0 in range(0, nh, BH):
                k = (h0 + tl.arange(0, BH))[None, :]
                km = live[:, None] & (k < nh)
                tl.store(orow + k, _round_out(tl.load(xrow + k, mask=km).to(tl.float32), dt),
                         mask=km)
        p = tl.arange(0, BP)[None, :]
        pm = live[:, None] & (p < RD2)
        a = tl.load(xrow + nh + 2 * p, mask=pm, other=0.0).to(tl.float32)
        b = tl.load(xrow + nh + 2 * p + 1, mask=pm, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + t[:, None] * sc_t + p, mask=pm, other=0.0)
        s = tl.load(sin_ptr + t[:, None] * sc_t + p, mask=pm, other=0.0) * sign
        tl.store(orow + nh + 2 * p, _round_out(rotate_pair_channel(a, b, c, s, True), dt),
                 mask=pm)
        tl.store(orow + nh + 2 * p + 1,
                 _round_out(rotate_pair_channel(b, a, c, s, False), dt), mask=pm)


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
               inverse: bool = False, out_dtype: torch.dtype | None = None,
               in_place: bool = False) -> torch.Tensor:
    """As strata.model.rope.apply_rope: x [T, ..., d], cos/sin [T, rd/2] fp32."""
    T, d = x.shape[0], x.shape[-1]
    rd2 = cos.shape[-1]
    x3 = x.reshape(T, -1, d)
    # in place where x3 is a view of x (a copy never starts at x's address); else a rotated
    # copy written back
    here = in_place and x3.stride(-1) == 1 and x3.data_ptr() == x.data_ptr()
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    M = x3.shape[1]
    out = x3 if here else torch.empty((T, M, d), dtype=out_dtype or x.dtype, device=x.device)
    if T * M:
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        br = ROWS if T * M > SMALL else 1
        _rope_kernel[(triton.cdiv(T * M, br),)](
            x3, cos, sin, out, T * M, M, d, x3.stride(0), x3.stride(1), out.stride(0),
            out.stride(1), cos.stride(0), -1.0 if inverse else 1.0, RD2=rd2, BR=br, BH=128,
            BP=triton.next_power_of_2(rd2), COPY_HEAD=not here, num_warps=4,
            enable_fp_fusion=False, **pdl.args(out.device))
    if in_place:
        return x if here else x.copy_(out.view(x.shape))
    return out.view(x.shape)
