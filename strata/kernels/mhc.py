"""mHC in a few launches on CUDA (spec §2.3; the torch definitions are strata.model.mhc).

Per sublayer the torch code issues ~170 small kernels — Sinkhorn alone is ~6 per iteration ×
20 — which over 80 sublayers is ~13,600 launches a token, more time than the weights take to
stream. Here:
- `hc_mix`: the mixing matmul m = x·fnᵀ and the sum of squares of x = flatten(h) (4·D =
  20,480 long) in one pass over h in its stored dtype: per block of rows and chunk of K, the
  chunk's partial products (tl.dot: a bf16 stream against fn split exactly into three bf16,
  on tensor cores; else IEEE fp32) and Σx², then the chunks added in order; a prefill's rows
  share each load of the 24-row weight. `hc_mixed_coeffs` (the model's path)
  lets the coefficients kernel add the chunks (all of a row's partials loaded as one tile,
  summed in a fixed tree) and divide by 4·D: mix and coefficients in two launches, where the
  row products, the cast, the square, their chunk sums, the mean and the coefficients were
  eight;
- `hc_coeffs`: (pre, post, comb) from the mixing matmul's output m and the stream's mean square,
  one program per row: scale/base, sigmoids, the row softmax and every Sinkhorn iteration in
  registers (one launch);
- `collapse`: Σ_i pre[i]·h[i] (one launch);
- `hc_update`: post[j]·y + Σ_i comb[i, j]·h[i] (one launch).

Numerics. `collapse` and `hc_update` do the torch code's operations in its order (fp32 product,
then sum in copy order, each rounded, no fused multiply-add; one cast at the end), so they give
the torch CUDA path's bits. `hc_coeffs` keeps the reference's operation order too, but its
exp, sigmoid, rsqrt and the 4-element sums are Triton's, so its coefficients may differ from
torch's in the last bits; it is deterministic and every row is computed alone (batch-invariant,
tested under the interpreter against the torch definitions).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: strata.model.mhc's torch code is used
    triton = None

COEFF_WARPS = 4  # hc_coeffs: one row a program, its chunk partials spread over the warps
# hidden columns per program in collapse / hc_update (session 47, hc_update at a 4,096-row
# chunk: a program per copy, H100, 512 the fastest of 512–4,096; all copies a program, H200,
# 1,024 0.152 ms against 0.192 — not taken without a model A/B)
BLOCK_D = 512
# hc_mix rows per program: 16 since its products run on tensor cores (session 16 probe,
# hc_mixed_coeffs by graph replay: 12.1 µs a decode row against 16.0 at 32, 254 µs a
# 4,096-row chunk against 335; with fp32 FMAs, session 9, 32 had halved the chunk's time).
# A decode row's call is a chain of K steps per program, so shorter chunks mean more
# programs and a shorter chain: in graphed decode steps 13 µs a call at chunks of 256
# (session 9), 24 µs at 512 (session 10); the coefficients kernel loads a row's 80 partials
# as one tile (one memory latency; in order, chunk by chunk, a block of 16 rows took ~7.6
# µs a decode call: session 20). The partition is K's alone, so rows never depend on the
# batch. A call of more than MIX_ROWS rows (a prefill chunk) on tensor cores (mix_split) takes
# MIX_ROWS_WIDE, each program reading fn's chunk once for 4× the rows (session 47, H100, 4,096
# rows: 0.150 ms against 0.342 at 16; 32 rows 0.397, 128 rows 0.153) — every row the same bits
# at 16, 32, 64 and 128 rows a program there. The IEEE fp32 products (an fp32 stream) keep
# MIX_ROWS: wider tiles were not measured for them.
MIX_ROWS = 16
MIX_ROWS_WIDE = 64
MIX_K = 64     # K per tl.dot step
MIX_CHUNK = 256  # K per program; the chunks' partials are summed in order


def available(t: torch.Tensor) -> bool:
    """Whether these kernels serve tensors like t (CUDA, Triton installed)."""
    return triton is not None and t.is_cuda


if triton is not None:
    from strata.kernels import pdl
    from strata.kernels.pdl import wait_then_release
    from strata.kernels.rowwise import split_bf16

    @triton.jit
    def _round_out(acc, DT: tl.constexpr):
        """fp32 → DT rounded to nearest even, as torch's cast (bf16 spelled out in integer
        arithmetic: Triton's interpreter truncates that cast; finite values and ±inf)."""
        if DT == tl.bfloat16:
            b = acc.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
            return b.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return acc.to(DT)

    @triton.jit
    def _hc_coeffs_kernel(m_ptr, ms_ptr, s_ptr, b_ptr, pre_ptr, post_ptr, comb_ptr,
                          sm_row, s_ms, s_chunk, ms_count, norm_eps, hc_eps,
                          H: tl.constexpr, HP: tl.constexpr, ITERS: tl.constexpr,
                          CHUNKS: tl.constexpr, CP: tl.constexpr, PDL: tl.constexpr):
        wait_then_release(PDL)
        # One row. m and ms are the sums of CHUNKS partials s_chunk elements apart (hc_mix's K
        # chunks; one for a plain m): every partial of the row is loaded as one tile — one
        # memory latency, where a block of 16 rows read its partials chunk by chunk — and
        # summed over the chunks (a fixed tree: the row's bits depend on K alone).
        r = tl.program_id(0).to(tl.int64)
        ch = tl.arange(0, CP)
        chm = ch < CHUNKS
        i = tl.arange(0, HP)
        imask = i < H
        a = i[:, None]
        c = i[None, :]
        cmask = (a < H) & (c < H)
        off = 2 * H + a * H + c  # comb logits [a, c] = m[2H + a·H + c]
        mrow = m_ptr + r * sm_row + ch.to(tl.int64) * s_chunk  # [CP] the chunks' rows
        ms = tl.sum(tl.load(ms_ptr + r * s_ms + ch.to(tl.int64) * s_chunk, mask=chm,
                            other=0.0), axis=0)
        vmask = chm[:, None] & imask[None, :]
        m_pre = tl.sum(tl.load(mrow[:, None] + i[None, :], mask=vmask, other=0.0), axis=0)
        m_post = tl.sum(tl.load(mrow[:, None] + H + i[None, :], mask=vmask, other=0.0), axis=0)
        lg = tl.sum(tl.load(mrow[:, None, None] + off[None, :, :],
                            mask=chm[:, None, None] & cmask[None, :, :], other=0.0), axis=0)
        ms = tl.math.div_rn(ms, ms_count)                                    # (÷1: exact)
        inv = tl.rsqrt(ms + norm_eps)
        s0 = tl.load(s_ptr)
        s1 = tl.load(s_ptr + 1)
        s2 = tl.load(s_ptr + 2)
        pre = tl.sigmoid((m_pre * inv) * s0 + tl.load(b_ptr + i, mask=imask, other=0.0)) + hc_eps
        post = 2 * tl.sigmoid((m_post * inv) * s1
                              + tl.load(b_ptr + H + i, mask=imask, other=0.0))
        # comb: row softmax over c, then Sinkhorn
        lg = (lg * inv) * s2 + tl.load(b_ptr + off, mask=cmask, other=0.0)
        lg = tl.where(cmask, lg, -3.0e38)  # padding (H < HP): exp → 0, and no inf − inf
        e = tl.exp(lg - tl.max(lg, axis=1)[:, None])
        e = tl.where(cmask, e, 0.0)
        den = tl.sum(e, axis=1)[:, None]  # ≥ 1 on real rows; 0 on padding rows
        cb = tl.where(cmask, e / tl.where(den > 0, den, 1.0) + hc_eps, 0.0)
        cb = cb / (tl.sum(cb, axis=0)[None, :] + hc_eps)
        for _ in range(ITERS - 1):
            cb = cb / (tl.sum(cb, axis=1)[:, None] + hc_eps)
            cb = cb / (tl.sum(cb, axis=0)[None, :] + hc_eps)
        tl.store(pre_ptr + r * H + i, pre, mask=imask)
        tl.store(post_ptr + r * H + i, post, mask=imask)
        tl.store(comb_ptr + r * (H * H) + a * H + c, cb, mask=cmask)

    @triton.jit
    def _hc_mix_kernel(x_ptr, fn_ptr, part_ptr, T, N, K, sx_row, sf_row, sp_chunk, sp_row,
                       BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       CHUNK: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):
        wait_then_release(PDL)
        # Rows [BT] × the chunk's K: partial m (columns 0..N-1) and Σx² (column N). Each
        # output is its own fixed chain over k whatever rows share the program. SPLIT (bf16
        # rows): fn's fp32 tile as hi + mid + lo in bf16 (exactly), three tensor-core
        # products each exact in fp32; else IEEE fp32 FMAs.
        rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        chunk = tl.program_id(1)
        cols = tl.arange(0, BN)
        rmask = rows < T
        acc = tl.zeros([BT, BN], dtype=tl.float32)
        sq = tl.zeros([BT], dtype=tl.float32)
        # (unrolled: the steps' loads issue ahead of the dot chain; a step past K is all
        # masked and adds exact zeros)
        for step in tl.static_range(CHUNK // BK):
            ks = chunk * CHUNK + step * BK + tl.arange(0, BK)
            kmask = ks < K
            xs = tl.load(x_ptr + rows[:, None] * sx_row + ks[None, :],
                         mask=rmask[:, None] & kmask[None, :], other=0.0)
            f = tl.load(fn_ptr + cols[:, None] * sf_row + ks[None, :],
                        mask=(cols[:, None] < N) & kmask[None, :], other=0.0).to(tl.float32)
            x = xs.to(tl.float32)
            if SPLIT:
                hi, mid, lo = split_bf16(f)
                acc = tl.dot(xs, tl.trans(hi), acc)
                acc = tl.dot(xs, tl.trans(mid), acc)
                acc = tl.dot(xs, tl.trans(lo), acc)
            else:
                acc = tl.dot(x, tl.trans(f), acc, input_precision="ieee")
            sq += tl.sum(x * x, axis=1)
        out = part_ptr + chunk.to(tl.int64) * sp_chunk + rows * sp_row
        tl.store(out[:, None] + cols[None, :], acc, mask=rmask[:, None] & (cols[None, :] < N))
        tl.store(out + N, sq, mask=rmask)

    @triton.jit
    def _collapse_kernel(h_ptr, pre_ptr, out_ptr, D, sh_row, sh_copy, so_row,
                         H: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr):
        wait_then_release(PDL)
        t = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BD + tl.arange(0, BD)
        dmask = d < D
        hrow = h_ptr + t * sh_row
        acc = tl.load(pre_ptr + t * H) * tl.load(hrow + d, mask=dmask, other=0.0).to(tl.float32)
        for i in tl.static_range(1, H):
            acc = acc + tl.load(pre_ptr + t * H + i) * tl.load(
                hrow + i * sh_copy + d, mask=dmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * so_row + d, _round_out(acc, out_ptr.dtype.element_ty),
                 mask=dmask)

    @triton.jit
    def _hc_update_kernel(y_ptr, r_ptr, post_ptr, comb_ptr, out_ptr, D, sy_row, sr_row,
                          sr_copy, so_row, so_copy, H: tl.constexpr, HP: tl.constexpr,
                          BD: tl.constexpr, PDL: tl.constexpr):
        # All H output copies of a row's block from one read of each residual copy (a
        # program per output copy read every residual copy H times: 1.3 TB/s at a prefill
        # chunk, session 47). Output j's chain is as it was: comb[0, j]·r0, + comb[i, j]·ri
        # in copy order, + post[j]·y, rounded once.
        wait_then_release(PDL)
        t = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BD + tl.arange(0, BD)
        dmask = d < D
        j = tl.arange(0, HP)  # the output copies, a row of acc each
        jmask = j < H
        rrow = r_ptr + t * sr_row
        cb = comb_ptr + t * (H * H) + j  # comb[t, i, j] at i·H + j
        acc = (tl.load(cb, mask=jmask, other=0.0)[:, None]
               * tl.load(rrow + d, mask=dmask, other=0.0).to(tl.float32)[None, :])
        for i in tl.static_range(1, H):
            acc = acc + (tl.load(cb + i * H, mask=jmask, other=0.0)[:, None]
                         * tl.load(rrow + i * sr_copy + d, mask=dmask,
                                   other=0.0).to(tl.float32)[None, :])
        yv = tl.load(y_ptr + t * sy_row + d, mask=dmask, other=0.0).to(tl.float32)
        acc = acc + tl.load(post_ptr + t * H + j, mask=jmask, other=0.0)[:, None] * yv[None, :]
        tl.store(out_ptr + t * so_row + j[:, None] * so_copy + d[None, :],
                 _round_out(acc, out_ptr.dtype.element_ty), mask=jmask[:, None] & dmask[None, :])


def _contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def hc_coeffs(m: torch.Tensor, ms: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
              H: int, norm_eps: float, hc_eps: float, iters: int,
              ms_count: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """m [T, (2+H)·H] fp32 (the mixing matmul, before the RMS factor), ms [T] or [T, 1] fp32
    (the stream's mean square — or, with ms_count, its sum of squares over that many values,
    divided here as torch divides) → (pre [T, H], post [T, H], comb [T, H, H]) fp32."""
    T = m.shape[0]
    if m.shape[1] != (2 + H) * H:
        raise ValueError(f"hc_coeffs: m has {m.shape[1]} columns, expected {(2 + H) * H}")
    m = m.float()
    if m.stride(1) != 1:  # (rows may be strided: hc_mix's m is a view)
        m = m.contiguous()
    ms = ms.float().reshape(T)  # (may be strided: hc_mix's sums are a column)
    pre = torch.empty((T, H), dtype=torch.float32, device=m.device)
    post = torch.empty_like(pre)
    comb = torch.empty((T, H, H), dtype=torch.float32, device=m.device)
    if T:
        _hc_coeffs_kernel[(T,)](
            m, ms, _contig(scale.float()), _contig(base.float()), pre, post, comb,
            m.stride(0), ms.stride(0), 0, float(ms_count), float(norm_eps), float(hc_eps),
            H=H, HP=triton.next_power_of_2(H), ITERS=iters, CHUNKS=1, CP=1,
            num_warps=COEFF_WARPS, enable_fp_fusion=False, **pdl.args(m.device))
    return pre, post, comb


def mix_split(h: torch.Tensor) -> bool:
    """Whether hc_mix runs a bf16 stream's products on tensor cores (fn split exactly into three
    bf16). The stream's dtype decides, never the batch. (The interpreter multiplies 16-bit
    tiles as the integers it stores them as: CPU runs take the fp32 FMAs.)"""
    return h.is_cuda and h.dtype == torch.bfloat16


def _mix_partials(h: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """hc_mix's per-chunk partials [chunks, T, N + 1] fp32: flatten(h)·fnᵀ over each chunk of
    MIX_CHUNK values of K in columns 0..N−1, that chunk's Σx² in column N."""
    T = h.shape[0]
    x = h.reshape(T, -1)
    if x.stride(1) != 1:
        x = x.contiguous()
    K, N = x.shape[1], fn.shape[0]
    if fn.shape[1] != K:
        raise ValueError(f"hc_mix: fn {list(fn.shape)} does not match the stream's {K} values")
    fn = _contig(fn)
    chunks = triton.cdiv(K, MIX_CHUNK)
    part = torch.empty((chunks, T, N + 1), dtype=torch.float32, device=h.device)
    if T:
        split = mix_split(h)
        rows = MIX_ROWS_WIDE if split and T > MIX_ROWS else MIX_ROWS
        _hc_mix_kernel[(triton.cdiv(T, rows), chunks)](
            x, fn, part, T, N, K, x.stride(0), fn.stride(0), part.stride(0), part.stride(1),
            BT=rows, BN=max(16, triton.next_power_of_2(N)), BK=MIX_K, CHUNK=MIX_CHUNK,
            SPLIT=split, num_warps=4, **pdl.args(h.device))
    return part


def hc_mix(h: torch.Tensor, fn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, H, D] (any float dtype), fn [N, H·D] → (m = flatten(h)·fnᵀ [T, N] fp32, the sum
    of squares of flatten(h) [T] fp32 — hc_coeffs divides it by H·D), each row computed alone
    in a fixed order: the chunks' partials added in chunk order."""
    from strata.kernels.rowwise import _chunk_sum_kernel
    part = _mix_partials(h, fn)
    chunks, T, N1 = part.shape
    total = torch.empty((T, N1), dtype=torch.float32, device=h.device)
    n = T * N1
    if n:
        _chunk_sum_kernel[(triton.cdiv(n, 1024),)](part, total, n, chunks, BLOCK=1024,
                                                   **pdl.args(h.device))
    return total[:, :N1 - 1], total[:, N1 - 1]


def hc_mixed_coeffs(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                    H: int, norm_eps: float, hc_eps: float,
                    iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hc_coeffs(*hc_mix(h, fn), ..., ms_count=H·D) in two launches, not three: the
    coefficients kernel adds hc_mix's chunk partials itself (a decode step: 40 launches fewer
    on 20 layers) — as one tile, over the chunks in a tree, where hc_mix adds them in chunk
    order: the same m and Σx² to fp32 rounding, each row's bits fixed by K alone."""
    part = _mix_partials(h, fn)
    chunks, T, N1 = part.shape
    if N1 - 1 != (2 + H) * H:
        raise ValueError(f"hc_coeffs: m has {N1 - 1} columns, expected {(2 + H) * H}")
    pre = torch.empty((T, H), dtype=torch.float32, device=h.device)
    post = torch.empty_like(pre)
    comb = torch.empty((T, H, H), dtype=torch.float32, device=h.device)
    if T:
        _hc_coeffs_kernel[(T,)](
            part, part[0, :, N1 - 1], _contig(scale.float()), _contig(base.float()), pre, post,
            comb, part.stride(1), part.stride(1), part.stride(0),
            float(H * h.shape[2]), float(norm_eps), float(hc_eps), H=H,
            HP=triton.next_power_of_2(H), ITERS=iters, CHUNKS=chunks,
            CP=triton.next_power_of_2(chunks), num_warps=COEFF_WARPS, enable_fp_fusion=False,
            **pdl.args(h.device))
    return pre, post, comb


def collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Σ_i pre[i]·h[i]: h [T, H, D], pre [T, H] fp32 → [T, D] in h's dtype."""
    T, H, D = h.shape
    if h.stride(2) != 1:
        h = h.contiguous()
    out = torch.empty((T, D), dtype=h.dtype, device=h.device)
    if T:
        _collapse_kernel[(T, triton.cdiv(D, BLOCK_D))](
            h, _contig(pre.float()), out, D, h.stride(0), h.stride(1), out.stride(0),
            H=H, BD=BLOCK_D, num_warps=4, enable_fp_fusion=False, **pdl.args(h.device))
    return out


def hc_update(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
              comb: torch.Tensor) -> torch.Tensor:
    """post[j]·y + Σ_i comb[i, j]·residual[i]: y [T, D], residual [T, H, D] → [T, H, D] in
    residual's dtype."""
    T, H, D = residual.shape
    if residual.stride(2) != 1:
        residual = residual.contiguous()
    y = _contig(y)
    out = torch.empty((T, H, D), dtype=residual.dtype, device=residual.device)
    if T:
        HP = triton.next_power_of_2(H)
        # A program writes all H copies: for a decode step's or window's few rows, BLOCK_D / H
        # columns keep a program's outputs and the programs' count as they were with a
        # program per copy (BLOCK_D there measured 1.2 % slower decoding, session 47)
        bd = BLOCK_D if T > MIX_ROWS else max(16, BLOCK_D // HP)
        _hc_update_kernel[(T, triton.cdiv(D, bd))](
            y, residual, _contig(post.float()), _contig(comb.float()), out, D, y.stride(0),
            residual.stride(0), residual.stride(1), out.stride(0), out.stride(1),
            H=H, HP=HP, BD=bd, num_warps=4, enable_fp_fusion=False,
            **pdl.args(y.device))
    return out
