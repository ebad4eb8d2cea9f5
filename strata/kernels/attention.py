"""The attention's small steps in one launch each on CUDA (strata.model.attention).

Rows: a piece of queries' key rows — each query's W window positions, from this forward's kv
or the ring (with their visibility), then its selected compressed entries (−1: empty) —
gathered into one [rows, W + k, hd] tensor of their stored dtype with its mask: in torch a
dozen index, compare, select, cast and concatenate kernels per layer and piece, and several
copies of the rows. Every row is a copy (widened exactly where dtypes differ), so the bits are
the torch path's. Where every source holds its rows in one dtype, `row_table` stores only
where each row lies (a rowwise.RowTable, 8 bytes a row instead of hd · 2) and the products
read the rows there — the same values, so the same bits.

Softmax and p·v: sparse_attention scales a query's scores, masks its invisible rows, appends
the head's sink logit, takes the softmax, drops the sink's column and multiplies the
probabilities by the rows: five torch kernels and a product per layer and piece. Here
(`sink_softmax_pv`) one launch finds each (query, head) row's maximum and denominator in
registers, with the same formulation (the sink enters the maximum and the denominator only),
and p = exp(x − max) / denominator is formed element by element:
- for a prefill piece, by the p·v kernel where it multiplies it — p is never stored, so the
  piece's scratch is its scores alone and its pieces are 2.4 times as large at V4.1 (fewer
  launches: the host's launches bound a prefill chunk, bench/results/performance.md, session
  54), and each p·v program reads 4 bytes of score an element where it read 6 of stored p;
- for a decode step or a verify window (at most SMALL_BATCH queries), by a launch of its own
  that stores it — for bf16 values as the three bf16 parts the product splits it into: there
  each of the p·v kernel's column programs of a query would form, and split, the same p again
  (a decode step's p·v took 21.9 µs, against 10.0 reading p stored in fp32: H100, session
  58).
Both form p with the same element-by-element operations (`_probabilities`), so its bits, and
the product's, are the same either way. (Not in the statistics launch: a store there can
change how the compiler lays out the row it sums, and so the denominator's rounding.)
Triton's exp is not torch's, so the result agrees to fp32 rounding. Each row is computed
alone: batch-invariant.
"""
from __future__ import annotations

import torch

