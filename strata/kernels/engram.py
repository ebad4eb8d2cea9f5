"""The Engram module's per-copy gate and its update of the stream in one launch on CUDA (the
torch definition is strata.model.engram.Engram.forward after the projection, ~30 launches
there: three row sums through the row kernel — a decode step's took ~19 µs each — and the
elementwise steps around them).

Program (t, i) takes copy i of token t: over the row in BLOCK-wide column chunks, in
ascending order, Σ (h·w)·key, Σ h² and Σ key² (each product rounded as torch rounds it, no
fused multiply-add), one final tree sum each; then the torch code's scalar steps — the dot
times rsqrt(mean h² + eps) times rsqrt(mean key² + eps), divided by √D, the gate
sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot)) — and h + gate·value rounded once to h's dtype.
Every row is computed alone (batch-invariant); the sums' order differs from the row
kernel's, so the gate may differ from the torch path's in the last bits (tested under the
interpreter against the definition)."""
from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch definition is used
    triton = None

BLOCK = 1024


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


if triton is not None:
    from strata.kernels import pdl
    from strata.kernels.mhc import _round_out
    from strata.kernels.pdl import wait_then_release

    @triton.jit
    def _gate_kernel(h_ptr, w_ptr, key_ptr, value_ptr, out_ptr, sh_row, sh_copy, sk_row,
                     sv_row, so_row, so_copy, eps, sqrt_d, D: tl.constexpr, BK: tl.constexpr,
                     PDL: tl.constexpr):
        wait_then_release(PDL)
        t = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1)
        hrow = h_ptr + t * sh_row + i * sh_copy
        krow = key_ptr + t * sk_row + i * D
        wrow = w_ptr + i * D
        dot = tl.zeros([BK], dtype=tl.float32)
        hh = tl.zeros([BK], dtype=tl.float32)
        kk = tl.zeros([BK], dtype=tl.float32)
        for k0 in tl.static_range(0, D, BK):  # (unrolled: every chunk's loads issue together)
            k = k0 + tl.arange(0, BK)
            m = k < D
            hv = tl.load(hrow + k, mask=m, other=0.0).to(tl.float32)
            kv = tl.load(krow + k, mask=m, other=0.0)
            dot = dot + (hv * tl.load(wrow + k, mask=m, other=0.0)) * kv
            hh = hh + hv * hv
            kk = kk + kv * kv
        # (div_rn: IEEE division as torch's; Triton's `/` on fp32 is the approximate one)
        d = tl.sum(dot, axis=0)
        d = d * tl.rsqrt(tl.math.div_rn(tl.sum(hh, axis=0), D * 1.0) + eps) \
            * tl.rsqrt(tl.math.div_rn(tl.sum(kk, axis=0), D * 1.0) + eps)
        d = tl.math.div_rn(d, sqrt_d)
        s = tl.sqrt_rn(tl.maximum(tl.abs(d), 1e-6))
        negative = d.to(tl.int32, bitcast=True) < 0  # (the sign bit: −0 too, as copysign)
        gate = tl.sigmoid(tl.where(negative, -s, s))
        for k0 in tl.static_range(0, D, BK):
            k = k0 + tl.arange(0, BK)
            m = k < D
            hv = tl.load(hrow + k, mask=m, other=0.0).to(tl.float32)
            y = hv + gate * tl.load(value_ptr + t * sv_row + k, mask=m, other=0.0)
            tl.store(out_ptr + t * so_row + i * so_copy + k,
                     _round_out(y, out_ptr.dtype.element_ty), mask=m)


def gate_update(h: torch.Tensor, qk_weight: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, eps: float) -> torch.Tensor:
    """h + gate·value for h [T, H, D] (any float dtype), qk_weight [H, D] fp32, key [T, H, D]
    fp32 (rows may be strided: a view of the projection), value [T, D] fp32 → [T, H, D] in
    h's dtype, each copy's gate from its own row (see the module docstring)."""
    T, H, D = h.shape
    if (tuple(qk_weight.shape) != (H, D) or tuple(key.shape) != (T, H, D)
            or tuple(value.shape) != (T, D)):
        raise ValueError(f"engram gate: h {list(h.shape)}, qk_weight {list(qk_weight.shape)}, "
                         f"key {list(key.shape)} and value {list(value.shape)} do not match")
    if h.stride(2) != 1:
        h = h.contiguous()
    if key.stride(2) != 1 or key.stride(1) != D:
        key = key.contiguous()
    if value.stride(1) != 1:
        value = value.contiguous()
    w = qk_weight.float().contiguous()
    key, value = key.float(), value.float()
    out = torch.empty((T, H, D), dtype=h.dtype, device=h.device)
    if T:
        _gate_kernel[(T, H)](h, w, key, value, out, h.stride(0), h.stride(1), key.stride(0),
                             value.stride(0), out.stride(0), out.stride(1), float(eps),
                             math.sqrt(D), D=D, BK=min(BLOCK, triton.next_power_of_2(D)),
                             num_warps=4, enable_fp_fusion=False, **pdl.args(h.device))
    return out
