"""The DSpark draft head (`mtp.0..N-1`, spec §2.11, dspark_engram.md §1.3).

Context: for every committed main position, main_x = RMSNorm(main_proj · [stream means at
the inputs of the target layers]; main_norm), and each stage keeps its own window of keys
fp8(rope(RMSNorm(wkv_k · main_x))) — written for committed rows only (`commit_context`).

Drafting (`draft`): a block [anchor, noise×(γ-1)] at positions P..P+γ-1 (P = the anchor's
position, one past the last committed row) runs through the stages — ordinary blocks (own
mHC, 128-expert MoE, window-only RoPE) whose attention sees the stage's window of committed
keys plus all block rows, non-causally. The collapsed rows give base logits through the
backbone head; a rank-r Markov bias then makes the drafts semi-autoregressive:
token_{i+1} = pick(U_i + head_m · embed_m[token_i]). Confidence c_i = σ(proj · [x_i; embed_m
[token_i]]) estimates P(draft i accepted | the earlier ones were).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.checkpoint.weights import WeightReader
from strata.config import ModelConfig
from strata.current_device import made_current
from strata.model.attention import rows_dtype, sparse_attention
from strata.model.block import Block
from strata.model.context import ForwardContext
from strata.model.mhc import collapse
from strata.model.numerics import Numerics, rms_norm, row_matmul
from strata.quant.groups import LinearSet
from strata.runtime.state import State
from strata.trace import scope


class DSparkStage(Block):
    """One draft stage: a block whose attention reads the stage's committed-key window."""

    def __init__(self, cfg: ModelConfig, index: int, w: WeightReader) -> None:
        super().__init__(cfg, cfg.n_layers + index, w, f"mtp.{index}")
        self.index = index

    def attend(self, u: torch.Tensor, ctx: ForwardContext, state: State) -> torch.Tensor:
        attn, cfg = self.attn, self.cfg
        q_a, kv = attn.read_u(u, ctx.numerics)  # (a stage has no compressor or indexer)
        _, q, _ = attn.queries(q_a, ctx)
        kv = attn.kv_rows(kv, ctx)  # the block rows' own keys, in stored form
        ring = state.dspark[self.index]
        # The anchor's position P (on the device: a graph replays this at any position); the
        # window is the W positions before it — rows at P or later, a verify window's rows
        # past its accepted drafts (committed with the rest), are not read.
        P = ctx.positions[:1]
        valid = (ring.tags >= 0) & (ring.tags < P) & (ring.tags >= P - cfg.sliding_window)
        # The rows in the dtype holding both exactly (16-bit when both are: the products are
        # exact either way, and 16-bit ones run on tensor cores, as the backbone's attention)
        dt = rows_dtype(kv, ring, None)
        rows = torch.cat((ring.rows.to(dt), kv.to(dt)), dim=0)
        mask = torch.cat((valid, torch.ones(ctx.T, dtype=torch.bool, device=u.device)))
        T = ctx.T
        o = sparse_attention(q.to(dt), rows.expand(T, -1, -1), mask.expand(T, -1),
                             attn.attn_sink, cfg.head_dim ** -0.5)
        return attn.output(o, ctx)


@dataclass
class Draft:
    tokens: torch.Tensor      # [γ] drafted tokens for positions P+1..P+γ
    logits: torch.Tensor      # [γ, V] Markov-corrected draft logits
    confidence: torch.Tensor  # [γ] σ(conf): P(accepted | the earlier drafts were)


