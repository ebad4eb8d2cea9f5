"""Batch-invariant batched products: out[b, m, :] = x[b, m, :] · w[b]ᵀ.

cuBLAS picks its kernel (tiling, split-K) from the whole problem's shape, so the same row can
round differently in a decode step, a verify window and a prefill chunk. This kernel computes
every output row with the same fixed-order reduction over K (blocks of BLOCK_K, fp32
accumulation) whatever B or the grid — and, for M ≥ 2, whatever M (`tile_shape`) — which
makes forwards bit-identical across batch shapes on the GPU.

One kernel, two ways of summing a slice, chosen by the call site's structural M (never by
the batch):
- M = 1 (row products: linears, row sums, the MoE's per-slot products): one row per program,
  products summed along BLOCK_K on the CUDA cores — a decode step reads each weight once and
  wastes no lanes.
- M ≥ 2 (attention: a query's heads against its rows; the indexer's torch path): tiles of
  rows through tl.dot with one fixed tile, warp count and precision per operand type (fp32
  operands as IEEE fp32 FMAs, bf16/fp16 pairs on tensor cores with fp32 accumulation). A row's
  bits depend only on its own operands — an output element is the same chain of MMA steps
  over k whichever rows share its tile — so a head split (tensor parallelism) or another batch
  changes none. A long prefill's [query, heads, rows] products are a large part of its time
  (bench/results/performance.md): one tile holding all of a query's heads reads its rows once.

`rowwise_bmm_reference` is the torch definition it is tested against (under TRITON_INTERPRET=1
on CPU).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path is used
    triton = None


def rowwise_bmm_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [B, M, K], w [B or 1, N, K] → [B, M, N] (in x's dtype)."""
    return torch.bmm(x, w.expand(x.shape[0], -1, -1).transpose(1, 2))


