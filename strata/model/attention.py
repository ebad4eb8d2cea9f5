"""Attention of one layer: single-latent MQA over the sliding window and the shared
compressed KV, one softmax with a per-head sink (spec §2.4).

For T new tokens at positions p..p+T-1 the keys are the window ring's rows from earlier
forwards plus this forward's rows, masked by absolute position (a query at q sees positions
q-W+1..q), and, on ratio>0 layers, the compressed entries its index source selected. The same
code serves decode (T=1), verify (T=k) and prefill chunks.
"""
from __future__ import annotations

import torch

from strata.checkpoint.weights import WeightReader
from strata.config import ModelConfig
from strata.model.compressor import Compressor
from strata.model.context import ForwardContext
from strata.model.indexer import Indexer
from strata.model.numerics import rms_norm, rows_bmm
from strata.model.rope import InverseRope, apply_rope, rms_norm_rope
from strata.quant.groups import LinearGroups, LinearSet
from strata.quant.qdq import fp4_qdq_e4m3_scale, fp8_act_qdq
from strata.runtime.state import PositionRing, State

# A forward's queries attend in pieces whose scratch (scratch_per_query) stays under this many
# bytes: small enough that a piece's scores stay in the GPU's L2 cache (50 MB on an H100)
# between the launch that writes them and the one that reads them, large enough that the
# host's launches keep ahead of the GPU. V4.1 at a prefill chunk: 192 queries a piece. (With
# the probabilities stored too, 80 a piece: against pieces of 242 queries the 10-layer 32K
# prefill ran +1.2 % with 80, −1.2 % with 320, −3.1 % with 2,576 and −36 % with 32, where the
# host's launches fell behind — H100; bench/results/performance.md, session 53.)
ATTN_SCRATCH = 32 << 20


