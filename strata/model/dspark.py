"""The DSpark draft head's weights (`mtp.0..N-1`, spec §2.11).

Loaded with the model so a checkpoint is validated whole; the drafting loop and the verify
step build on these (issue 3). Stages are ordinary blocks (ratio 0, own experts); the head
shares the backbone's embedding and LM head.
"""
from __future__ import annotations

from strata.checkpoint.weights import WeightReader
from strata.config import ModelConfig
from strata.model.block import Block


class DSparkHead:
    def __init__(self, cfg: ModelConfig, w: WeightReader) -> None:
        D, V, R = cfg.hidden_size, cfg.vocab_size, cfg.dspark_markov_rank
        n = cfg.num_nextn_predict_layers
        self.stages = [Block(cfg, cfg.n_layers + k, w, f"mtp.{k}") for k in range(n)]
        self.main_proj = w.linear("mtp.0.main_proj", D, len(cfg.dspark_target_layer_ids) * D)
        self.main_norm = w.float_tensor("mtp.0.main_norm.weight", (D,))
        last = f"mtp.{n - 1}"
        self.norm = w.float_tensor(f"{last}.norm.weight", (D,))
        self.markov_embed = w.tensor(f"{last}.markov_head.embed.weight", ("BF16", "F32"), (V, R))
        self.markov_head = w.tensor(f"{last}.markov_head.head.weight", ("BF16", "F32"), (V, R))
        self.confidence_proj = w.float_tensor(f"{last}.confidence_head.proj.weight", (1, D + R))
