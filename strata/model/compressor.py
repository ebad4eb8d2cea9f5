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
from strata.model.context import ForwardContext
from strata.model.numerics import rms_norm
from strata.runtime.state import State


class Compressor:
    def __init__(self, cfg: ModelConfig, layer: int, w: WeightReader, prefix: str) -> None:
        self.cfg, self.layer, self.ratio = cfg, layer, cfg.ratio(layer)
        D, hd = cfg.hidden_size, cfg.head_dim
        self.wkv = w.linear(f"{prefix}.wkv", hd, D)
        self.wgate = w.linear(f"{prefix}.wgate", hd, D) if self.ratio > 1 else None
        self.norm = w.float_tensor(f"{prefix}.norm.weight", (hd,))

    def forward(self, u: torch.Tensor, ctx: ForwardContext,
                state: State) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents of the groups completed by this forward and their entry indices:
        ([n, hd] fp32, [n] on the device). Ratio 1: one entry per token, at the token's
        position (taken from the forward's device positions: no host int in the ops)."""
        r, start, T = self.ratio, ctx.start, ctx.T
        nx = ctx.numerics
        j0, j1 = start // r, (start + T) // r
        k = self.wkv(u, nx, torch.float32)
        if r == 1:
            return rms_norm(k, self.norm, self.cfg.rms_norm_eps), ctx.positions
        g = self.wgate(u, nx, torch.float32)
        kg = torch.stack((k, g), dim=1)  # [T, 2, hd]
        ring = state.comp_tail[self.layer]
        lead = start - j0 * r  # tokens of the first group that earlier forwards saw
        if lead:
            prev = ring.gather(torch.arange(start - lead, start, device=u.device))
            kg_all = torch.cat((prev, kg), dim=0)
        else:
            kg_all = kg
        ring.write(ctx.start, ctx.positions, kg, state.journal)
        n = j1 - j0
        entries = torch.arange(j0, j1, device=u.device)
        if n == 0:
            return kg.new_zeros((0, self.cfg.head_dim)), entries
        groups = kg_all[:n * r].view(n, r, 2, -1)
        weights = torch.softmax(groups[:, :, 1], dim=1)
        pooled = (weights * groups[:, :, 0]).sum(dim=1)
        return rms_norm(pooled, self.norm, self.cfg.rms_norm_eps), entries
