"""The MoE's small steps in one launch each on CUDA: routing, SwiGLU, the slot sum with the
shared expert's output joined in the activation dtype.

In torch a decode step's MoE layer spends ~40 launches on them: the router's scores
(division, softplus, sqrt, bias), the radix top-k's key building and selection, the weights'
gather and normalisation; the SwiGLU's clamps, silu, products and casts (routed and shared
experts); the sum over the six slots. Each kernel here computes a row alone (batch-invariant)
with the torch definition's operations in the same order; the slot sum gives its bits exactly,
routing picks the same experts as strata.model.numerics.ranked_topk on the same scores (one
int64 key per expert: the score's order, then the lowest index), and the transcendental steps
(exp, log) are Triton's, so scores and SwiGLU outputs agree with torch's to fp32 rounding.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch definitions are used
    triton = None

SWIGLU_BLOCK = 1024
SUM_BLOCK = 1024


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


if triton is not None:
    from strata.kernels import pdl
    from strata.kernels.mhc import _round_out
    from strata.kernels.pdl import wait_then_release

    @triton.jit
    def _log1p(y):
        """log(1 + y) for y ≥ 0 to about an ulp (the rounding of 1 + y compensated)."""
        u = 1.0 + y
        exact = u == 1.0
        return tl.where(exact, y, tl.log(u) * (y / tl.where(exact, 1.0, u - 1.0)))

    @triton.jit
    def _route_kernel(logit_ptr, bias_ptr, idx_ptr, w_ptr, E, temp, scale,
                      K: tl.constexpr, KB: tl.constexpr, EB: tl.constexpr, PDL: tl.constexpr):
        wait_then_release(PDL)
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, EB)
        live = e < E
        z = tl.math.div_rn(tl.load(logit_ptr + t * E + e, mask=live, other=0.0), temp)
        # sqrt(softplus(z)); softplus as torch's: z itself above the threshold 20
        s = tl.sqrt_rn(tl.where(z > 20.0, z, _log1p(tl.exp(tl.minimum(z, 20.0)))))
        biased = s + tl.load(bias_ptr + e, mask=live, other=0.0)
        bits = biased.to(tl.int32, bitcast=True)
        bits = tl.where(bits == -2147483648, 0, bits)  # −0 ties with +0, as floats compare
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
        key = ordered * 4294967296 + ((E - 1) - e).to(tl.int64)
        key = tl.where(live, key, -9223372036854775807 - 1)
        slot = tl.arange(0, KB)
        picks = tl.zeros([KB], dtype=tl.int64)
        ws = tl.zeros([KB], dtype=tl.float32)
        total = 0.0
        for j in tl.static_range(K):  # the k largest keys, largest first
            top = tl.max(key, axis=0)
            pick = ((E - 1) - (top & 0xFFFFFFFF)).to(tl.int32)
            wj = tl.sum(tl.where(e == pick, s, 0.0), axis=0)
            total = total + wj
            picks = tl.where(slot == j, pick.to(tl.int64), picks)
            ws = tl.where(slot == j, wj, ws)
            key = tl.where(e == pick, -9223372036854775807 - 1, key)
        ws = tl.math.div_rn(ws, total + 1e-20) * scale
        tl.store(idx_ptr + t * K + slot, picks, mask=slot < K)
        tl.store(w_ptr + t * K + slot, ws, mask=slot < K)

    @triton.jit
    def swiglu_values(g, v, w, limit, DT: tl.constexpr):
        """silu(min(g, limit))·clamp(v, ±limit)·w (w: a row's routing weight, or 1.0 for
        none) from g, v in fp32, rounded to DT — `swiglu`'s values, and the down projection's
        input where its rotation computes it (strata.kernels.exl3, SwiGLU)."""
        g = tl.minimum(g, limit)
        v = tl.minimum(tl.maximum(v, -limit), limit)
        return _round_out(g / (1.0 + tl.exp(-g)) * v * w, DT)

    @triton.jit
    def _swiglu_kernel(g_ptr, v_ptr, w_ptr, o_ptr, N, sg, sv, so, limit,
                       HAS_W: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr):
        wait_then_release(PDL)
        r = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        m = cols < N
        g = tl.load(g_ptr + r * sg + cols, mask=m, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + r * sv + cols, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + r) if HAS_W else 1.0
        tl.store(o_ptr + r * so + cols, swiglu_values(g, v, w, limit, o_ptr.dtype.element_ty),
                 mask=m)

    @triton.jit
    def _slot_sum_kernel(y_ptr, b_ptr, o_ptr, D, sy_t, sy_s, K: tl.constexpr,
                         HAS_B: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr):
        wait_then_release(PDL)
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BD + tl.arange(0, BD)
        m = cols < D
        acc = tl.load(y_ptr + t * sy_t + cols, mask=m, other=0.0).to(tl.float32)
        for s in tl.static_range(1, K):  # slot order, as the torch loop
            acc = acc + tl.load(y_ptr + t * sy_t + s * sy_s + cols, mask=m, other=0.0).to(
                tl.float32)
        if HAS_B:  # then the fp32 sum with the shared expert's output
            acc = acc + tl.load(b_ptr + t * D + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(o_ptr + t * D + cols, _round_out(acc, o_ptr.dtype.element_ty), mask=m)


def route(logits: torch.Tensor, bias: torch.Tensor, temp: float, k: int,
          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE.route from the gate's fp32 logits [T, E]: (expert ids [T, k] int64, weights
    [T, k] fp32)."""
    T, E = logits.shape
    idx = torch.empty((T, k), dtype=torch.int64, device=logits.device)
    w = torch.empty((T, k), dtype=torch.float32, device=logits.device)
    if T:
        _route_kernel[(T,)](logits.float().contiguous(), bias.float().contiguous(), idx, w, E,
                            float(temp), float(scale), K=k, KB=triton.next_power_of_2(k),
                            EB=triton.next_power_of_2(E), enable_fp_fusion=False,
                            **pdl.args(logits.device))
    return idx, w


