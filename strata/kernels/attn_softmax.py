"""The attention's softmax with a per-head sink in one launch on CUDA.

strata.model.attention.sparse_attention scales a query's scores, masks its invisible rows,
appends the head's sink logit, takes the softmax and drops the sink's column: five torch
kernels per layer and forward. Here one program takes one (query, head) row and does all of
it in registers, with the same formulation (the sink enters the running max and the
denominator only); Triton's exp is not torch's, so the result agrees to fp32 rounding. Each
row is computed alone: batch-invariant.
"""
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
    @triton.jit
    def _sink_softmax_kernel(s_ptr, m_ptr, sink_ptr, o_ptr, n, scale, s_t, s_h, m_t, o_t, o_h,
                             NB: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        j = tl.arange(0, NB)
        live = j < n
        x = tl.load(s_ptr + t * s_t + h * s_h + j, mask=live, other=0.0) * scale
        ok = tl.load(m_ptr + t * m_t + j, mask=live, other=0) != 0
        x = tl.where(ok & live, x, float("-inf"))
        sink = tl.load(sink_ptr + h)
        top = tl.maximum(tl.max(x, axis=0), sink)
        e = tl.exp(x - top)
        p = e / (tl.sum(e, axis=0) + tl.exp(sink - top))
        tl.store(o_ptr + t * o_t + h * o_h + j, p, mask=live)


def sink_softmax(s: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """s [T, H, n] fp32 scores, mask [T, n] bool (visible rows), sink [H] → the softmax over
    [s·scale (masked to −inf), sink] without the sink's column: [T, H, n] fp32."""
    T, H, n = s.shape
    if s.stride(-1) != 1:
        s = s.contiguous()
    m = mask.to(torch.uint8)
    if m.stride(-1) != 1:
        m = m.contiguous()
    out = torch.empty((T, H, n), dtype=torch.float32, device=s.device)
    if T and H and n:
        _sink_softmax_kernel[(T, H)](s, m, sink.float().contiguous(), out, n, float(scale),
                                     s.stride(0), s.stride(1), m.stride(0), out.stride(0),
                                     out.stride(1), NB=triton.next_power_of_2(n),
                                     enable_fp_fusion=False)
    return out
