"""The KV compressor of kv-source layers (spec §2.5).

Ratio 1 (layer 20): latent_j = RMSNorm(wkv·u_j). Ratio 2 (layers 2/8/14): tokens pooled in
aligned pairs, latent_j = RMSNorm(Σ_t softmax_t(gate)[c]·k_t[c]). A group that a forward leaves
unfinished keeps its first token's (k, gate) in the state's tail ring, so chunked prefill and
token-by-token decode produce the same entries. Latents are returned pre-RoPE: the index keys
use them unrotated; the KV cache stores them rotated at the group's first position.
"""
from __future__ import annotations

import torch

from strata.config import ModelConfig
from strata.checkpoint.weights import WeightReader
from strata.kernels import compressor as compressor_kernels
from strata.model.context import ForwardContext
from strata.model.numerics import rms_norm
from strata.quant.groups import LinearSet
from strata.runtime.state import State


def entries_written(ratio: int, T: int) -> int:
    """How many entries a forward of T rows writes for a kv source: one per row at ratio 1,
    else the ⌈T/r⌉ groups from the one holding the first row (the last possibly unfinished)."""
    return T if ratio == 1 else -(-T // ratio)


def entry_indices(ratio: int, positions: torch.Tensor) -> torch.Tensor:
    """Those entries' indices, from the forward's device positions (no host value of the
    start: a CUDA graph replays them at any position)."""
    if ratio == 1:
        return positions
    first = positions[:1] // ratio
    return first + torch.arange(entries_written(ratio, positions.numel()), device=first.device)


def forward_entries(ctx: ForwardContext, ratio: int) -> torch.Tensor:
    """entry_indices of a forward's positions, made once a forward (the same for every
    source of this ratio, and for a layer split's hops)."""
    return ctx.derived(("entries", ratio), lambda: entry_indices(ratio, ctx.positions))


class Compressor:
    def __init__(self, cfg: ModelConfig, layer: int, w: WeightReader, prefix: str) -> None:
        self.cfg, self.layer, self.ratio = cfg, layer, cfg.ratio(layer)
        D, hd = cfg.hidden_size, cfg.head_dim
        self.wkv = w.linear(f"{prefix}.wkv", hd, D)
        self.wgate = w.linear(f"{prefix}.wgate", hd, D) if self.ratio > 1 else None
        self.norm = w.float_tensor(f"{prefix}.norm.weight", (hd,))
        self.projections = LinearSet(self.linears())  # (one launch where they can)

    def linears(self) -> list:
        """What it projects u with (fp32 outputs), in the order `forward` takes them."""
        return [self.wkv] if self.wgate is None else [self.wkv, self.wgate]

    def forward(self, u: torch.Tensor, ctx: ForwardContext, state: State,
                projected: list[torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Latents of the groups this forward may complete, their entry indices (on the
        device) and how many of them it does complete: ([m, hd] fp32, [m], n ≤ m).

        The ops depend on T only, never on the position (a CUDA graph replays them at any
        position): ratio 1 gives one entry per token at the token's position; ratio r > 1
        pools the m = ⌈T/r⌉ groups from the one holding the forward's first token — the first
        n = (start+T)//r − start//r are complete; a last incomplete one (n < m) is written too,
        at an entry no query can see yet (j ≥ (p+1)//r), which the forward completing that
        group overwrites (the state keeps a spare entry row for it). `projected`: u's
        projections by `linears()`, where the caller made them (with other linears of u in
        one launch: Attention.forward); else made here."""
        r, start, T = self.ratio, ctx.start, ctx.T
        nx = ctx.numerics
        n = (start + T) // r - start // r
        if projected is None:
            projected = self.projections(u, nx, torch.float32)
        if r == 1:
            (k,) = projected
            return rms_norm(k, self.norm, self.cfg.rms_norm_eps), forward_entries(ctx, r), n
        k, g = projected
        kg = torch.stack((k, g), dim=1)  # [T, 2, hd]: what the tail ring keeps
        ring = state.comp_tail[self.layer]
        entries = forward_entries(ctx, r)
        # (read before this forward's rows are written: a long chunk's rows overwrite slots)
        if compressor_kernels.available(k):  # (the steps below in one launch, their bits)
            pooled = compressor_kernels.pool(ring.rows, k, g, ctx.positions, entries, r)
        else:
            first = ctx.positions[:1]
            # The r − 1 tokens before the forward (an unfinished group's start; rows of
            # positions < 0 are never used), then this forward's: positions first − (r−1) ..
            # first + T − 1.
            back = torch.arange(1 - r, 0, device=u.device)
            kg_all = torch.cat((ring.gather(first + back), kg), dim=0)
            rows = entries[:, None] * r + torch.arange(r, device=u.device)[None] - first + (r - 1)
            groups = kg_all[rows.clamp(max=T + r - 2)]  # [m, r, 2, hd]
            weights = torch.softmax(groups[:, :, 1], dim=1)
            pooled = (weights * groups[:, :, 0]).sum(dim=1)
        ring.write(start, ctx.positions, kg, state.journal)
        return rms_norm(pooled, self.norm, self.cfg.rms_norm_eps), entries, n