def swiglu(g: torch.Tensor, v: torch.Tensor, limit: float, dtype: torch.dtype,
           weight: torch.Tensor | None = None) -> torch.Tensor:
    """(silu(min(g, limit))·clamp(v, ±limit) [· weight per row]) in `dtype`; g, v [..., N]
    of one shape, weight one value per row (the routing weight of a (token, slot) pair)."""
    N = g.shape[-1]
    g2, v2 = g.reshape(-1, N), v.reshape(-1, N)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    if v2.stride(-1) != 1:
        v2 = v2.contiguous()
    R = g2.shape[0]
    out = torch.empty((R, N), dtype=dtype, device=g.device)
    if R and N:
        w = weight.reshape(-1).float().contiguous() if weight is not None else out
        _swiglu_kernel[(R, triton.cdiv(N, SWIGLU_BLOCK))](
            g2, v2, w, out, N, g2.stride(0), v2.stride(0), out.stride(0), float(limit),
            HAS_W=weight is not None, BN=SWIGLU_BLOCK, enable_fp_fusion=False,
            **pdl.args(g.device))
    return out.view(g.shape)


def slot_sum(y: torch.Tensor, plus: torch.Tensor | None = None,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Σ_s y[:, s] in slot order in fp32: y [T, k, D] (any float dtype) → [T, D]; with `plus`
    [T, D] (the shared expert's output) that sum + plus in fp32; rounded to dtype as torch
    casts — strata.model.moe.slot_sum's bits."""
    T, k, D = y.shape
    if y.stride(-1) != 1:
        y = y.contiguous()
    if plus is not None:
        if tuple(plus.shape) != (T, D):
            raise ValueError(f"slot_sum: plus {list(plus.shape)} for slots {list(y.shape)}")
        plus = plus.contiguous()
    out = torch.empty((T, D), dtype=dtype, device=y.device)
    if T and D:
        _slot_sum_kernel[(T, triton.cdiv(D, SUM_BLOCK))](
            y, y if plus is None else plus, out, D, y.stride(0), y.stride(1), K=k,
            HAS_B=plus is not None, BD=SUM_BLOCK, **pdl.args(y.device))
    return out

