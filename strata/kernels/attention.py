"""The attention's small steps in one launch each on CUDA (strata.model.attention).

Rows: a piece of queries' key rows — each query's W window positions, from this forward's kv
or the ring (with their visibility), then its selected compressed entries (−1: empty) —
gathered into one [rows, W + k, hd] tensor of their stored dtype with its mask: in torch a
dozen index, compare, select, cast and concatenate kernels per layer and piece, and several
copies of the rows. Every row is a copy (widened exactly where dtypes differ), so the bits are
the torch path's. Where every source holds its rows in one dtype, `row_table` stores only
where each row lies (a rowwise.RowTable, 8 bytes a row instead of hd · 2) and the products
read the rows there — the same values, so the same bits.

Softmax: sparse_attention scales a query's scores, masks its invisible rows, appends the
head's sink logit, takes the softmax and drops the sink's column: five torch kernels per
layer and piece. Here one program takes one (query, head) row and does all of it in
registers, with the same formulation (the sink enters the running max and the denominator
only); Triton's exp is not torch's, so the result agrees to fp32 rounding. Each row is
computed alone: batch-invariant.
"""
from __future__ import annotations

import torch

from strata.kernels.rowwise import RowTable

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch definition is used
    triton = None


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


if triton is not None:
    from strata.kernels import pdl
    from strata.kernels.pdl import wait_then_release
    from strata.kernels.rowwise import split_bf16

    # (ring_at / cache_at: distances between allocations, not specialised on — their
    # divisibility would compile a variant per value class mid-prefill)
    @triton.jit(do_not_specialize=["ring_at", "cache_at"])
    def _gather_rows_kernel(kv_ptr, ring_ptr, tags_ptr, kpos_ptr, exist_ptr, inch_ptr, row_ptr,
                            slot_ptr, cache_ptr, sel_ptr, out_ptr, mask_ptr, W, K, HD,
                            s_kv, s_ring, s_cache, s_win, s_sel, ring_at, cache_at,
                            HAS_SEL: tl.constexpr, OFFSETS: tl.constexpr, BR: tl.constexpr,
                            BH: tl.constexpr, PDL: tl.constexpr):
        # OFFSETS: each row's start stored (int64 elements from kv's first; the ring's and the
        # cache's first at ring_at and cache_at) instead of its copy — a rowwise.RowTable
        wait_then_release(PDL)
        t = tl.program_id(0).to(tl.int64)
        r = tl.program_id(1) * BR + tl.arange(0, BR)  # rows of the joined set: window, then k
        n = W + K
        live = r < n
        win = live & (r < W)
        wr = tl.where(win, r, 0)
        kp = tl.load(kpos_ptr + t * s_win + wr, mask=win, other=0)
        inch = tl.load(inch_ptr + t * s_win + wr, mask=win, other=0) != 0
        exist = tl.load(exist_ptr + t * s_win + wr, mask=win, other=0) != 0
        src_row = tl.load(row_ptr + t * s_win + wr, mask=win, other=0)
        slot = tl.load(slot_ptr + t * s_win + wr, mask=win, other=0)
        tag = tl.load(tags_ptr + slot, mask=win, other=-1)
        valid = exist & (inch | (tag == kp))
        from_kv = win & inch
        from_ring = win & ~inch
        comp = live & (r >= W)
        entry = tl.zeros([BR], dtype=tl.int64)
        if HAS_SEL:
            e = tl.load(sel_ptr + t * s_sel + tl.where(comp, r - W, 0), mask=comp,
                        other=-1).to(tl.int64)
            valid = tl.where(comp, e >= 0, valid)
            entry = tl.maximum(e, 0)
        tl.store(mask_ptr + t * n + r, valid.to(tl.int8), mask=live)
        if OFFSETS:
            at = tl.where(from_kv, src_row.to(tl.int64) * s_kv,
                          ring_at + slot.to(tl.int64) * s_ring)
            if HAS_SEL:
                at = tl.where(comp, cache_at + entry * s_cache, at)
            tl.store(out_ptr + t * n + r, at, mask=live)
        else:
            out = out_ptr + (t * n + r)[:, None] * HD
            for c0 in range(0, HD, BH):
                cols = c0 + tl.arange(0, BH)
                cm = (cols < HD)[None, :]
                v = tl.load(kv_ptr + src_row[:, None] * s_kv + cols[None, :],
                            mask=from_kv[:, None] & cm, other=0.0).to(tl.float32)
                v = tl.where(from_ring[:, None],
                             tl.load(ring_ptr + slot[:, None] * s_ring + cols[None, :],
                                     mask=from_ring[:, None] & cm, other=0.0).to(tl.float32), v)
                if HAS_SEL:
                    v = tl.where(comp[:, None],
                                 tl.load(cache_ptr + entry[:, None] * s_cache + cols[None, :],
                                         mask=comp[:, None] & cm, other=0.0).to(tl.float32), v)
                tl.store(out + cols[None, :], v.to(out_ptr.dtype.element_ty),
                         mask=live[:, None] & cm)

    @triton.jit
    def _sink_softmax_kernel(s_ptr, m_ptr, sink_ptr, o_ptr, n, scale, s_t, s_h, m_t, o_t, o_h,
                             o_plane, NB: tl.constexpr, PLANES: tl.constexpr,
                             PDL: tl.constexpr):
        wait_then_release(PDL)
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
        o = o_ptr + t * o_t + h * o_h + j
        if PLANES:  # p's exact split, for rowwise.planes_bmm
            hi, mid, lo = split_bf16(p)
            tl.store(o, hi, mask=live)
            tl.store(o + o_plane, mid, mask=live)
            tl.store(o + 2 * o_plane, lo, mask=live)
        else:
            tl.store(o, p, mask=live)