from strata.kernels.rowwise import K_CHUNK, SMALL_BATCH, TILE_WARPS, RowTable, sum_chunks

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
    def _softmax_stats_kernel(s_ptr, m_ptr, sink_ptr, st_ptr, n, scale, s_t, s_h, m_t,
                              NB: tl.constexpr, PDL: tl.constexpr):
        # One (query, head) row: its maximum over [s·scale (masked to −inf), sink] and the
        # softmax's denominator Σ exp(x − top) + exp(sink − top), at st[t, h, 0:2].
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
        den = tl.sum(tl.exp(x - top), axis=0) + tl.exp(sink - top)
        st = st_ptr + (t * tl.num_programs(1) + h) * 2
        tl.store(st, top)
        tl.store(st + 1, den)

    @triton.jit
    def _probabilities(x, ok, top, den, scale):
        # p = exp(x·scale − top) / den where ok, else 0 — element by element, so its bits do
        # not depend on the tile or the kernel that forms it (_softmax_p_kernel,
        # _softmax_pv_kernel).
        return tl.exp(tl.where(ok, x * scale, float("-inf")) - top) / den

    @triton.jit
    def _softmax_p_kernel(s_ptr, m_ptr, st_ptr, p_ptr, n, plane, scale, s_t, s_h, m_t,
                          BLOCK: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):
        # p[t, h, j] (contiguous [T, H, n]) from the scores and the rows' statistics, for
        # _softmax_pv_kernel's P_STORED: one (query, head) row's BLOCK entries a program.
        # SPLIT: stored as its split_bf16 parts hi, mid, lo, `plane` elements apart (bf16).
        wait_then_release(PDL)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        j = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
        live = j < n
        st = st_ptr + (t * tl.num_programs(1) + h) * 2
        x = tl.load(s_ptr + t * s_t + h * s_h + j, mask=live, other=0.0)
        ok = (tl.load(m_ptr + t * m_t + j, mask=live, other=0) != 0) & live
        p = _probabilities(x, ok, tl.load(st), tl.load(st + 1), scale)
        out = p_ptr + (t * tl.num_programs(1) + h) * n + j
        if SPLIT:
            hi, mid, lo = split_bf16(p)
            tl.store(out, hi, mask=live)
            tl.store(out + plane, mid, mask=live)
            tl.store(out + 2 * plane, lo, mask=live)
        else:
            tl.store(out, p, mask=live)

    @triton.jit
    def _softmax_pv_kernel(s_ptr, m_ptr, st_ptr, v_ptr, tab_ptr, o_ptr, H, n, hd, m_blocks,
                           k_chunk, scale, s_t, s_h, s_plane, m_t, s_vt, s_vk, s_tab, o_c,
                           o_t, o_h,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, WIDEN: tl.constexpr,
                           TABLE: tl.constexpr, P_STORED: tl.constexpr, PDL: tl.constexpr):
        # One query's BLOCK_M heads × BLOCK_N value columns over one chunk of its rows: p =
        # exp(x − top) / den from the scores and the rows' statistics, element by element (so
        # its bits do not depend on the tile) — P_STORED: s is _softmax_p_kernel's p, the same
        # values (SPLIT: its parts, s_plane apart) — then p·v as rowwise's products make it:
        # SPLIT (bf16 values), p as hi + mid + lo bf16 — three exact tensor-core products; else
        # IEEE fp32. TABLE: v's row k starts at v_ptr + tab[t, k] (a RowTable), else at
        # s_vt·t + s_vk·k.
        wait_then_release(PDL)
        pid = tl.program_id(0)  # t · m_blocks + head block
        t = (pid // m_blocks).to(tl.int64)
        heads = (pid % m_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        chunk = tl.program_id(2)
        live_h = heads < H
        st = st_ptr + (t * H + heads) * 2
        top = tl.load(st, mask=live_h, other=0.0)
        den = tl.load(st + 1, mask=live_h, other=1.0)
        s_row = s_ptr + t * s_t + heads[:, None] * s_h
        k_start = chunk * k_chunk
        k_end = tl.minimum(k_start + k_chunk, n)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            live = ks < k_end
            pm = live_h[:, None] & live[None, :]
            if P_STORED and SPLIT:
                hi = tl.load(s_row + ks[None, :], mask=pm, other=0.0)
                mid = tl.load(s_row + s_plane + ks[None, :], mask=pm, other=0.0)
                lo = tl.load(s_row + 2 * s_plane + ks[None, :], mask=pm, other=0.0)
            else:
                p = tl.load(s_row + ks[None, :], mask=pm, other=0.0)
                if not P_STORED:
                    ok = (tl.load(m_ptr + t * m_t + ks, mask=live, other=0) != 0) & live
                    p = _probabilities(p, live_h[:, None] & ok[None, :], top[:, None],
                                       den[:, None], scale)
                if SPLIT:
                    hi, mid, lo = split_bf16(p)
            v_mask = live[:, None] & (cols[None, :] < hd)
            if TABLE:  # (row starts: multiples of 16 elements — RowTable's)
                v_rows = v_ptr + tl.multiple_of(
                    tl.load(tab_ptr + t * s_tab + ks, mask=live, other=0), 16)
            else:
                v_rows = v_ptr + t * s_vt + ks.to(tl.int64) * s_vk
            v = tl.load(v_rows[:, None] + cols[None, :], mask=v_mask, other=0.0)
            if SPLIT:
                if WIDEN:  # (the interpreter: 16-bit tiles widened, IEEE dots — exact)
                    vf = v.to(tl.float32)
                    acc = tl.dot(hi.to(tl.float32), vf, acc, input_precision="ieee")
                    acc = tl.dot(mid.to(tl.float32), vf, acc, input_precision="ieee")
                    acc = tl.dot(lo.to(tl.float32), vf, acc, input_precision="ieee")
                else:
                    acc = tl.dot(hi, v, acc)
                    acc = tl.dot(mid, v, acc)
                    acc = tl.dot(lo, v, acc)
            else:
                acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
        tl.store(o_ptr + chunk.to(tl.int64) * o_c + t * o_t + heads[:, None] * o_h
                 + cols[None, :], acc, mask=live_h[:, None] & (cols[None, :] < hd))


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


# sink_softmax_pv's p·v tiles (heads × value columns × rows). bf16 values' split products on
# tensor cores: 64 heads (V4.1's, in one tile) by 64 rows, as rowwise's SPLIT tile,
# PV_SMALL_COLUMNS for a decode step or verify window (more programs for a few queries: a
# decode query's p·v over 640 rows 6.7 µs at 16 columns, 10.1 at 32 — H100, session 59),
# PV_PREFILL_COLUMNS for more — every program reads its query's scores, so wider tiles read
# them fewer times. A tile's width changes no bit (p is element by element; the products'
# chain over rows is the same). Any other values: IEEE fp32 FMAs, 32 × 32 × 32.
PV_SMALL_COLUMNS = 16
PV_PREFILL_COLUMNS = 128
FMA_TILE = (32, 32, 32)
P_BLOCK = 256  # _softmax_p_kernel: a row's entries a program


def sink_softmax_pv(s: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor, scale: float,
                    rows: "torch.Tensor | RowTable", out: torch.Tensor | None = None,
                    k_chunk: int = K_CHUNK) -> torch.Tensor:
    """The attention's output from its scores: s [T, H, n] fp32 scores, mask [T, n] bool
    (visible rows), sink [H], rows [T, n, hd] the values (the key rows, K == V: a tensor with
    contiguous rows, or a RowTable) → softmax over [s·scale (masked to −inf), sink] without
    the sink's column, times the rows: [T, H, hd] fp32, into `out` (a contiguous fp32
    [T, H, hd]) if given. Two launches: each row's maximum and denominator, then p·v with p
    formed in registers where it is multiplied — for at most SMALL_BATCH queries, a launch
    between them forms p and stores it ([T, H, n] fp32, or for bf16 rows its three bf16
    parts), with the same bits. Rows past k_chunk (a multiple of 64) are summed in chunks
    computed in parallel and added in order — a partition by position alone, so a query's
    bits do not depend on T or on masked rows after its last visible one."""
    T, H, n = s.shape
    hd = rows.shape[-1]
    if tuple(rows.shape[:2]) != (T, n):
        raise ValueError(f"sink_softmax_pv: rows {list(rows.shape)} do not match scores "
                         f"{list(s.shape)}")
    if out is None:
        out = torch.empty((T, H, hd), dtype=torch.float32, device=s.device)
    elif out.shape != (T, H, hd) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"sink_softmax_pv: out must be a contiguous fp32 {[T, H, hd]}, got "
                         f"{out.dtype} {list(out.shape)}")
    if T == 0 or H == 0 or hd == 0:
        return out
    if n == 0:  # (no rows: the sink takes every probability)
        return out.zero_()
    if s.stride(-1) != 1:
        s = s.contiguous()
    m = (mask if mask.stride(-1) == 1 else mask.contiguous()).view(torch.uint8)  # (no copy)
    stats = torch.empty((T, H, 2), dtype=torch.float32, device=s.device)
    _softmax_stats_kernel[(T, H)](s, m, sink.float().contiguous(), stats, n, float(scale),
                                  s.stride(0), s.stride(1), m.stride(0),
                                  NB=triton.next_power_of_2(n), enable_fp_fusion=False,
                                  **pdl.args(s.device))
    table = isinstance(rows, RowTable)
    if table:
        v, tab, s_vt, s_vk, s_tab = rows.base, rows.offsets, 0, 0, rows.offsets.stride(0)
    else:
        v = rows if rows.stride(-1) == 1 else rows.contiguous()
        tab, s_vt, s_vk, s_tab = v, v.stride(0), v.stride(1), 0
    split = v.dtype == torch.bfloat16
    p, plane = s, 0
    stored = T <= SMALL_BATCH  # (a decode step's or a verify window's p: formed once, stored)
    if stored:  # (bf16 values: p's three bf16 parts, as the product splits it)
        planes = torch.empty((3 if split else 1, T, H, n), device=s.device,
                             dtype=torch.bfloat16 if split else torch.float32)
        p, plane = planes[0], T * H * n
        _softmax_p_kernel[(T, H, triton.cdiv(n, P_BLOCK))](
            s, m, stats, planes, n, plane, float(scale), s.stride(0), s.stride(1), m.stride(0),
            BLOCK=P_BLOCK, SPLIT=split, enable_fp_fusion=False, **pdl.args(s.device))
    bm, bn, bk = ((64, PV_SMALL_COLUMNS if stored else PV_PREFILL_COLUMNS, 64) if split
                  else FMA_TILE)
    chunks = triton.cdiv(n, k_chunk) if n > k_chunk else 1
    dest = out if chunks == 1 else torch.empty((chunks, T, H, hd), dtype=torch.float32,
                                               device=s.device)
    m_blocks = triton.cdiv(H, bm)
    _softmax_pv_kernel[(T * m_blocks, triton.cdiv(hd, bn), chunks)](
        p, m, stats, v, tab, dest, H, n, hd, m_blocks,
        k_chunk if chunks > 1 else n, float(scale), p.stride(0), p.stride(1), plane,
        m.stride(0), s_vt, s_vk, s_tab, dest.stride(0) if chunks > 1 else 0,
        *dest.stride()[-3:-1], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split,
        WIDEN=not s.is_cuda, TABLE=table, P_STORED=stored, num_warps=TILE_WARPS,
        enable_fp_fusion=False, **pdl.args(s.device))
    return out if chunks == 1 else sum_chunks(dest, out)