class Attention:
    def __init__(self, cfg: ModelConfig, layer: int, w: WeightReader, prefix: str,
                 ratio: int) -> None:
        self.cfg, self.layer, self.ratio = cfg, layer, ratio
        D, H, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        G, ol = cfg.o_groups, cfg.o_lora_rank
        self.wq_a = w.linear(f"{prefix}.wq_a", cfg.q_lora_rank, D)
        self.q_norm = w.float_tensor(f"{prefix}.q_norm.weight", (cfg.q_lora_rank,))
        self.wq_b = w.linear(f"{prefix}.wq_b", H * hd, cfg.q_lora_rank)
        self.wkv = w.linear(f"{prefix}.wkv", hd, D)
        self.kv_norm = w.float_tensor(f"{prefix}.kv_norm.weight", (hd,))
        self.wo_a = LinearGroups(w.linear_groups(f"{prefix}.wo_a", G, ol, H * hd // G))
        self.wo_b = w.linear(f"{prefix}.wo_b", D, G * ol)
        self.attn_sink = w.float_tensor(f"{prefix}.attn_sink", (H,))
        # Heads and wo_a groups this object computes: all of them, unless tensor parallelism
        # gave it a slice (runtime/parallel_tp.py narrows wq_b, attn_sink and wo_a to match).
        self.n_heads, self.n_groups = H, G
        is_backbone = layer < cfg.n_layers
        self.compressor = (Compressor(cfg, layer, w, f"{prefix}.compressor")
                           if is_backbone and cfg.is_kv_source(layer) else None)
        self.indexer = (Indexer(cfg, layer, w, f"{prefix}.indexer")
                        if is_backbone and cfg.is_index_source(layer) else None)
        # The linears that read one input, each set in one launch where it can (LinearSet):
        # u → wq_a, wkv, the compressor's, the indexer's weights_proj; q_latent → wq_b, the
        # indexer's wq_b.
        self.n_comp = len(self.compressor.linears()) if self.compressor is not None else 0
        self.u_set = LinearSet([self.wq_a, self.wkv]
                               + (self.compressor.linears() if self.compressor else [])
                               + ([self.indexer.weights_proj] if self.indexer else []))
        self.qr_set = LinearSet([self.wq_b] + ([self.indexer.wq_b] if self.indexer else []))

    # -- pieces shared with the DSpark stages ----------------------------------------------
    def read_u(self, u: torch.Tensor, nx) -> list[torch.Tensor]:
        """u's projections (u_set): wq_a's and wkv's in the activation dtype, then the
        compressor's and the indexer's weights_proj's in fp32."""
        return self.u_set(u, nx, [None, None] + [torch.float32] * (len(self.u_set.linears) - 2))

    def queries(self, q_a: torch.Tensor, ctx: ForwardContext
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """From wq_a's output: (q_latent [T, q_lora], roped queries [T, H, hd], the indexer's
        unroped queries wq_b(q_latent) in fp32 — None without an indexer)."""
        cfg, nx = self.cfg, ctx.numerics
        qr = rms_norm(q_a, self.q_norm, cfg.rms_norm_eps)
        q, *index_q = self.qr_set(qr, nx,
                                  [None] + [torch.float32] * (len(self.qr_set.linears) - 1))
        q = q.view(ctx.T, self.n_heads, cfg.head_dim)
        cos, sin = ctx.rope(self.ratio)
        # (in place: q is this call's own, and only its tails are read and written)
        return qr, apply_rope(q, cos, sin, in_place=True), (index_q[0] if index_q else None)

    def kv_rows(self, kv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Window KV rows [T, hd] in their stored form (normed, roped; fp8-qdq'd in vendor
        mode) from wkv's output."""
        nx = ctx.numerics
        kv = rms_norm_rope(kv, self.kv_norm, self.cfg.rms_norm_eps, *ctx.rope(self.ratio))
        return fp8_act_qdq(kv) if nx.quantize else kv

    def output(self, o: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Inverse RoPE on the output tails (cast to the activation dtype), grouped wo_a, then
        wo_b. o [T, H, hd] fp32."""
        nx = ctx.numerics
        # (EXL3 groups rotate o back inside their input rotation: no launch, no copy of o)
        rope = InverseRope(*ctx.rope(self.ratio), self.cfg.head_dim, nx.act_dtype)
        G = self.n_groups
        # The vendor runs wo_a unquantized (convert.py dequantises it): no fp8 activation point.
        return self.wo_b(self.wo_a(o.reshape(ctx.T, G, -1), nx, rope), nx)

    # -- the backbone forward -----------------------------------------------------------------
    def forward(self, u: torch.Tensor, ctx: ForwardContext, state: State) -> torch.Tensor:
        cfg = self.cfg
        q_a, kv, *more = self.read_u(u, ctx.numerics)
        qr, q, index_q = self.queries(q_a, ctx)
        kv = self.kv_rows(kv, ctx)

        cache = sel = None
        if self.ratio > 0:
            self.publish(u, ctx, state, more[:self.n_comp] if self.compressor else None)
            if self.indexer is not None:
                ctx.sel[self.layer] = self.indexer.select(u, qr, ctx, state, q=index_q,
                                                          w=more[self.n_comp])
            sel = ctx.sel[cfg.index_source_of(self.layer)]
            cache = state.comp_kv[cfg.kv_source_of(self.layer)]
        # The ring is read before this forward's rows are written into it (a long chunk's
        # later rows overwrite slots its earlier queries read).
        ring = state.window[self.layer]
        o = self.attend_pieces(q, kv, ring, ctx.window(cfg.sliding_window, ring.size),
                               cache, sel)
        ring.write(ctx.start, ctx.positions, kv, state.journal)
        return self.output(o, ctx)

    def attend_pieces(self, q: torch.Tensor, kv: torch.Tensor, ring: PositionRing,
                      window: tuple[torch.Tensor, ...], cache: torch.Tensor | None,
                      sel: torch.Tensor | None) -> torch.Tensor:
        """attend_heads over the queries a few at a time, each piece with its own key rows
        (gather_rows: a 4,096-row prefill chunk at once would hold ~11 GB of them). Every
        query is its own batch element of the products and the softmax, so the pieces change
        no bit. q [T, H, hd], kv [T, hd] this forward's window rows (stored form) → [T, H, hd]
        fp32."""
        T, H, hd = q.shape
        n = window[0].shape[1] + (0 if sel is None else sel.shape[1])
        step = max(1, ATTN_SCRATCH // scratch_per_query(kv, ring, cache, H, n))
        if step >= 16:  # (aligned slices: no piece's shapes make a kernel compile anew)
            step -= step % 16
        # (each piece written into its slice of one output: no copy of the pieces into one)
        out = torch.empty((T, H, hd), dtype=torch.float32, device=q.device)
        from strata.kernels import attention as attn_kernels
        table = scratch = None
        if step < T and attn_kernels.available(kv):
            # Prefill's pieces are launched faster than they run only if the host does little
            # for each (bench/results/performance.md, session 54): the scores get one buffer
            # that every piece reuses, and where the rows are a RowTable (row starts, 8 bytes
            # a row) all queries' are made in one launch and sliced.
            scratch = torch.empty((step, H, n), dtype=torch.float32, device=q.device)
            if attn_kernels.row_table_applies(kv, ring.rows, cache):
                table = gather_rows(kv, ring, window, cache, sel)
        for i in range(0, T, step):
            j = min(i + step, T)
            if table is not None:
                rows, mask = table[0].rows(i, j), table[1][i:j]
            else:
                rows, mask = gather_rows(kv, ring, tuple(w[i:j] for w in window), cache,
                                         None if sel is None else sel[i:j])
            self.attend_heads(q[i:j], rows, mask, out=out[i:j], scratch=scratch)
        return out

    def publish(self, u: torch.Tensor, ctx: ForwardContext, state: State,
                projected: list[torch.Tensor] | None = None) -> None:
        """A kv source's compressed entries (and index keys) for these rows, which later
        layers read; nothing for a layer without a compressor. `projected`: the
        compressor's projections of u, where `forward` made them."""
        if self.compressor is None:
            return
        latent, entries, n = self.compressor.forward(u, ctx, state, projected)
        # each new entry rotated at its group's first position, in the cache and the index keys
        r = self.ratio
        rope = ctx.derived(("entry_rope", r), lambda: ctx.rope_at(r, entries * r))
        self._store_entries(latent, entries, rope, ctx, state)
        if self.indexer is not None:
            self.indexer.publish_keys(latent, entries, rope, ctx, state)
        if n:  # (host bookkeeping: which sources completed entries in this forward)
            ctx.published_keys.append(self.layer)

    def attend_heads(self, q: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor,
                     out: torch.Tensor | None = None,
                     scratch: torch.Tensor | None = None) -> torch.Tensor:
        """sparse_attention over this object's heads (tensor parallelism wraps it)."""
        return sparse_attention(q, rows, mask, self.attn_sink, self.cfg.head_dim ** -0.5, out,
                                scratch)

    def _store_entries(self, latent: torch.Tensor, entries: torch.Tensor,
                       rope: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext,
                       state: State) -> None:
        """Rotate new latents by `rope` (cos/sin at their group's first position) and store
        them at their entry indices (a device tensor)."""
        cache = state.comp_kv[self.layer]
        quantize = ctx.numerics.quantize
        # (cast inside the rotation's launch where nothing comes between: the same bits)
        kv = apply_rope(latent, *rope, out_dtype=None if quantize else cache.dtype)
        if quantize:
            kv = fp4_qdq_e4m3_scale(kv)
        cache[entries] = kv.to(cache.dtype)


def gather_rows(kv: torch.Tensor, ring: PositionRing, window: tuple[torch.Tensor, ...],
                cache: torch.Tensor | None,
                sel: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Some queries' key rows [T, W (+ k), hd] in their stored dtype (rows_dtype) and their
    mask — on CUDA, where every source holds one dtype, as a RowTable of where they lie.
    Each query's window is exactly its W most recent positions (ForwardContext.window:
    kpos, existing, in_chunk, row, slot), from the ring (earlier forwards; visible if its tag
    still holds that position) or this forward's kv, in position order — a fixed-length key
    set per query keeps the result independent of the chunk it came in — then come its
    selected compressed entries (−1: empty). One launch on CUDA (strata.kernels.attention,
    the same bits)."""
    from strata.kernels import attention as attn_kernels
    if attn_kernels.available(kv):
        if attn_kernels.row_table_applies(kv, ring.rows, cache):
            # (one dtype: the rows where they lie, read there by the products — no copy)
            return attn_kernels.row_table(kv, ring.rows, ring.tags, window, cache, sel)
        return attn_kernels.gather_rows(kv, ring.rows, ring.tags, window, cache, sel,
                                        rows_dtype(kv, ring, cache))
    kpos, existing, in_chunk, row, slot = window
    valid = existing & (in_chunk | (ring.tags[slot] == kpos))
    dt = rows_dtype(kv, ring, cache)
    rows = torch.where(in_chunk[..., None], kv[row].to(dt), ring.rows[slot].to(dt))
    if sel is None:
        return rows, valid
    return (torch.cat((rows, cache[sel.clamp(min=0)].to(dt)), dim=1),
            torch.cat((valid, sel >= 0), dim=1))


def scratch_per_query(kv: torch.Tensor, ring: PositionRing, cache: torch.Tensor | None,
                      H: int, n: int) -> int:
    """Device bytes one query of attend_pieces' piece holds while it attends over n rows: on
    CUDA (strata.kernels.attention) its scores s (fp32), the rows' starts (a RowTable, int64)
    or their gathered copy, the mask, its heads' softmax statistics, past one K chunk the
    chunks' partial outputs, and in pieces of a few queries p; on the torch path 3 fp32
    copies of the rows, s and p, and the sink's column."""
    from strata.kernels import attention as attn_kernels
    from strata.kernels.rowwise import K_CHUNK, SMALL_BATCH
    hd = kv.shape[-1]
    if not attn_kernels.available(kv):
        return 12 * n * hd + 12 * H * (n + 1)
    dt = rows_dtype(kv, ring, cache)
    rows = 8 * n if attn_kernels.row_table_applies(kv, ring.rows, cache) else n * hd * dt.itemsize
    chunks = -(-n // K_CHUNK) if n > K_CHUNK else 0
    per = rows + n + 4 * H * n + 8 * H + 4 * H * hd * chunks
    # (pieces of at most SMALL_BATCH queries also store their p: fp32, or for bf16 rows its
    # three bf16 parts)
    p = (6 if dt == torch.bfloat16 else 4) * H * n
    return per + p if ATTN_SCRATCH // per <= SMALL_BATCH else per


def rows_dtype(kv: torch.Tensor, ring: PositionRing, cache: torch.Tensor | None) -> torch.dtype:
    """The dtype holding every key row exactly (the widest of their stored dtypes)."""
    dt = torch.promote_types(kv.dtype, ring.rows.dtype)
    return dt if cache is None else torch.promote_types(dt, cache.dtype)


def sparse_attention(q: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor,
                     sink: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                     scratch: torch.Tensor | None = None) -> torch.Tensor:
    """One softmax per query over its own rows [T, n, hd] — its window's, then its selected
    compressed entries' (gather_rows; on CUDA also a RowTable) — with mask [T, n]; the
    per-head sink enters only the denominator; K == V.
    q [T, H, hd] → [T, H, hd] fp32 (written into `out`, a contiguous fp32 [T, H, hd], if
    given), every product accumulated in fp32 (16-bit q and rows: exact products, on tensor
    cores on CUDA). Every query is its own batch element. `scratch` (CUDA): a buffer for the
    scores of at least T queries ([≥ T, H, n] fp32), written here instead of a new one."""
    T, H, _ = q.shape
    s = rows_bmm(q, rows, torch.float32, out=None if scratch is None else scratch[:T])
    from strata.kernels import attention as attn_kernels
    if attn_kernels.available(s):  # (p formed in registers where p·v multiplies it)
        return attn_kernels.sink_softmax_pv(s, mask, sink, scale, rows, out)
    # (a Python scalar, not torch.tensor(-inf, device=…): that is a host → device upload per
    # layer, which on a GPU waits for the stream)
    s = (s * scale).masked_fill(~mask[:, None, :], float("-inf"))
    s = torch.cat((s, sink.view(1, H, 1).expand(T, H, 1)), dim=-1)
    p = torch.softmax(s, dim=-1)[..., :-1]
    o = rows_bmm(p, rows.transpose(1, 2))
    return o if out is None else out.copy_(o)
