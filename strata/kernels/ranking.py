"""ranked_topk's keys in one launch on CUDA (strata.model.numerics.ranked_topk), the
indexer's selection without keys in memory (top_picks, for
strata.model.indexer.topk_lowest_index), and greedy sampling's argmax (argmax_rows: the same
keys, largest first).

A stable descending top-k is a top-k over distinct int64 keys: the score's float bits mapped to
an integer of the same order (−0 made +0 first), above the reversed index. In torch that is
six launches over the [rows, n] scores, each writing int64 — at long context the indexer ranks
[queries, 262K] entries per piece. Here one pass writes the keys, with the same integer
operations (the same bits: the selection cannot differ)."""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch definition is used
    triton = None

BLOCK = 1024
# argmax_rows: values per program of its first pass (a 129,280-wide row: 64 programs)
ARGMAX_BLOCK = 2048
# top_picks: entries a program reads at once in each pass over its part of a row, its warps,
# and how a row is split: into parts of at least PICKS_PART entries while all the rows' parts
# number at most PICKS_PROGRAMS (two a streaming multiprocessor of an H200), so a decode
# query's long row is read by many programs at once and a prefill piece's many rows one
# program each
PICKS_BLOCK = 4096
PICKS_MIN_BLOCK = 256  # (a row shorter than this: one entry a thread of 8 warps)
PICKS_WARPS = 8
PICKS_PART = 4096
PICKS_PROGRAMS = 264
PICKS_COUNTS = 64  # a part's picks start after the earlier parts' counts, read this many at once


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


