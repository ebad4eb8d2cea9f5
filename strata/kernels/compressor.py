"""The ratio-r KV compressor's pooling in one launch on CUDA (the torch definition is
strata.model.compressor.Compressor.forward, ~15 launches there: the tail ring's gather, the
concatenation, each group's row indices, the softmax over the group's gates and the weighted
sum).

Entry j (index entries[j]) pools the r token rows of positions entries[j]·r + t, t < r: a row
before the forward (position < first) from the compressor's tail ring (slot = position %
size), a later one from this forward's projections k, g [T, hd] — clamped to the forward's
last row as the torch code clamps (an unfinished group's missing rows: the entry is written
again when its group completes). Per channel the torch ops' operations: the gates' softmax
over the group (max, exp — libdevice's expf, as torch's CUDA softmax — the sum, each exp
divided by it), then Σ_t w_t·k_t from zero in row order, no fused multiply-add. With r = 2
(V4.1's only pooled ratio) every sum has two terms, so any order torch's kernels pick gives
these bits — except where a weight is subnormal (gates more than ~87 apart: Triton links
libdevice with subnormals flushed, so such a weight is 0 here)."""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs: the torch definition is used
    triton = None


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


if triton is not None:
    from strata.kernels import pdl
    from strata.kernels.pdl import wait_then_release

    @triton.jit
    def _row(ring_ptr, k_ptr, g_ptr, first, entry, t, T, size, s_slot, s_kg, s_k, s_g, c, cm,
             R: tl.constexpr):
        """Row t of an entry's group: its (k, gate) channels c, from the ring or this forward."""
        j = tl.minimum(entry * R + t - first + (R - 1), T + R - 2)  # in first−(R−1) .. +T−1
        if j < R - 1:  # a position before the forward: the tail ring
            slot = (first - (R - 1) + j) % size
            kv = tl.load(ring_ptr + slot * s_slot + c, mask=cm, other=0.0).to(tl.float32)
            gv = tl.load(ring_ptr + slot * s_slot + s_kg + c, mask=cm, other=0.0).to(tl.float32)
        else:
            row = j - (R - 1)
            kv = tl.load(k_ptr + row * s_k + c, mask=cm, other=0.0).to(tl.float32)
            gv = tl.load(g_ptr + row * s_g + c, mask=cm, other=0.0).to(tl.float32)
        return kv, gv

    @triton.jit
    def _exp(x, LIBDEVICE: tl.constexpr):
        """expf as torch's CUDA kernels compute it (libdevice; tl.exp is the fast
        approximation). The interpreter has no libdevice: numpy's exp there."""
        if LIBDEVICE:
            return libdevice.exp(x)
        else:
            return tl.exp(x)

    @triton.jit
    def _pool_kernel(ring_ptr, k_ptr, g_ptr, pos_ptr, entry_ptr, out_ptr, T, size, hd,
                     s_slot, s_kg, s_k, s_g, R: tl.constexpr, BC: tl.constexpr,
                     LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
        wait_then_release(PDL)
        e = tl.program_id(0)
        first = tl.load(pos_ptr)
        entry = tl.load(entry_ptr + e)
        c = tl.arange(0, BC)
        cm = c < hd
        mx = tl.full([BC], float("-inf"), tl.float32)
        for t in tl.static_range(R):
            _, gv = _row(ring_ptr, k_ptr, g_ptr, first, entry, t, T, size, s_slot, s_kg, s_k,
                         s_g, c, cm, R)
            mx = tl.maximum(mx, gv)
        total = tl.zeros([BC], dtype=tl.float32)
        for t in tl.static_range(R):
            _, gv = _row(ring_ptr, k_ptr, g_ptr, first, entry, t, T, size, s_slot, s_kg, s_k,
                         s_g, c, cm, R)
            total = total + _exp(gv - mx, LIBDEVICE)
        acc = tl.zeros([BC], dtype=tl.float32)
        for t in tl.static_range(R):
            kv, gv = _row(ring_ptr, k_ptr, g_ptr, first, entry, t, T, size, s_slot, s_kg, s_k,
                          s_g, c, cm, R)
            acc = acc + tl.math.div_rn(_exp(gv - mx, LIBDEVICE), total) * kv
        tl.store(out_ptr + e.to(tl.int64) * hd + c, acc, mask=cm)


def pool(ring_rows: torch.Tensor, k: torch.Tensor, g: torch.Tensor, positions: torch.Tensor,
         entries: torch.Tensor, ratio: int) -> torch.Tensor:
    """Pooled latents [m, hd] fp32 (before their norm) of entries [m] for a forward at
    `positions` [T] (consecutive, device), its projections k, g [T, hd] fp32 and the tail
    ring's rows [size, 2, hd] (k, gate) of the positions before it."""
    T, hd = k.shape
    if tuple(g.shape) != (T, hd) or ring_rows.shape[1:] != (2, hd):
        raise ValueError(f"compressor pool: k {list(k.shape)}, g {list(g.shape)} and ring rows "
                         f"{list(ring_rows.shape)} do not match")
    if k.stride(1) != 1:
        k = k.contiguous()
    if g.stride(1) != 1:
        g = g.contiguous()
    m = entries.numel()
    out = torch.empty((m, hd), dtype=torch.float32, device=k.device)
    if m and T:
        _pool_kernel[(m,)](ring_rows, k, g, positions, entries, out, T, ring_rows.shape[0], hd,
                           ring_rows.stride(0), ring_rows.stride(1), k.stride(0), g.stride(0),
                           R=ratio, BC=triton.next_power_of_2(hd),
                           LIBDEVICE=not pdl.interpreting(), num_warps=4,
                           enable_fp_fusion=False, **pdl.args(k.device))
    return out
