"""Batch-invariant batched products: out[b, m, :] = x[b, m, :] · w[b]ᵀ.

cuBLAS picks its kernel (tiling, split-K) from the whole problem's shape, so the same row can
round differently in a decode step, a verify window and a prefill chunk. This kernel computes
every output row with the same fixed-order reduction over K (blocks of BLOCK_K, fp32
accumulation) whatever B or the grid — and, for M ≥ 2, whatever M or the tile's width
(`tile_shape`) — which
makes forwards bit-identical across batch shapes on the GPU.

One kernel, two ways of summing a slice, chosen by the call site's structural M (never by
the batch):
- M = 1 (row products: linears, row sums, the MoE's per-slot products): one row per program,
  products summed along BLOCK_K on the CUDA cores — a decode step reads each weight once and
  wastes no lanes.
- M ≥ 2 (attention: a query's heads against its rows; the indexer's torch path): tiles of
  rows through tl.dot with one fixed tile, warp count and product per operand type (`Product`:
  bf16/fp16 pairs on tensor cores; fp32 rows against bf16 as three exact bf16 tensor-core
  products, split in the kernel; other fp32 operands as IEEE fp32 FMAs), all accumulated in
  fp32. (Attention's p·v is strata.kernels.attention's, with its softmax.)
  A row's bits depend only on its own operands — an output element is the same chain of MMA
  steps over k whichever rows share its tile — so a head split (tensor parallelism) or
  another batch changes none. A long prefill's [query, heads, rows] products are a large part
  of its time (bench/results/performance.md): one tile holding all of a query's heads reads
  its rows once.

`rowwise_bmm_reference` is the torch definition it is tested against (under TRITON_INTERPRET=1
on CPU).
"""
from __future__ import annotations

from dataclasses import dataclass

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
    def split_bf16(v):
        """An fp32 tile as hi + mid + lo in bf16, exactly (8 significant bits each: the three
        hold fp32's 24): each one's product with a bf16 value is exact in fp32, so three
        tensor-core products give fp32 operands' products (Product.SPLIT; the indexer's and
        mHC's kernels use it too)."""
        hi = v.to(tl.bfloat16)
        rest = v - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        return hi, mid, lo

    @triton.jit
    def _rowwise_kernel(x_ptr, w_ptr, o_ptr, tab_ptr, M, N, K, m_blocks, k_chunk,
                        sxb, sxm, sxk, swb, swn, swk, soc, sob, som, son, stab,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRODUCT: tl.constexpr, TABLE: tl.constexpr, PDL: tl.constexpr):
        # A tile of BLOCK_M rows × BLOCK_N outputs of one batch element over one K chunk: the
        # w tile is read once for BLOCK_M rows. Every output is the same fixed-order sum over
        # its chunk whatever the tile holds, BLOCK_K slices added in order; a slice's products
        # summed along k on the CUDA cores (ROW, the M = 1 kernel) or through tl.dot (the
        # M ≥ 2 kernel, PRODUCT as in `Product`). TABLE (attention's key rows where they lie
        # — no gathered copy, q·k): w[b, n, k] = w_ptr[tab[b, n] + k] (element offsets, stab
        # a batch element's) — the same values as the gathered rows, so the same products.
        wait_then_release(PDL)
        pid = tl.program_id(0)  # b · m_blocks + m_block
        b = (pid // m_blocks).to(tl.int64)  # (offsets past 2³¹ elements: long prefills)
        offs_m = (pid % m_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        chunk = tl.program_id(2)
        k_start = chunk * k_chunk
        k_end = tl.minimum(k_start + k_chunk, K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if TABLE:  # (row starts: multiples of 16 elements — RowTable's — so rows load in
            # 16-byte vectors)
            w_rows = w_ptr + tl.multiple_of(
                tl.load(tab_ptr + b * stab + offs_n, mask=offs_n < N, other=0), 16)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + b * sxb + offs_m[:, None] * sxm + offs_k[None, :] * sxk,
                         mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_end), other=0.0)
            w_mask = (offs_n[:, None] < N) & (offs_k[None, :] < k_end)
            if TABLE:
                wt = tl.load(w_rows[:, None] + offs_k[None, :], mask=w_mask, other=0.0)
            else:
                wt = tl.load(w_ptr + b * swb + offs_n[:, None] * swn + offs_k[None, :] * swk,
                             mask=w_mask, other=0.0)
            if PRODUCT == 0:  # ROW
                acc += tl.sum(xk.to(tl.float32)[:, None, :] * wt.to(tl.float32)[None, :, :],
                              axis=2)
            elif PRODUCT == 1:  # PAIR16
                acc = tl.dot(xk, tl.trans(wt), acc)
            elif PRODUCT == 2:  # SPLIT
                hi, mid, lo = split_bf16(xk)
                wtt = tl.trans(wt)
                acc = tl.dot(hi, wtt, acc)
                acc = tl.dot(mid, wtt, acc)
                acc = tl.dot(lo, wtt, acc)
            else:  # FMA
                acc = tl.dot(xk.to(tl.float32), tl.trans(wt.to(tl.float32)), acc,
                             input_precision="ieee")
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
# The M = 1 kernel's outputs per program (scripts/probe_row_widths.py times the widths and
# compares their bits: the DSpark draft's Markov pick, [1, 256] · [129,280, 256]ᵀ, ran at
# ~1.4 TB/s in this width — 47 µs, five times a draft; H200, session 23's profile).
ROW_BLOCK_N = 32
# Long reductions (Engram's row sums, 4·D-long rows) split K into chunks of this many,
# computed in parallel and added in chunk order: the partition depends on K alone, so a row's
# bits still do not depend on the batch. One chunk up to K_CHUNK (attention).
K_CHUNK = 1024


class Product:
    """How a slice's products are formed and summed (the kernel's PRODUCT). The operand dtypes
    and the call site's structural M choose it, never the batch."""
    ROW = 0     # M = 1: one row per program, products summed along k on the CUDA cores
    PAIR16 = 1  # one 16-bit float type on both sides: tensor cores, exact products
    SPLIT = 2   # fp32 rows against bf16 (fp32 queries, bf16 keys): x split exactly into
    #             hi + mid + lo bf16 — three tensor-core products, each exact in fp32 (~5×
    #             the FMA rate)
    FMA = 3     # any other pair: IEEE fp32 FMAs


def product(M: int, x: torch.Tensor, w: torch.Tensor) -> int:
    """The Product of a call. (The interpreter multiplies 16-bit tiles as the integers it
    stores them as: on CPU the tile path takes fp32 FMAs — exact widening, the same products
    and fp32 accumulation.)"""
    if M == 1:
        return Product.ROW
    if x.is_cuda and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16):
        return Product.PAIR16
    if x.is_cuda and x.dtype == torch.float32 and w.dtype == torch.bfloat16:
        return Product.SPLIT
    return Product.FMA