if triton is not None:
    from strata.kernels import pdl
    from strata.kernels.pdl import wait_then_release

    @triton.jit
    def _rowwise_kernel(x_ptr, w_ptr, o_ptr, M, N, K, m_blocks, k_chunk,
                        sxb, sxm, sxk, swb, swn, swk, soc, sob, som, son,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
        # A tile of BLOCK_M rows × BLOCK_N outputs of one batch element over one K chunk: the
        # w tile is read once for BLOCK_M rows. Every output is the same fixed-order sum over
        # its chunk whatever the tile holds, BLOCK_K slices added in order; a slice's products
        # summed along k on the CUDA cores (the M = 1 kernel) or through one tl.dot (DOT, the
        # M ≥ 2 kernel: NATIVE when both operands are one 16-bit float type — exact products
        # on tensor cores — else fp32 FMAs).
        wait_then_release(PDL)
        pid = tl.program_id(0)  # b · m_blocks + m_block
        b = (pid // m_blocks).to(tl.int64)  # (offsets past 2³¹ elements: long prefills)
        offs_m = (pid % m_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        chunk = tl.program_id(2)
        k_start = chunk * k_chunk
        k_end = tl.minimum(k_start + k_chunk, K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + b * sxb + offs_m[:, None] * sxm + offs_k[None, :] * sxk,
                         mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_end), other=0.0)
            wt = tl.load(w_ptr + b * swb + offs_n[:, None] * swn + offs_k[None, :] * swk,
                         mask=(offs_n[:, None] < N) & (offs_k[None, :] < k_end), other=0.0)
            if DOT:
                if NATIVE:
                    acc = tl.dot(xk, tl.trans(wt), acc)
                else:
                    acc = tl.dot(xk.to(tl.float32), tl.trans(wt.to(tl.float32)), acc,
                                 input_precision="ieee")
            else:
                acc += tl.sum(xk.to(tl.float32)[:, None, :] * wt.to(tl.float32)[None, :, :],
                              axis=2)
        o = o_ptr + chunk.to(tl.int64) * soc + b * sob
        tl.store(o + offs_m[:, None] * som + offs_n[None, :] * son,
                 acc.to(o_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))

    @triton.jit
    def _chunk_sum_kernel(p_ptr, o_ptr, n, chunks, BLOCK: tl.constexpr, PDL: tl.constexpr):
        # The chunks' partial sums added in chunk order, element by element. Four chunks'
        # loads are issued before their adds (the same adds in the same order): at decode a
        # call is one program whose time is the loads' latency, chunk after chunk.
        wait_then_release(PDL)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = offs < n
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        p = p_ptr + offs
        for _ in range(0, chunks // 4):
            a = tl.load(p, mask=live, other=0.0)
            b = tl.load(p + n, mask=live, other=0.0)
            c = tl.load(p + 2 * n, mask=live, other=0.0)
            d = tl.load(p + 3 * n, mask=live, other=0.0)
            acc += a
            acc += b
            acc += c
            acc += d
            p += 4 * n  # (a pointer step: no int32 chunk × n product)
        for _ in range(0, chunks % 4):
            acc += tl.load(p, mask=live, other=0.0)
            p += n
        tl.store(o_ptr + offs, acc.to(o_ptr.dtype.element_ty), mask=live)


TILE_WARPS = 4  # fixed: part of how tl.dot lowers (and the M = 1 kernel's default)
# Long reductions (Engram's row sums, 4·D-long rows) split K into chunks of this many,
# computed in parallel and added in chunk order: the partition depends on K alone, so a row's
# bits still do not depend on the batch. One chunk up to K_CHUNK (attention).
K_CHUNK = 1024


def tile_shape(M: int, native: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for a call with M rows per batch element; `native`: 16-bit
    operand pairs on tensor cores. A call site's M is structural (1 for row products, the heads
    of a layer for attention and the indexer) and every M ≥ 2 gets the same tile, so a row's
    bits never depend on the batch (decode, verify window, prefill chunk) nor on how tensor
    parallelism splits the heads. 16-bit pairs: 64 rows, V4.1's 64 attention heads in one
    tensor-core tile, which reads a query's gathered rows once; 128 columns (H200, session 9:
    a 4,096-query chunk's q·k 292 µs against 361 at 64, cuBLAS 322). fp32 FMAs (the attention's
    p·v): 32 rows, as a decode step's p·v has one query and 512 outputs to spread over the
    SMs (a 64-row tile would leave it 16 programs)."""
    if M == 1:
        return 1, 32, 64
    return (64, 128, 64) if native else (32, 32, 32)


def rowwise_bmm(x: torch.Tensor, w: torch.Tensor, k_chunk: int = K_CHUNK,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [B, M, K], w [B or 1, N, K] (any strides) → [B, M, N] in out_dtype (default x's),
    batch-invariant; fp32 accumulation whatever the operands' dtypes. (`k_chunk`: a multiple
    of 64; tests lower it to split small shapes.)"""
    if triton is None:
        raise RuntimeError("rowwise_bmm needs triton")
    B, M, K = x.shape
    Bw, N, Kw = w.shape
    if Kw != K or Bw not in (1, B):
        raise ValueError(f"rowwise_bmm: x {list(x.shape)} and w {list(w.shape)} do not match")
    out = torch.empty((B, M, N), dtype=out_dtype or x.dtype, device=x.device)
    if B * M == 0 or N == 0:
        return out
    swb = 0 if Bw == 1 else w.stride(0)
    # (the interpreter multiplies 16-bit tiles as the integers it stores them as: on CPU the
    # operands go to fp32 first — exact, the same products and fp32 accumulation)
    native = x.is_cuda and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16)
    bm, bn, bk = tile_shape(M, native)
    m_blocks = triton.cdiv(M, bm)
    chunks = triton.cdiv(K, k_chunk) if K > k_chunk else 1
    dest = out if chunks == 1 else torch.empty((chunks, B, M, N), dtype=torch.float32,
                                               device=x.device)
    args = (x, w, dest, M, N, K, m_blocks, k_chunk if chunks > 1 else K,
            x.stride(0), x.stride(1), x.stride(2), swb, w.stride(1), w.stride(2),
            dest.stride(0) if chunks > 1 else 0, *dest.stride()[-3:])
    grid = (B * m_blocks, triton.cdiv(N, bn), chunks)
    _rowwise_kernel[grid](*args, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT=M > 1,
                          NATIVE=native, num_warps=TILE_WARPS, **pdl.args(x.device))
    if chunks > 1:
        n = B * M * N
        _chunk_sum_kernel[(triton.cdiv(n, 1024),)](dest, out, n, chunks, BLOCK=1024,
                                                   **pdl.args(x.device))
    return out