GATHER_ROWS = 16
GATHER_COLS = 128


def gather_rows(kv: torch.Tensor, ring_rows: torch.Tensor, ring_tags: torch.Tensor,
                window: tuple[torch.Tensor, ...], cache: torch.Tensor | None,
                sel: torch.Tensor | None,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The queries' joined key rows [T, W (+ k), hd] in `dtype` and mask [T, W (+ k)] bool:
    `window` = (kpos, existing, in_chunk, row, slot) [T, W] of these queries (ForwardContext.
    window), kv [T_forward, hd] this forward's rows, the ring's rows and tags before this
    forward's write, cache [entries, hd] and sel [T, k] the compressed rows (or None)."""
    T, W = window[0].shape
    n = W + (0 if sel is None else sel.shape[1])
    out = torch.empty((T, n, kv.shape[-1]), dtype=dtype, device=kv.device)
    return out, _gather(kv, ring_rows, ring_tags, window, cache, sel, out, offsets=False)


def row_table_applies(kv: torch.Tensor, ring_rows: torch.Tensor,
                      cache: torch.Tensor | None) -> bool:
    """Whether row_table can stand for gather_rows: every source in kv's dtype, each
    starting on 16 elements and its rows 16 elements apart (a RowTable's starts)."""
    sources = [t for t in (kv, ring_rows, cache) if t is not None]
    return all(t.dtype == kv.dtype and t.stride(-1) == 1 and t.stride(0) % 16 == 0
               and t.data_ptr() % (16 * t.element_size()) == 0 for t in sources)


def row_table(kv: torch.Tensor, ring_rows: torch.Tensor, ring_tags: torch.Tensor,
              window: tuple[torch.Tensor, ...], cache: torch.Tensor | None,
              sel: torch.Tensor | None) -> tuple[RowTable, torch.Tensor]:
    """gather_rows' rows where they lie — a RowTable of [T, W (+ k)] row starts counted from
    kv's first element (no copy: the products read the same values, so give the same bits) —
    and its mask. Every source in kv's dtype and aligned (row_table_applies)."""
    if not row_table_applies(kv, ring_rows, cache):
        raise ValueError("row_table: the ring's and the cache's rows must be in kv's dtype, "
                         "each source 16-element aligned")
    T, W = window[0].shape
    n = W + (0 if sel is None else sel.shape[1])
    offsets = torch.empty((T, n), dtype=torch.int64, device=kv.device)
    mask = _gather(kv, ring_rows, ring_tags, window, cache, sel, offsets, offsets=True)
    return RowTable(kv, offsets, kv.shape[-1]), mask


def _gather(kv, ring_rows, ring_tags, window, cache, sel, out: torch.Tensor,
            offsets: bool) -> torch.Tensor:
    """One _gather_rows_kernel launch into `out` (rows, or with `offsets` their starts);
    returns the mask."""
    kpos, existing, in_chunk, row, slot = (w.contiguous() for w in window)
    existing, in_chunk = existing.view(torch.int8), in_chunk.view(torch.int8)
    T, W = kpos.shape
    K = 0 if sel is None else sel.shape[1]
    hd = kv.shape[-1]
    mask = torch.empty((T, W + K), dtype=torch.bool, device=kv.device)
    if any(t is not None and t.stride(-1) != 1 for t in (kv, ring_rows, cache)):
        raise ValueError("gather_rows: rows must be contiguous in their last dim")
    if T and W + K:
        has = sel is not None
        sel_c = sel.contiguous() if has else kpos
        cache_c = cache if has else kv
        el = kv.element_size()  # (row_table: every source in kv's dtype)
        ring_at, cache_at = ((ring_rows.data_ptr() - kv.data_ptr()) // el,
                             (cache_c.data_ptr() - kv.data_ptr()) // el) if offsets else (0, 0)
        _gather_rows_kernel[(T, triton.cdiv(W + K, GATHER_ROWS))](
            kv, ring_rows, ring_tags, kpos, existing, in_chunk, row, slot, cache_c, sel_c, out,
            mask.view(torch.int8), W, K, hd, kv.stride(0), ring_rows.stride(0),
            cache_c.stride(0), kpos.stride(0), sel_c.stride(0), ring_at, cache_at,
            HAS_SEL=has, OFFSETS=offsets, BR=GATHER_ROWS, BH=GATHER_COLS,
            **pdl.args(kv.device))
    return mask


def sink_softmax(s: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor,
                 scale: float, planes: bool = False,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """s [T, H, n] fp32 scores, mask [T, n] bool (visible rows), sink [H] → the softmax over
    [s·scale (masked to −inf), sink] without the sink's column: [T, H, n] fp32 — or, with
    `planes`, its exact split [3, T, H, n] bf16 (hi, mid, lo: strata.kernels.rowwise's
    split_bf16), the operand of planes_bmm. `out`: where to write it (each plane
    contiguous)."""
    T, H, n = s.shape
    if s.stride(-1) != 1:
        s = s.contiguous()
    m = (mask if mask.stride(-1) == 1 else mask.contiguous()).view(torch.uint8)  # (no copy)
    shape, dtype = ((3, T, H, n), torch.bfloat16) if planes else ((T, H, n), torch.float32)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=s.device)
    first = out[0] if planes else out
    if out.shape != shape or out.dtype != dtype or not first.is_contiguous():
        raise ValueError(f"sink_softmax: out must be {dtype} {list(shape)}, each plane "
                         f"contiguous; got {out.dtype} {list(out.shape)}")
    if T and H and n:
        _sink_softmax_kernel[(T, H)](s, m, sink.float().contiguous(), first, n, float(scale),
                                     s.stride(0), s.stride(1), m.stride(0), first.stride(0),
                                     first.stride(1), out.stride(0) if planes else 0,
                                     NB=triton.next_power_of_2(n), PLANES=planes,
                                     enable_fp_fusion=False, **pdl.args(s.device))
    return out