class DSparkHead:
    def __init__(self, cfg: ModelConfig, w: WeightReader) -> None:
        D, V, R = cfg.hidden_size, cfg.vocab_size, cfg.dspark_markov_rank
        n = cfg.num_nextn_predict_layers
        self.cfg = cfg
        self.stages = [DSparkStage(cfg, k, w) for k in range(n)]
        self.main_proj = w.linear("mtp.0.main_proj", D, len(cfg.dspark_target_layer_ids) * D)
        self.main_norm = w.float_tensor("mtp.0.main_norm.weight", (D,))
        last = f"mtp.{n - 1}"
        self.norm = w.float_tensor(f"{last}.norm.weight", (D,))
        self.markov_embed = w.tensor(f"{last}.markov_head.embed.weight", ("BF16", "F32"), (V, R))
        self.markov_head = w.tensor(f"{last}.markov_head.head.weight", ("BF16", "F32"), (V, R))
        self.confidence_proj = w.float_tensor(f"{last}.confidence_head.proj.weight", (1, D + R))
        # every stage's wkv of the committed rows' main_x (their window keys), in one launch
        # where they can
        self.context_kv = LinearSet([stage.attn.wkv for stage in self.stages])

    def main_hidden(self, ctx: ForwardContext) -> torch.Tensor:
        """[n, n_targets·D]: the forward's taps, concatenated in target-layer order, for its
        last n rows — all T, but in a decoder-skipping prefill, whose target layers run only
        its last rows (Model.rows_from): the rows every one of them ran, or none."""
        taps = [ctx.main_hidden.get(l) for l in self.cfg.dspark_target_layer_ids]
        n = min(0 if t is None else t.shape[0] for t in taps)
        if n == 0:
            return torch.empty((0, len(taps) * self.cfg.hidden_size), dtype=torch.float32,
                               device=ctx.positions.device)
        return torch.cat([t[t.shape[0] - n:] for t in taps], dim=-1)

    def commit_context(self, main_hidden: torch.Tensor, start: int, state: State,
                       nx: Numerics) -> None:
        """Write the stage windows for main rows at positions start.. (committed ones, or a
        verify window's every row: DSparkDecoder._step); never journaled."""
        with scope("draft"), made_current(main_hidden.device):
            positions = torch.arange(start, start + main_hidden.shape[0],
                                     device=main_hidden.device)
            self.commit_rows(main_hidden, positions, start, state, nx)

    def commit_rows(self, main_hidden: torch.Tensor, positions: torch.Tensor, start: int,
                    state: State, nx: Numerics) -> None:
        """commit_context with the rows' positions [T] on the device: no op depends on
        `start` (only the ring writes' journal bookkeeping reads it, and no journal is open
        here), so runtime/graphs.py replays it."""
        cfg = self.cfg
        ctx = ForwardContext(cfg, nx, start, positions)
        main_x = rms_norm(self.main_proj(main_hidden, nx), self.main_norm, cfg.rms_norm_eps)
        # (the same projection as the block rows' keys: Attention.kv_rows of its wkv)
        for stage, kv in zip(self.stages, self.context_kv(main_x, nx)):
            state.dspark[stage.index].write(start, positions, stage.attn.kv_rows(kv, ctx), None)

    @torch.no_grad()
    def draft(self, embed: torch.Tensor, head, anchor: int, state: State, nx: Numerics,
              pick) -> Draft:
        """Draft γ tokens after `anchor`, which sits at position state.position.

        `pick(logits [1, V], positions [1]) -> token ids [1]`, all on the device, chooses each
        draft token (the request's own sampler, so a draft coupled to the target's noise is
        accepted more often).
        """
        with scope("draft"), made_current(embed.device):
            return self._draft(embed, head, anchor, state, nx, pick)

    def _draft(self, embed: torch.Tensor, head, anchor: int, state: State, nx: Numerics,
               pick) -> Draft:
        cfg = self.cfg
        g = cfg.dspark_block_size
        P = state.position
        dev = embed.device
        tokens = torch.full((g,), cfg.dspark_noise_token_id, dtype=torch.long, device=dev)
        tokens[0] = anchor
        ctx = ForwardContext(cfg, nx, P, torch.arange(P, P + g, device=dev))
        x, base = self.draft_rows(embed, head, tokens, ctx, state)
        return self.markov(x, base, tokens[:1], ctx.positions + 1, pick)

    def draft_rows(self, embed: torch.Tensor, head, tokens: torch.Tensor, ctx: ForwardContext,
                   state: State) -> tuple[torch.Tensor, torch.Tensor]:
        """The block [anchor, noise…] through the stages: (pre-norm rows x [γ, D] fp32, base
        logits [γ, V] fp32). Its ops do not depend on the position (runtime/graphs.py
        replays them)."""
        h, pre = self.block_stream(embed, tokens, ctx.numerics)
        for stage in self.stages:
            h, pre = stage.forward(h, pre, ctx, state)
        return self.block_logits(h, pre, head, ctx.numerics)

    # draft_rows' pieces (runtime/graphs.py replays the draft as a chain of graphs of them)
    def block_stream(self, embed: torch.Tensor, tokens: torch.Tensor,
                     nx: Numerics) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's initial stream h [γ, H, D] (every copy the embedding), pre = one-hot(0)."""
        cfg, g = self.cfg, tokens.numel()
        h = embed[tokens].to(nx.act_dtype)[:, None, :].expand(g, cfg.hc_mult, -1).contiguous()
        pre = torch.zeros((g, cfg.hc_mult), dtype=torch.float32, device=tokens.device)
        pre[:, 0] = 1.0
        return h, pre

    def block_logits(self, h: torch.Tensor, pre: torch.Tensor, head,
                     nx: Numerics) -> tuple[torch.Tensor, torch.Tensor]:
        """(pre-norm rows x [γ, D] fp32, base logits [γ, V] fp32) after the last stage."""
        x = collapse(h, pre).float()  # pre-norm rows: the confidence head reads these
        return x, head(rms_norm(x, self.norm, self.cfg.rms_norm_eps), nx, torch.float32)

    def markov(self, x: torch.Tensor, base: torch.Tensor, anchor: torch.Tensor,
               positions: torch.Tensor, pick) -> Draft:
        """The semi-autoregressive picks: each bias depends on the previous pick, the first
        on the anchor ([1], on the device); row i's pick is for `positions[i]`. The picks
        stay on the device — each selects the next row's embedding by index — so drafting
        waits for the GPU nowhere (the caller's `.tolist()` of the tokens is the one wait),
        and no op depends on the position (runtime/graphs.py replays them)."""
        # (the head as stored: a row product upcasts each weight exactly, as .float() would,
        # without a [V, R] fp32 copy — 132 MB written and read per pick — every draft)
        head_m = self.markov_head
        prev = anchor.view(1)
        out_tokens, out_logits, conf = [], [], []
        for i in range(base.shape[0]):
            m = self.markov_embed.index_select(0, prev).float()  # [1, R]
            logits = base[i:i + 1] + row_matmul(m, head_m)
            c = self.confidence_proj[0] @ torch.cat((x[i], m[0]))
            prev = pick(logits, positions[i:i + 1]).view(1)
            out_tokens.append(prev)
            out_logits.append(logits)
            conf.append(torch.sigmoid(c))
        return Draft(torch.cat(out_tokens), torch.cat(out_logits), torch.stack(conf))
