"""ranked_topk's keys in one launch on CUDA (strata.model.numerics.ranked_topk), and the
indexer's picks put in order in one launch (strata.model.indexer.topk_lowest_index).

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
# sorted_picks sorts a row of up to this many picks in registers (the indexer's 512); wider
# selections keep the torch ops
MAX_PICKS = 4096


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


if triton is not None:
    @triton.jit
    def _rank_keys_kernel(s_ptr, o_ptr, n, s_row, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = cols < n
        s = tl.load(s_ptr + row * s_row + cols, mask=live, other=0.0).to(tl.float32)
        bits = tl.where(s == 0.0, 0, s.to(tl.int32, bitcast=True))  # (−0 ranks as +0)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
        key = (ordered << 32) + (n - 1 - cols).to(tl.int64)
        tl.store(o_ptr + row * n + cols, key, mask=live)

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
