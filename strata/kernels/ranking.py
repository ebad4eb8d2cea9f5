"""ranked_topk's keys in one launch on CUDA (strata.model.numerics.ranked_topk), the
indexer's picks put in order in one launch (strata.model.indexer.topk_lowest_index), and
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
# sorted_picks sorts a row of up to this many picks in registers (the indexer's 512); wider
# selections keep the torch ops
MAX_PICKS = 4096


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


if triton is not None:
    from strata.kernels import pdl
    from strata.kernels.pdl import wait_then_release

    @triton.jit
    def _ordered(s):
        """An fp32's bits as an int64 of the same order (−0 ranks as +0)."""
        bits = tl.where(s == 0.0, 0, s.to(tl.int32, bitcast=True))
        return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)

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
    def _sorted_picks_kernel(idx_ptr, s_ptr, o_ptr, n, m, k, s_idx, s_row, s_out,
                             B: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        lanes = tl.arange(0, B)
        live = lanes < m
        i = tl.load(idx_ptr + row * s_idx + lanes, mask=live, other=0)
        v = tl.load(s_ptr + row * s_row + i, mask=live, other=float("-inf"))
        # a pick with no finite score, and the lanes past m, sort last as n, then read −1
        i = tl.where(live & (v > float("-inf")), i, n).to(tl.int32)
        i = tl.sort(i, 0)
        tl.store(o_ptr + row * s_out + lanes, tl.where(i < n, i, -1).to(tl.int64),
                 mask=lanes < k)


def sorted_picks(idx: torch.Tensor, scores: torch.Tensor, k: int) -> torch.Tensor:
    """[T, k] int64: the picks idx [T, m] (m ≤ k) of scores [T, n] whose score is finite, in
    ascending order, then −1 — what topk_lowest_index's torch ops make of them (a gather, two
    wheres, a sort and a pad), in one launch."""
    T, m = idx.shape
    n = scores.shape[1]
    out = torch.empty((T, k), dtype=torch.int64, device=idx.device)
    if T:
        _sorted_picks_kernel[(T,)](idx, scores, out, n, m, k, idx.stride(0), scores.stride(0),
                                   out.stride(0), B=triton.next_power_of_2(max(k, 2)),
                                   num_warps=4)
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
