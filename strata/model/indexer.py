"""The lightning indexer: which compressed entries each query attends (spec §2.6).

Key owners (the kv-source layers) derive index keys from their compressor's pre-RoPE latent.
Every index-source layer scores the visible entries with its own queries,
score_j = Σ_h w_h·relu(q_h·k_j), and publishes the top-k. The candidate source (layer 20)
also publishes candidate blocks; the later "reindex" layers score only inside them.

Selection is batch-invariant: a query's picks depend only on its own visible entries (entries
j < (p+1)//ratio), ties go to the lowest index, and −inf (invisible or masked) entries are never
picked, so prefill, verify and decode select the same entries.
"""
from __future__ import annotations

import torch

from strata.checkpoint.weights import WeightReader
from strata.config import ModelConfig
from strata.kernels import indexer as index_kernels
from strata.model.context import ForwardContext
from strata.model.numerics import ranked_topk, rows_bmm
from strata.model.rope import apply_rope, rms_norm_rope
from strata.quant.qdq import fp4_qdq_ue8m0
from strata.runtime.state import State, entry_bucket

# Queries are scored in pieces whose largest temporaries stay under this many bytes: a 4,096-row
# prefill chunk against a 524K context's 262K entries would otherwise make a [T, heads, n] fp32
# tensor of 137 GB (the torch path: 4 bytes per head and entry), or [T, n] scores and
# selection temporaries of several GB (the CUDA kernels keep the heads in registers and select
# without keys in memory: under TOPK_BYTES per entry remain). Every query's selection is its
# own: the pieces change no bit.
SCORE_SCRATCH = 1 << 30
TOPK_BYTES = 32  # the scores, a candidate source's padded block copy, a reindex layer's ids


def topk_lowest_index(scores: torch.Tensor, k: int,
                      ids: torch.Tensor | None = None) -> torch.Tensor:
    """Indices [T, k] of the k largest finite scores per row, ties to the lowest index,
    sorted ascending; slots with no finite score left are −1. Always k wide, so the
    attention that consumes it has the same shape whatever the number of entries. With
    `ids` [T, n] (int64): ids[t, index] in each index's place."""
    from strata.kernels import ranking
    if ranking.available(scores):
        return ranking.top_picks(scores, k, ids)  # (the ops below, no keys in memory, no sort)
    if ids is not None:
        at = topk_lowest_index(scores, k)
        return torch.where(at >= 0, ids.gather(1, at.clamp(min=0)), at)
    T, n = scores.shape
    m = min(k, n)
    if m == n:  # every entry is a pick (a context of few entries): nothing to select
        idx = torch.arange(n, device=scores.device).expand(T, n)
    else:
        idx = ranked_topk(scores, m, sorted=False)  # (a radix select, not a sort of the row)
    val = scores.gather(1, idx)
    idx = torch.where(val > float("-inf"), idx, torch.full_like(idx, n))
    idx = torch.sort(idx, dim=-1).values
    idx = torch.where(idx < n, idx, torch.full_like(idx, -1))
    if m < k:
        idx = torch.cat((idx, idx.new_full((T, k - m), -1)), dim=1)
    return idx


def select_candidate_blocks(scores: torch.Tensor, n_visible: torch.Tensor, block: int,
                            n_blocks: int) -> torch.Tensor:
    """Ids [T, min(n_blocks, nb)] (ascending, −1 = none) of the top `n_blocks` blocks of
    `block` entries by max score, of the nb = ⌈n/block⌉ blocks; the block holding each query's
    newest visible entry is always kept; blocks with no finite score never are. (No more than
    nb blocks exist: the width is fixed by n's bucket, and far below n's.)"""
    T, n = scores.shape
    nb = (n + block - 1) // block
    padded = torch.full((T, nb * block), float("-inf"), dtype=scores.dtype, device=scores.device)
    padded[:, :n] = scores
    bscore = padded.view(T, nb, block).amax(-1)
    newest = (n_visible - 1).clamp(min=0) // block
    pin = (n_visible > 0)[:, None] & (torch.arange(nb, device=scores.device)[None] == newest[:, None])
    bscore = torch.where(pin, torch.full_like(bscore, float("inf")), bscore)
    return topk_lowest_index(bscore, min(n_blocks, nb))