# row_matmul's 16-bit pairs (the router): a tile of 16 rows (the least tl.dot takes) so a
# decode step's single row wastes little, 32 columns so the router's 384 outputs × K chunks
# still spread over the SMs. H200, graphed, past L2 (session 15): 6.3 µs for one row, 167 for
# a 4,096-row chunk — one row per program on the fp32 weight took 24.2 µs and 12,085.
ROWS_TILE = (16, 32, 128)


# Batches of at most this many elements (a decode step's or a verify window's queries) take the
# tensor-core tiles' narrow width: more programs for a few queries' products.
SMALL_BATCH = 16


def tile_shape(M: int, prod: int = Product.FMA, B: int = SMALL_BATCH + 1) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for a call of B batch elements with M rows each and its
    Product. A call site's M is structural (1 for row products, the heads of a layer for
    attention and the indexer) and every M ≥ 2 gets one BLOCK_M and BLOCK_K per Product, so a
    row's bits never depend on the batch (decode, verify window, prefill chunk) nor on how
    tensor parallelism splits the heads; BLOCK_N, the tile's width, changes no output's chain
    of k-steps (tested on the GPU: the same bits at 16–128), so it follows the batch.
    16-bit pairs: 64 rows, V4.1's 64 attention heads in one tensor-core tile, which reads a
    query's gathered rows once; 128 columns for a prefill chunk (H200, session 9: a
    4,096-query chunk's q·k 292 µs against 361 at 64, cuBLAS 322). The split p·v: 64 × 64
    (H200, session 15: a 243-query piece 100 µs against the fp32 FMAs' 495 in their 32 × 32
    tile). At most SMALL_BATCH queries: 16 columns for both (H200, session 20: one decode
    query's q·k 3.0 µs at 32 columns against 4.8 at 128, its p·v 8.4 against 9.4 at 64;
    H100, session 59, a graphed step's kernels: q·k and the router's rows 3.15 µs a launch
    at 16 against 3.36 at 32 — the two kernels' mean). fp32 FMAs: 32 × 32."""
    if M == 1:
        return 1, ROW_BLOCK_N, 64
    if prod in (Product.PAIR16, Product.SPLIT) and B <= SMALL_BATCH:
        return 64, 16, 64
    return {Product.PAIR16: (64, 128, 64), Product.SPLIT: (64, 64, 64)}.get(prod, (32, 32, 32))


def rowwise_rows(x: torch.Tensor, w: torch.Tensor,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [T, K] · w [N, K]ᵀ → [T, N], each row independent of the others (row_matmul on
    CUDA). A 16-bit pair's rows share tensor-core tiles of ROWS_TILE whatever T — a decode
    step's one row runs the same tile, so it has a prefill's bits — and a prefill reads w once
    per 16 rows instead of once per row; any other pair runs one row per program (ROW)."""
    if product(2, x, w) == Product.PAIR16:
        return rowwise_bmm(x.unsqueeze(0), w.unsqueeze(0), out_dtype=out_dtype,
                           tile=ROWS_TILE).squeeze(0)
    return rowwise_bmm(x.unsqueeze(1), w.unsqueeze(0), out_dtype=out_dtype).squeeze(1)


def rowwise_bmm(x: torch.Tensor, w: "torch.Tensor | RowTable", k_chunk: int = K_CHUNK,
                out_dtype: torch.dtype | None = None,
                tile: tuple[int, int, int] | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, M, K], w [B or 1, N, K] (any strides, or a RowTable) → [B, M, N] in out_dtype
    (default x's), batch-invariant; fp32 accumulation whatever the operands' dtypes.
    (`k_chunk`: a multiple of 64; tests lower it to split small shapes. `tile`: a call site's
    own fixed tile for the tl.dot path, whatever M — rowwise_rows. `out`: a contiguous
    [B, M, N] of out_dtype to write into.)"""
    if triton is None:
        raise RuntimeError("rowwise_bmm needs triton")
    B, M, _ = x.shape
    prod = product(2 if tile else M, x, w)  # (a call site's tile: the tl.dot path at any M)
    return _bmm(x, w, prod, tile or tile_shape(M, prod, B), k_chunk, out_dtype or x.dtype,
                out=out)


@dataclass(frozen=True)
class RowTable:
    """A batch's rows of `width` elements where they lie, as the w of rowwise_bmm (q·k) and
    the rows of strata.kernels.attention.sink_softmax_pv (p·v): batch element b's i-th row
    starts `offsets[b, i]` elements from `base`'s first (int64, any sign, a multiple of 16:
    rows of several tensors of base's dtype, each row contiguous) — attention's key rows
    without their gathered copy, [B, n, width]."""
    base: torch.Tensor
    offsets: torch.Tensor  # [B, n] int64
    width: int

    @property
    def shape(self) -> tuple[int, int, int]:
        B, n = self.offsets.shape
        return (B, n, self.width)

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

    @property
    def is_cuda(self) -> bool:
        return self.base.is_cuda

    def rows(self, i: int, j: int) -> "RowTable":
        """Batch elements i … j − 1 (a piece of a forward's queries). (Constructed directly,
        not by dataclasses.replace: a prefill chunk's attention pieces make one each, and
        the host's time a piece is what keeps the GPU fed.)"""
        return RowTable(self.base, self.offsets[i:j], self.width)


def sum_chunks(partial: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = partial[0] + partial[1] + … in chunk order, element by element (a split K's
    partial products; partial [chunks, *out.shape] fp32, out contiguous)."""
    n = out.numel()
    _chunk_sum_kernel[(triton.cdiv(n, 1024),)](partial, out, n, partial.shape[0], BLOCK=1024,
                                               **pdl.args(out.device))
    return out


def _bmm(x: torch.Tensor, w: "torch.Tensor | RowTable", prod: int,
         tile: tuple[int, int, int], k_chunk: int, out_dtype: torch.dtype,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """One _rowwise_kernel launch (and the chunks' sum where K is split), into `out` if given."""
    B, M, K = x.shape
    Bw, N, Kw = w.shape
    if Kw != K or Bw not in (1, B):
        raise ValueError(f"rowwise_bmm: x {list(x.shape)} and w {list(w.shape)} do not match")
    if out is None:
        out = torch.empty((B, M, N), dtype=out_dtype, device=x.device)
    elif out.shape != (B, M, N) or out.dtype != out_dtype or not out.is_contiguous() \
            or out.device != x.device:
        raise ValueError(f"rowwise_bmm: out must be a contiguous {out_dtype} {[B, M, N]} on "
                         f"{x.device}, got {out.dtype} {list(out.shape)} on {out.device}")
    if B * M == 0 or N == 0:
        return out
    table = isinstance(w, RowTable)
    if table:  # (the rows' strides are the table's)
        tab, w = w.offsets, w.base
        swb = swn = swk = 0
    else:
        tab = w
        swb, swn, swk = (0 if Bw == 1 else w.stride(0)), w.stride(1), w.stride(2)
    bm, bn, bk = tile
    m_blocks = triton.cdiv(M, bm)
    chunks = triton.cdiv(K, k_chunk) if K > k_chunk else 1
    dest = out if chunks == 1 else torch.empty((chunks, B, M, N), dtype=torch.float32,
                                               device=x.device)
    args = (x, w, dest, tab, M, N, K, m_blocks, k_chunk if chunks > 1 else K,
            x.stride(0), x.stride(1), x.stride(2), swb, swn, swk,
            dest.stride(0) if chunks > 1 else 0, *dest.stride()[-3:],
            tab.stride(0) if table else 0)
    grid = (B * m_blocks, triton.cdiv(N, bn), chunks)
    _rowwise_kernel[grid](*args, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRODUCT=prod,
                          TABLE=table, num_warps=TILE_WARPS, **pdl.args(x.device))
    return out if chunks == 1 else sum_chunks(dest, out)
