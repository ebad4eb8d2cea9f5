"""The indexer's scores in one launch on CUDA (strata.model.indexer.Indexer.select).

score[t, e] = Σ_h w[t, h] · relu(q[t, h] · k[e]) over a query's heads. In torch that is a
[T, heads, entries] fp32 tensor of per-head products written and read back, a relu over it
and a second product — at long context the largest tensors a prefill chunk makes (32 heads ×
131,072 entries × 4 bytes per query at 524K). Here a program takes two queries and a block
of entries: the heads' products stay in registers (tl.dot over the head dimension, fp32
accumulation), then the relu, the weights, the sum over heads and the query's visibility mask.
The products run on tensor cores: 16-bit pairs directly (vendor numerics: exact fp4 values);
the reference numerics' fp32 queries against bf16 keys as three bf16 products, the query
split exactly into hi + mid + lo (each product exact in fp32, so within fp32 rounding of the
torch code). Every score is computed from its own query and entry in a fixed order, so it
does not depend on the batch (decode, verify window, prefill piece) nor on how many entries
the call covers.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch definition is used
    triton = None

BLOCK_T = 2    # queries per program (their heads fill a 64-row tile; the keys are read T/2 times)
BLOCK_H = 32   # heads per query in a tile (V4.1's indexer has 32); more: tiles summed in order
BLOCK_N = 128  # entries per program
BLOCK_K = 64   # head-dimension slice per tl.dot
NUM_WARPS = 4


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


def _contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


if triton is not None:
    from strata.kernels.rowwise import split_bf16

    # (T, the queries of a piece, changes with the context: not specialised on, so a long
    # prompt compiles no new variant — see strata.kernels.ranking's split kernels)
    @triton.jit(do_not_specialize=["T"])
    def _index_scores_kernel(q_ptr, k_ptr, w_ptr, vis_ptr, e_ptr, o_ptr, w_scale, T, H, N, M,
                             D, sqt, sqh, sqd, skn, skd, swt, swh, set_, sot,
                             BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             PRODUCT: tl.constexpr, GATHER: tl.constexpr):
        # A tile column is one (query, head): BLOCK_T queries' heads share the keys' tile
        # loads. A score's q·k is its own chain of MMA steps over the head dimension whatever
        # column of the tile holds it, and a query's sum over its heads reduces its own
        # BLOCK_H columns: the same bits for a query alone or in any slot of a batch
        # (tests/gpu checks a query in the second slot against alone). GATHER: one query a
        # program, its own entries (ids at e_ptr [T, M], −1 none) as the tile's keys, every
        # column block holding the query (the same tile shapes, so the same bits as its scores
        # among all entries; the copies past the first are not stored).
        if GATHER:
            t0 = tl.program_id(0).to(tl.int64)
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_n = tl.load(e_ptr + t0 * set_ + cols, mask=cols < M, other=-1)
            live_n = (offs_n >= 0) & (offs_n < N)
            r = tl.arange(0, BLOCK_T * BLOCK_H)
            tq = t0 + 0 * r
        else:
            t0 = tl.program_id(0).to(tl.int64) * BLOCK_T
            offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            cols = offs_n
            live_n = offs_n < N
            r = tl.arange(0, BLOCK_T * BLOCK_H)
            tq = t0 + r // BLOCK_H
        # The products transposed — entries the tile's rows, a query's heads BLOCK_H adjacent
        # columns — so the sum over a query's heads stays in each thread and its quad of lanes
        # (as rows, a query's 32 heads span two warps: the sum went through shared memory)
        total = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            heads = h0 + r % BLOCK_H
            live = (tq < T) & (heads < H)
            acc = tl.zeros([BLOCK_N, BLOCK_T * BLOCK_H], dtype=tl.float32)
            for k0 in range(0, D, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                qk = tl.load(q_ptr + tq[:, None] * sqt + heads[:, None] * sqh
                             + offs_k[None, :] * sqd,
                             mask=live[:, None] & (offs_k[None, :] < D), other=0.0)
                kt = tl.load(k_ptr + offs_n[:, None] * skn + offs_k[None, :] * skd,
                             mask=live_n[:, None] & (offs_k[None, :] < D), other=0.0)
                if PRODUCT == 1:  # 16-bit pairs on tensor cores
                    acc = tl.dot(kt, tl.trans(qk), acc)
                elif PRODUCT == 2:  # fp32 queries as hi + mid + lo in bf16 (exactly): three
                    hi, mid, lo = split_bf16(qk.to(tl.float32))  # tensor-core products
                    acc = tl.dot(kt, tl.trans(hi), acc)
                    acc = tl.dot(kt, tl.trans(mid), acc)
                    acc = tl.dot(kt, tl.trans(lo), acc)
                else:
                    acc = tl.dot(kt.to(tl.float32), tl.trans(qk.to(tl.float32)), acc,
                                 input_precision="ieee")
            # (w·w_scale rounded to fp32 on its own: torch's w * w_scale)
            wh = tl.load(w_ptr + tq * swt + heads * swh, mask=live, other=0.0) * w_scale
            part = tl.maximum(acc, 0.0) * wh[None, :]
            # a query's heads are its BLOCK_H columns: summed apart from the other queries'
            total += tl.sum(tl.reshape(part, (BLOCK_N, BLOCK_T, BLOCK_H)), axis=2)
        total = tl.trans(total)  # [BLOCK_T, BLOCK_N]: each query's scores a row
        slot = tl.arange(0, BLOCK_T)
        ts = t0 + (0 * slot if GATHER else slot)
        visible = tl.load(vis_ptr + ts, mask=ts < T, other=0)  # entries the query may see
        seen = live_n[None, :] & (offs_n[None, :] < visible[:, None])
        total = tl.where(seen, total, float("-inf"))
        stored = (ts[:, None] < T) & (cols[None, :] < (M if GATHER else N))
        if GATHER:
            stored = stored & (slot[:, None] == 0)
        tl.store(o_ptr + ts[:, None] * sot + cols[None, :], total, mask=stored)


def index_scores(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor,
                 visible: torch.Tensor, w_scale: float = 1.0,
                 entries: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D], keys [n, D] (any strides), w [T, H] fp32 (each times w_scale, in
    fp32, as torch's w * w_scale), visible [T] (how many entries each query sees) → scores
    [T, n] fp32, −inf at the entries a query does not see. With `entries` [T, m] (each query's
    own entry ids, −1 none): scores [T, m] of those entries only, each with the bits it has
    among all n (−inf for −1 and unseen ones) — a reindex layer scores its candidates alone."""
    T, H, D = q.shape
    n = keys.shape[0]
    if keys.shape[1] != D or tuple(w.shape) != (T, H) or tuple(visible.shape) != (T,):
        raise ValueError(f"index_scores: q {list(q.shape)}, keys {list(keys.shape)}, "
                         f"w {list(w.shape)} and visible {list(visible.shape)} do not match")
    if entries is not None and (entries.dim() != 2 or entries.shape[0] != T):
        raise ValueError(f"index_scores: entries {list(entries.shape)} for {T} queries")
    m = n if entries is None else entries.shape[1]
    out = torch.empty((T, m), dtype=torch.float32, device=q.device)
    if T == 0 or m == 0:
        return out
    if entries is not None and n == 0:
        return out.fill_(float("-inf"))
    # (as in kernels/rowwise: the interpreter multiplies 16-bit tiles as integers, so on CPU
    # the operands are widened to fp32 — exact, the same products and accumulation)
    # fp32 queries against bf16 keys (the reference numerics' cache) take the split product:
    # Triton's IEEE fp32 dot runs on the FMA units, ~100× slower at these shapes.
    if not q.is_cuda:
        product = 0
    elif q.dtype == keys.dtype and q.dtype in (torch.bfloat16, torch.float16):
        product = 1
    elif q.dtype == torch.float32 and keys.dtype == torch.bfloat16:
        product = 2
    else:
        product = 0
    wf = w.float()
    e = out if entries is None else _contig(entries)
    rows = T if entries is not None else triton.cdiv(T, BLOCK_T)
    _index_scores_kernel[(rows, triton.cdiv(m, BLOCK_N))](
        q, keys, wf, _contig(visible), e, out, float(w_scale), T, H, n, m, D,
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1),
        wf.stride(0), wf.stride(1), e.stride(0), out.stride(0),
        BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PRODUCT=product,
        GATHER=entries is not None, num_warps=NUM_WARPS)
    return out
