"""One transformer block with V4.1's lagged mHC (spec §2.2).

The sublayer input is collapsed with the PREVIOUS sublayer's `pre` (one-hot at layer 0), so a
block returns its FFN `pre` for the next block, and the model's final collapse uses layer 39's.
DSpark stages are blocks too (ratio 0, their own expert count, no Engram).
"""
from __future__ import annotations

from typing import Callable

import torch

from strata.checkpoint.weights import WeightReader
from strata.config import ModelConfig
from strata.model.attention import Attention
from strata.model.context import ForwardContext
from strata.model.engram import Engram
from strata.model.mhc import HcWeights, collapse_norm, hc_mixes, hc_update
from strata.model.moe import MoE
from strata.runtime.state import State
from strata.streams import both
from strata.trace import scope


def load_hc(cfg: ModelConfig, w: WeightReader, prefix: str) -> HcWeights:
    H, D = cfg.hc_mult, cfg.hidden_size
    return HcWeights(fn=w.float_tensor(f"{prefix}_fn", (cfg.hc_mix_size, H * D)),
                     base=w.float_tensor(f"{prefix}_base", (cfg.hc_mix_size,)),
                     scale=w.float_tensor(f"{prefix}_scale", (3,)))


class Block:
    def __init__(self, cfg: ModelConfig, layer: int, w: WeightReader, prefix: str) -> None:
        self.cfg, self.layer = cfg, layer
        D = cfg.hidden_size
        is_stage = layer >= cfg.n_layers
        ratio = cfg.compress_ratios[layer] if layer < len(cfg.compress_ratios) else 0
        self.engram = (Engram(cfg, layer, w, f"{prefix}.engram")
                       if not is_stage and layer in cfg.engram_layer_ids else None)
        self.hc_attn = load_hc(cfg, w, f"{prefix}.hc_attn")
        self.hc_ffn = load_hc(cfg, w, f"{prefix}.hc_ffn")
        self.attn_norm = w.float_tensor(f"{prefix}.attn_norm.weight", (D,))
        self.ffn_norm = w.float_tensor(f"{prefix}.ffn_norm.weight", (D,))
        self.attn = Attention(cfg, layer, w, f"{prefix}.attn", ratio)
        n_exp = cfg.dspark_n_routed_experts if is_stage else cfg.n_routed_experts
        top_k = cfg.dspark_num_experts_per_tok if is_stage else cfg.num_experts_per_tok
        self.ffn = MoE(cfg, w, f"{prefix}.ffn", n_exp, top_k)

    def mixes(self, hc: HcWeights, h: torch.Tensor):
        cfg = self.cfg
        return hc_mixes(h, hc, cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)

    def attend(self, u: torch.Tensor, ctx: ForwardContext, state: State) -> torch.Tensor:
        """The attention sublayer (DSpark stages attend differently: see model/dspark.py)."""
        return self.attn.forward(u, ctx, state)

    def publish(self, h: torch.Tensor, pre_mix: torch.Tensor, ctx: ForwardContext,
                state: State) -> None:
        """Only what later layers read from this block: its compressed entries and index
        keys, from its attention input (the prefill's decoder skip, Model.forward)."""
        u = collapse_norm(h, pre_mix, self.attn_norm, self.cfg.rms_norm_eps)
        self.attn.publish(u, ctx, state)

    def forward(self, h: torch.Tensor, pre_mix: torch.Tensor, ctx: ForwardContext,
                state: State) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H, D], pre_mix [T, H] → (h, this block's FFN pre)."""
        cfg, nx = self.cfg, ctx.numerics
        if self.engram is not None:
            with scope("engram"):
                h = self.engram.forward(h, ctx.engram_ids_of(self.layer), nx,
                                        ctx.engram_records.get(self.layer))
        if self.layer in cfg.dspark_target_layer_ids:
            ctx.main_hidden[self.layer] = h.float().mean(1)

        (pre_a, post_a, comb_a), y = self.sublayer(
            h, pre_mix, self.attn_norm, self.hc_attn, "attention",
            lambda u: self.attend(u, ctx, state))
        with scope("mhc"):
            h = hc_update(y, h, post_a, comb_a)
        (pre_f, post_f, comb_f), y = self.sublayer(
            h, pre_a, self.ffn_norm, self.hc_ffn, "moe", lambda u: self.ffn.forward(u, nx))
        with scope("mhc"):
            h = hc_update(y, h, post_f, comb_f)
        return h, pre_f

    def sublayer(self, h: torch.Tensor, pre: torch.Tensor, norm: torch.Tensor, hc: HcWeights,
                 name: str, run: Callable[[torch.Tensor], torch.Tensor]):
        """(this sublayer's mixes of h, run(its input)). The input is h collapsed by the
        previous sublayer's pre (V4.1 lags it one sublayer), normed; the mixes are read only
        after the sublayer (post, comb) and by the next one (pre), so on a GPU they are made
        beside it (strata.streams)."""
        def mixes():
            with scope("mhc"):
                return self.mixes(hc, h)

        def body():
            with scope("mhc"):
                u = collapse_norm(h, pre, norm, self.cfg.rms_norm_eps)
            with scope(name):
                return run(u)
        return both(mixes, body, h.device)