if triton is not None:
    from strata.kernels import pdl
    from strata.kernels.pdl import wait_then_release

    @triton.jit
    def _ordered32(s):
        """An fp32's bits as an int32 of the same order (−0 ranks as +0)."""
        bits = tl.where(s == 0.0, 0, s.to(tl.int32, bitcast=True))
        return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)

    @triton.jit
    def _ordered(s):
        return _ordered32(s).to(tl.int64)

    @triton.jit
    def _unsigned_key(s):
        """The same order as a uint32: −inf the least of the scores', above 0."""
        return _ordered32(s).to(tl.uint32, bitcast=True) ^ 0x80000000

    @triton.jit
    def _rank_keys_kernel(s_ptr, o_ptr, n, s_row, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = cols < n
        s = tl.load(s_ptr + row * s_row + cols, mask=live, other=0.0).to(tl.float32)
        key = (_ordered(s) << 32) + (n - 1 - cols).to(tl.int64)
        tl.store(o_ptr + row * n + cols, key, mask=live)

    @triton.jit
    def _argmax_part_kernel(s_ptr, part_ptr, n, s_row, parts, BLOCK: tl.constexpr,
                            PDL: tl.constexpr):
        # A block of one row: its largest key (value, then the lower index).
        wait_then_release(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = cols < n
        # (a lane past the row: −inf at a negative reversed index, below every live key)
        s = tl.load(s_ptr + row * s_row + cols, mask=live, other=float("-inf")).to(tl.float32)
        ordered = tl.where(s != s, 0x7FFFFFFF, _ordered(s))  # (a NaN is the largest, as torch)
        key = (ordered << 32) + (n - 1 - cols).to(tl.int64)
        tl.store(part_ptr + row * parts + tl.program_id(1), tl.max(key, axis=0))

    @triton.jit
    def _argmax_kernel(part_ptr, o_ptr, n, parts, P: tl.constexpr, PDL: tl.constexpr):
        wait_then_release(PDL)
        row = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, P)
        key = tl.max(tl.load(part_ptr + row * parts + i, mask=i < parts,
                             other=-9223372036854775807), axis=0)  # (int64's least + 1)
        tl.store(o_ptr + row, n - 1 - (key & 0xFFFFFFFF))

    # The selection (top_picks): the k largest finite scores of a row, ties to the lower
    # index, by a radix select over their 32-bit ordered keys — 8 bits a pass from the top,
    # each pass counting, among the entries whose higher bits match the k-th largest key's
    # found so far, each value of the next 8 bits — then the picks written in index order.

    @triton.jit
    def _part_counts(base, lo, hi, prefix, P: tl.constexpr, BLOCK: tl.constexpr):
        """Counts [256] of byte P (from the top) of the keys of the finite scores at [lo, hi)
        whose higher bytes are prefix's. (Measured slower: each count in 2 or 32 copies, a
        lane's adds in its own — tl.histogram's time grows with its bins — and 4-bit digits,
        twice the passes; session 25, H200.)"""
        shift = 24 - 8 * P
        hist = tl.zeros((256,), tl.int32)
        for start in range(lo, hi, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            s = tl.load(base + cols, mask=cols < hi, other=float("-inf")).to(tl.float32)
            u = _unsigned_key(s)
            live = s > float("-inf")
            if P > 0:
                live = live & ((u >> (shift + 8)) == prefix)
            bits = ((u >> shift) & 255).to(tl.int32)
            hist += tl.histogram(bits, 256, mask=live)
        return hist

    @triton.jit
    def _narrowed(hist, prefix, want):
        """The k-th largest key's next byte from the row's counts of it: the largest value
        whose entries at or above it number at least `want` (its rank among the entries that
        match prefix) — prefix extended by it, and the rank among those that match that."""
        bins = tl.arange(0, 256)
        at_or_above = tl.sum(hist) - tl.cumsum(hist, 0) + hist
        digit = tl.max(tl.where(at_or_above >= want, bins, 0))
        above = tl.sum(tl.where(bins > digit, hist, 0))
        return (prefix << 8) | digit.to(tl.uint32), want - above

    @triton.jit
    def _part_picks(base, lo, hi, threshold, ties, equal_before, BLOCK: tl.constexpr,
                    out, taken, ids):
        """Counts (above, equal) of the finite scores at [lo, hi) whose key is above / equal
        to the threshold (above: only without `out`); with `out`, the picks among them
        written there from slot `taken` in index order: every entry above, and an equal one
        while fewer than `ties` equal ones come before it (`equal_before` of them before lo)
        — each as its index, or as the row's ids (`ids`, int64) hold at it."""
        above = 0
        equal_seen = tl.zeros((), tl.int32) + equal_before  # (tensors, though given as 0)
        taken = tl.zeros((), tl.int32) + taken
        for start in range(lo, hi, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            s = tl.load(base + cols, mask=cols < hi, other=float("-inf")).to(tl.float32)
            u = _unsigned_key(s)
            live = s > float("-inf")
            is_above = live & (u > threshold)
            equal = (live & (u == threshold)).to(tl.int32)
            if out is not None:
                take = is_above | ((equal != 0) & (
                    equal_seen + tl.cumsum(equal, 0) - equal < ties))
                take_i = take.to(tl.int32)
                if ids is not None:
                    pick = tl.load(ids + cols, mask=take, other=-1)
                else:
                    pick = cols.to(tl.int64)
                tl.store(out + taken + tl.cumsum(take_i, 0) - take_i, pick, mask=take)
                taken += tl.sum(take_i)
            else:  # (a writing pass needs only the equal ones counted)
                above += tl.sum(is_above.to(tl.int32))
            equal_seen += tl.sum(equal)
        return above, equal_seen - equal_before, taken

    @triton.jit
    def _fill_empty(out, taken, k, BLOCK: tl.constexpr):
        for start in range(0, k, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            tl.store(out + cols, tl.full((BLOCK,), -1, tl.int64),
                     mask=(cols >= taken) & (cols < k))

    @triton.jit
    def _top_picks_kernel(s_ptr, o_ptr, i_ptr, n, k, s_row, o_row, i_row, BLOCK: tl.constexpr,
                          IDS: tl.constexpr, PDL: tl.constexpr):
        # A row in one program: the four passes (none when the row has no more than k
        # entries: then every finite one is a pick), then the picks.
        wait_then_release(PDL)
        row = tl.program_id(0).to(tl.int64)
        base = s_ptr + row * s_row
        threshold = tl.zeros((), tl.uint32)  # (keys of finite scores are > 0)
        ties = 0
        if n > k:
            hist = _part_counts(base, 0, n, threshold, 0, BLOCK)
            finite = tl.sum(hist)
            prefix, want = _narrowed(hist, threshold, k)
            for p in tl.static_range(1, 4):
                prefix, want = _narrowed(_part_counts(base, 0, n, prefix, p, BLOCK), prefix,
                                         want)
            threshold = tl.where(finite > k, prefix, threshold)
            ties = tl.where(finite > k, want, 0)
        out = o_ptr + row * o_row
        ids = i_ptr + row * i_row if IDS else None
        _, _, taken = _part_picks(base, 0, n, threshold, ties, 0, BLOCK, out, 0, ids)
        _fill_empty(out, taken, k, BLOCK)

    @triton.jit
    def _selected(hist_ptr, row, rows, n, k, P: tl.constexpr):
        """A split row's k-th largest key's bytes found by its passes before P (their counts
        at hist_ptr [4, rows, 256]): (the bytes, the rank sought among the entries that match
        them, the row's finite entries — n before the first pass)."""
        prefix = tl.zeros((), tl.uint32)
        want = k
        finite = n
        for q in tl.static_range(P):
            hist = tl.load(hist_ptr + (q * rows + row) * 256 + tl.arange(0, 256))
            if q == 0:
                finite = tl.sum(hist)
            prefix, want = _narrowed(hist, prefix, want)
        return prefix, want, finite

    # (rows and parts change with the context and the prefill's pieces: not specialised on,
    # so a long prompt compiles nothing its warm-up did not — 17 compiles, ~8 s, in a 128K
    # prefill's timed run before; H200, session 32)
    @triton.jit(do_not_specialize=["rows"])
    def _split_counts_kernel(s_ptr, hist_ptr, n, k, rows, s_row, part, P: tl.constexpr,
                             BLOCK: tl.constexpr, PDL: tl.constexpr):
        # Pass P over one part of a row, its counts added to the row's.
        wait_then_release(PDL)
        row = tl.program_id(0).to(tl.int64)
        lo = tl.program_id(1) * part
        prefix, _, finite = _selected(hist_ptr, row, rows, n, k, P)
        if finite > k:  # (else every finite entry is a pick: no bytes to find)
            hist = _part_counts(s_ptr + row * s_row, lo, tl.minimum(lo + part, n), prefix, P,
                                BLOCK)
            tl.atomic_add(hist_ptr + (P * rows + row) * 256 + tl.arange(0, 256), hist,
                          mask=hist != 0, sem="relaxed")

    @triton.jit(do_not_specialize=["rows", "parts"])
    def _split_picks_kernel(s_ptr, hist_ptr, part_ptr, o_ptr, i_ptr, n, k, rows, s_row, o_row,
                            i_row, part, parts, WRITE: tl.constexpr, IDS: tl.constexpr,
                            COUNTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        # One part of a row: its entries above and equal to the threshold counted (into
        # part_ptr [rows, parts, 2]); with WRITE, its picks written after those of the parts
        # before it, and the last part fills the row's empty slots.
        wait_then_release(PDL)
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        lo = c * part
        prefix, want, finite = _selected(hist_ptr, row, rows, n, k, 4)
        threshold = tl.where(finite > k, prefix, tl.zeros((), tl.uint32))
        ties = tl.where(finite > k, want, 0)
        base = s_ptr + row * s_row
        counts = part_ptr + row * parts * 2
        if WRITE:
            above_before = tl.zeros((), tl.int32)
            equal_before = tl.zeros((), tl.int32)
            for start in range(0, c, COUNTS):  # (the parts before this one)
                i = start + tl.arange(0, COUNTS)
                before = i < c
                above_before += tl.sum(tl.load(counts + 2 * i, mask=before, other=0))
                equal_before += tl.sum(tl.load(counts + 2 * i + 1, mask=before, other=0))
            out = o_ptr + row * o_row
            ids = i_ptr + row * i_row if IDS else None
            _, _, taken = _part_picks(base, lo, tl.minimum(lo + part, n), threshold, ties,
                                      equal_before, BLOCK, out,
                                      above_before + tl.minimum(equal_before, ties), ids)
            if c == parts - 1:
                _fill_empty(out, taken, k, BLOCK)
        else:
            above, equal, _ = _part_picks(base, lo, tl.minimum(lo + part, n), threshold, ties,
                                          0, BLOCK, None, 0, None)
            tl.store(counts + 2 * c, above)
            tl.store(counts + 2 * c + 1, equal)


def top_picks(scores: torch.Tensor, k: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """[T, k] int64: for each row of scores [T, n] (float; rows may be strided), the indices
    of its k largest finite scores, ties to the lower index, in ascending order, then −1 (with
    `ids` [T, n] int64: ids[t, index] in their place) —
    strata.model.indexer.topk_lowest_index's definition, with no keys in memory and no sort:
    where torch radix-selected over int64 keys written first and sorted the picks after (a
    decode query's row of 8K–512K entries: 27–29 µs here, 88–217 µs torch's ops; H200,
    scripts/probe_warps.py ONLY=top, session 25). A row is read five
    times (four 8-bit radix passes, then the picks in index order): by one program in one
    launch, or — a long row among few (a decode query at long context) — in parts, a program
    each, with a launch a pass (the parts' counts added in the row's) and two for the picks
    (each part's counts, then its picks at its offset)."""
    T, n = scores.shape
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    if ids is not None and (tuple(ids.shape) != (T, n) or ids.dtype != torch.int64):
        raise ValueError(f"top_picks: ids {list(ids.shape)} {ids.dtype} for scores [{T}, {n}]")
    idv = scores if ids is None else (ids if ids.stride(1) == 1 else ids.contiguous())
    out = torch.empty((T, k), dtype=torch.int64, device=scores.device)
    if not (T and k):
        return out
    parts = min(triton.cdiv(n, PICKS_PART), max(1, PICKS_PROGRAMS // T)) if n > k else 1
    launch = dict(num_warps=PICKS_WARPS, **pdl.args(scores.device))
    if parts == 1:  # (a short row read by a block of its own size: a 768-entry row, 4,096
        # masked, took 24 µs, 1,024 wide 15 µs — H200, probe_warps KNOB=BLOCK, session 26)
        block = min(PICKS_BLOCK, max(triton.next_power_of_2(n), PICKS_MIN_BLOCK))
        _top_picks_kernel[(T,)](scores, out, idv, n, k, scores.stride(0), out.stride(0),
                                idv.stride(0), BLOCK=block, IDS=ids is not None, **launch)
        return out
    # (parts of a multiple of 64 entries: with n a multiple of 16 — the indexer's buckets —
    # Triton then knows each part's loads 4-wide aligned)
    part = triton.cdiv(triton.cdiv(n, parts), 64) * 64
    parts = triton.cdiv(n, part)
    hist = torch.zeros((4, T, 256), dtype=torch.int32, device=scores.device)
    counts = torch.empty((T, parts, 2), dtype=torch.int32, device=scores.device)
    for p in range(4):
        _split_counts_kernel[(T, parts)](scores, hist, n, k, T, scores.stride(0), part, P=p,
                                         BLOCK=PICKS_BLOCK, **launch)
    for write in (False, True):
        _split_picks_kernel[(T, parts)](scores, hist, counts, out, idv, n, k, T,
                                        scores.stride(0), out.stride(0), idv.stride(0), part,
                                        parts, WRITE=write, IDS=ids is not None,
                                        COUNTS=PICKS_COUNTS, BLOCK=PICKS_BLOCK, **launch)
    return out


def compile_split(device: torch.device) -> None:
    """Compile top_picks' split kernels (with and without ids) by one small selection over a
    row of two parts: a prefill meets them only at long context (a piece of few queries over
    many entries), so a warm-up at short context would leave their compiles to the first long
    prompt (~4 s of a 128K prefill's timed run; H200, session 32). The shapes keep the
    specialisations the model's calls have (entries, row stride and k multiples of 16)."""
    n = 2 * PICKS_PART
    scores = torch.zeros((1, n), dtype=torch.float32, device=device)
    top_picks(scores, 16)
    top_picks(scores, 16, torch.zeros((1, n), dtype=torch.int64, device=device))


def rank_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys [..., n] of scores [..., n] (float; rows may be strided): key order = score
    order, ties to the lower index."""
    n = scores.shape[-1]
    if scores.numel() == 0:  # (no entries yet, or no rows: reshape(-1, 0) is ambiguous)
        return torch.empty(scores.shape, dtype=torch.int64, device=scores.device)
    rows = scores.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.int64, device=scores.device)
    if rows.numel():
        _rank_keys_kernel[(rows.shape[0], triton.cdiv(n, BLOCK))](
            rows, out, n, rows.stride(0), BLOCK=BLOCK, num_warps=4)
    return out.view(scores.shape)


def argmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """torch.argmax(scores, -1) for scores [R, n] (float; rows may be strided) → [R] int64:
    the first index of the largest value (−0 equal to +0; a NaN counts as the largest, as in
    torch), each row's blocks' largest keys then their largest — two small launches where
    torch's reduction of a 129,280-wide row of logits took ~27 µs (one row, one block)."""
    R, n = scores.shape
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    out = torch.empty(R, dtype=torch.int64, device=scores.device)
    if R == 0:
        return out
    if n == 0:
        raise ValueError("argmax_rows: rows of no values")
    parts = triton.cdiv(n, ARGMAX_BLOCK)
    part = torch.empty((R, parts), dtype=torch.int64, device=scores.device)
    _argmax_part_kernel[(R, parts)](scores, part, n, scores.stride(0), parts,
                                    BLOCK=ARGMAX_BLOCK, num_warps=4, **pdl.args(scores.device))
    _argmax_kernel[(R,)](part, out, n, parts, P=triton.next_power_of_2(parts), num_warps=4,
                         **pdl.args(scores.device))
    return out