def candidate_mask(blocks: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """Entry mask [T, n] of candidate block ids [T, m] (−1 = none)."""
    T, nb = blocks.shape[0], (n + block - 1) // block
    mask = torch.zeros((T, nb + 1), dtype=torch.bool, device=blocks.device)
    mask.scatter_(1, torch.where(blocks >= 0, blocks, torch.full_like(blocks, nb)), True)
    return mask[:, :nb].repeat_interleave(block, dim=1)[:, :n]


def candidate_entries(blocks: torch.Tensor, block: int) -> torch.Tensor:
    """Entry ids [T, m·block] of candidate block ids [T, m] (ascending, −1 = none): each
    block's entries in order, so ascending too."""
    ids = blocks[:, :, None] * block + torch.arange(block, device=blocks.device)
    return torch.where(blocks[:, :, None] >= 0, ids, torch.full_like(ids, -1)).flatten(1)


class Indexer:
    def __init__(self, cfg: ModelConfig, layer: int, w: WeightReader, prefix: str) -> None:
        self.cfg, self.layer, self.ratio = cfg, layer, cfg.ratio(layer)
        nh, ihd = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = w.linear(f"{prefix}.wq_b", nh * ihd, cfg.q_lora_rank)
        self.weights_proj = w.linear(f"{prefix}.weights_proj", nh, cfg.hidden_size)
        self.owns_keys = cfg.is_kv_source(layer)
        if self.owns_keys:
            self.wk = w.linear(f"{prefix}.wk", ihd, cfg.head_dim)
            self.k_norm = w.float_tensor(f"{prefix}.k_norm.weight", (ihd,))

    def publish_keys(self, latent: torch.Tensor, entries: torch.Tensor,
                     rope: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext,
                     state: State) -> None:
        """Index keys of new entries (indices on the device) from their pre-RoPE latents, into
        the state; `rope`: cos/sin at each entry's group's first position."""
        nx = ctx.numerics
        k = rms_norm_rope(self.wk(latent, nx, torch.float32), self.k_norm,
                          self.cfg.rms_norm_eps, *rope)
        if nx.quantize:
            k = fp4_qdq_ue8m0(k)
        state.index_k[self.layer][entries] = k.to(state.index_k[self.layer].dtype)

    def select(self, u: torch.Tensor, qr: torch.Tensor, ctx: ForwardContext, state: State,
               q: torch.Tensor | None = None, w: torch.Tensor | None = None) -> torch.Tensor:
        """Top-k entries [T, k] (ascending, −1 = none) for every query of the forward. `q`
        = wq_b(qr), `w` = weights_proj(u) (fp32), where the caller made them (with other
        linears of the same input in one launch: Attention.forward); else made here."""
        cfg, nx, r = self.cfg, ctx.numerics, self.ratio
        nh, ihd = cfg.index_n_heads, cfg.index_head_dim
        key_src = cfg.kv_source_of(self.layer)
        if (nx.vendor_stale_index_k and self.owns_keys and r > 1
                and self.layer not in ctx.published_keys and state.stale_index_source is not None):
            key_src = state.stale_index_source  # vendor quirk, spec §2.6
        # Scored over a bucketed number of entries (the invisible ones masked below), so the
        # ops' shapes change only at bucket edges: a CUDA graph per bucket.
        n = entry_bucket((ctx.start + ctx.T) // r)
        keys = state.index_k[key_src][:n]  # (stored dtype; the products accumulate in fp32)
        q = (self.wq_b(qr, nx, torch.float32) if q is None else q).view(ctx.T, nh, ihd)
        cos, sin = ctx.rope(r)
        q = apply_rope(q, cos, sin)  # (into a copy: select must not change the caller's q)
        if nx.quantize:
            # fp4 values are exact in the cache's dtype: the products are exact either way,
            # and 16-bit operands run on tensor cores
            q = fp4_qdq_ue8m0(q).to(keys.dtype)
        w = self.weights_proj(u, nx, torch.float32) if w is None else w
        w_scale = ihd ** -0.5 * nh ** -0.5
        n_visible = ctx.derived(("n_visible", r), lambda: (ctx.positions + 1) // r)
        source = self.layer == cfg.candidate_source_layer_id
        reindex = not source and cfg.is_reindex(self.layer)
        fused = index_kernels.available(q)
        per_entry = TOPK_BYTES if fused else 4 * nh
        rows = max(1, SCORE_SCRATCH // max(1, per_entry * n))
        # (pieces of a multiple of 16 queries: every piece's slices keep their 16-byte
        # alignment, so a long prompt compiles no kernel variant for a misaligned pointer —
        # at odd piece sizes the scores kernel compiled again inside a 128K prefill, ~0.6 s,
        # session 45)
        rows = rows - rows % 16 if rows >= 16 else rows
        picks, candidates = [], []
        for i in range(0, ctx.T, rows):
            j = min(i + rows, ctx.T)
            if reindex and fused:
                entries = ctx.derived(("candidate_entries",), lambda: candidate_entries(
                    ctx.candidates, cfg.candidate_block_size))  # (one for every reindex layer)
                picks.append(self._select_candidates(q[i:j], keys, w[i:j], n_visible[i:j],
                                                     w_scale, entries[i:j]))
                continue
            if fused:  # (one launch, masked too, no per-head scratch)
                scores = index_kernels.index_scores(q[i:j], keys, w[i:j], n_visible[i:j],
                                                    w_scale)
            else:
                per_head = torch.relu(rows_bmm(q[i:j], keys.unsqueeze(0), torch.float32))
                scores = rows_bmm((w[i:j] * w_scale).unsqueeze(1),
                                  per_head.transpose(1, 2)).squeeze(1)
                del per_head  # (Σ_h w_h·relu(q_h·k) is made: free the piece's scratch now)
                visible = torch.arange(n, device=u.device)[None] < n_visible[i:j, None]
                scores = torch.where(visible, scores, torch.full_like(scores, float("-inf")))
            if source:
                candidates.append(select_candidate_blocks(
                    scores, n_visible[i:j], cfg.candidate_block_size, cfg.candidate_topk_blocks))
            elif reindex:
                cand = candidate_mask(ctx.candidates[i:j], cfg.candidate_block_size, n)
                scores = torch.where(cand, scores, torch.full_like(scores, float("-inf")))
            picks.append(topk_lowest_index(scores, cfg.index_topk))
        if source:
            ctx.candidates = _joined(candidates)
        return _joined(picks)

    def _select_candidates(self, q, keys, w, n_visible, w_scale, entries) -> torch.Tensor:
        """A reindex layer's picks on CUDA: its candidate entries (ids [T, m], ascending, −1
        none) alone scored, each with the bits it has among all the entries
        (strata.kernels.indexer), the top-k of those as entry ids — ascending as the
        candidates are, ties to the lowest. At long context the candidates are a few percent
        of the entries (2,048 blocks of 8 against 524K), and no [T, n] mask is made."""
        scores = index_kernels.index_scores(q, keys, w, n_visible, w_scale, entries=entries)
        return topk_lowest_index(scores, self.cfg.index_topk, entries)


def _joined(pieces: list[torch.Tensor]) -> torch.Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
