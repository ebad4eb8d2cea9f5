"""ranked_topk's keys in one launch on CUDA (strata.model.numerics.ranked_topk), the
indexer's selection in one launch (top_picks, for strata.model.indexer.topk_lowest_index), and
greedy sampling's argmax (argmax_rows: the same keys, largest first).

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
# top_picks: entries a program reads at once in each of its passes over a row, its warps, and
# the copies of each radix count (one for each lane of a warp)
PICKS_BLOCK = 4096
PICKS_WARPS = 8
PICKS_COPIES = 32


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

    @triton.jit
    def _top_picks_kernel(s_ptr, o_ptr, n, k, s_row, o_row, BLOCK: tl.constexpr,
                          COPIES: tl.constexpr):
        # One row: the k largest finite scores (ties to the lower index) by a radix select on
        # their 32-bit ordered keys, 8 bits a pass from the top (each pass counts, among the
        # entries whose higher bits match the k-th largest's found so far, each value of the
        # next 8 bits; none when the row has no more than k entries), then one pass that
        # writes the picks in index order.
        row = tl.program_id(0).to(tl.int64)
        base = s_ptr + row * s_row
        bins = tl.arange(0, 256)
        # Each count is kept in COPIES copies, a lane's in the copy of its place in the warp
        # (a thread holds 4 adjacent entries): the histogram adds in shared memory one atomic
        # an entry, and the scores of a row share their top bits, so with one copy a warp's
        # adds to one count ran one after another (session 24: 5× slower at 131K entries).
        copy = (tl.arange(0, BLOCK) // 4) % COPIES
        # Every finite entry when the row has no more than k (keys of finite scores are > 0).
        threshold = tl.zeros((), tl.uint32)
        ties = 0  # entries equal to the threshold to take, the lowest first
        if n > k:
            prefix = tl.zeros((), tl.uint32)  # the k-th largest key's bits found so far
            want = k  # its rank among the entries that match them
            finite = 0
            for p in tl.static_range(4):
                shift = 24 - 8 * p
                copies = tl.zeros((256 * COPIES,), tl.int32)
                for start in range(0, n, BLOCK):
                    cols = start + tl.arange(0, BLOCK)
                    s = tl.load(base + cols, mask=cols < n,
                                other=float("-inf")).to(tl.float32)
                    u = _unsigned_key(s)
                    live = s > float("-inf")
                    if p > 0:
                        live = live & ((u >> (shift + 8)) == prefix)
                    bits = ((u >> shift) & 255).to(tl.int32)
                    copies += tl.histogram(bits * COPIES + copy, 256 * COPIES, mask=live)
                hist = tl.sum(tl.reshape(copies, (256, COPIES)), 1)
                if p == 0:
                    finite = tl.sum(hist)
                # the digit holding the sought rank: the largest whose entries at or above it
                # number at least `want`
                at_or_above = tl.sum(hist) - tl.cumsum(hist, 0) + hist
                digit = tl.max(tl.where(at_or_above >= want, bins, 0))
                want -= tl.sum(tl.where(bins > digit, hist, 0))
                prefix = (prefix << 8) | digit.to(tl.uint32)
            threshold = tl.where(finite > k, prefix, threshold)
            ties = tl.where(finite > k, want, 0)
        taken = 0
        equal_seen = 0
        for start in range(0, n, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            s = tl.load(base + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
            u = _unsigned_key(s)
            live = s > float("-inf")
            equal = (live & (u == threshold)).to(tl.int32)
            take = (live & (u > threshold)) | ((equal != 0) & (
                equal_seen + tl.cumsum(equal, 0) - equal < ties))
            take_i = take.to(tl.int32)
            tl.store(o_ptr + row * o_row + taken + tl.cumsum(take_i, 0) - take_i,
                     cols.to(tl.int64), mask=take)
            taken += tl.sum(take_i)
            equal_seen += tl.sum(equal)
        for start in range(0, k, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            tl.store(o_ptr + row * o_row + cols, tl.full((BLOCK,), -1, tl.int64),
                     mask=(cols >= taken) & (cols < k))


def top_picks(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[T, k] int64: for each row of scores [T, n] (float; rows may be strided), the indices
    of its k largest finite scores, ties to the lower index, in ascending order, then −1 —
    strata.model.indexer.topk_lowest_index's definition, in one launch: one program a row
    reads the row at most five times (four 8-bit radix passes over 32-bit keys, then the
    picks in index order), where torch radix-selected over int64 keys written to memory first
    and sorted the picks after (four launches at least; ~60–75 µs a decode query's row of 8K
    entries, H200)."""
    T, n = scores.shape
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    out = torch.empty((T, k), dtype=torch.int64, device=scores.device)
    if T and k:
        _top_picks_kernel[(T,)](scores, out, n, k, scores.stride(0), out.stride(0),
                                BLOCK=PICKS_BLOCK, COPIES=PICKS_COPIES,
                                num_warps=PICKS_WARPS)
    return out


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
