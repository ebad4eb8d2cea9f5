"""The V4.1 text model: embed → blocks (mHC, attention, MoE, Engram) → collapse → norm → head.

`Model.forward(tokens, state)` consumes T new tokens at the state's position — decode (T=1),
verify (T=k) and prefill chunks are the same call — writes the state's caches and returns
logits for the requested rows. The caller brackets it with state.begin()/commit()/rollback().
"""
from __future__ import annotations

from pathlib import Path

import torch

from strata.checkpoint.loader import TensorLoader
from strata.checkpoint.safetensors_io import CheckpointFolder
from strata.checkpoint.weights import WeightReader
from strata.config import ModelConfig
from strata.engram_store import EngramDiskWeights, EngramStore
from strata.errors import ConfigError
from strata.model.block import Block
from strata.model.context import ForwardContext
from strata.model.dspark import DSparkHead
from strata.model.mhc import collapse
from strata.model.ngram_hash import NgramHashConfig, NgramHasher, token_map_cached
from strata.model.numerics import Numerics, rms_norm
from strata.runtime.state import State
from strata.tokenizer import tokenizer_path


class Model:
    def __init__(self, cfg: ModelConfig, w: WeightReader, numerics: Numerics,
                 hasher: NgramHasher | None) -> None:
        self.cfg, self.numerics, self.hasher = cfg, numerics, hasher
        self.device = w.device
        D, V = cfg.hidden_size, cfg.vocab_size
        self.embed = w.tensor("embed.weight", ("BF16", "F32"), (V, D))
        self.layers = [Block(cfg, l, w, f"layers.{l}") for l in range(cfg.n_layers)]
        self.norm = w.float_tensor("norm.weight", (D,))
        self.head = w.linear("head", V, D)
        self.dspark = DSparkHead(cfg, w) if cfg.num_nextn_predict_layers else None
        if cfg.engram_layer_ids and hasher is None:
            raise ConfigError("the config has Engram layers but no n-gram hasher was given")
        # Disk-resident tables, by layer: prefetch_engram starts their reads early.
        self.engram_stores = {b.layer: b.engram.table for b in self.layers
                              if b.engram is not None and isinstance(b.engram.table, EngramStore)}

    @classmethod
    def load(cls, model_dir: str | Path, device: torch.device | str = "cpu",
             numerics: Numerics | None = None, cache_dir: Path | None = None,
             loader: TensorLoader | None = None, engram: str = "device",
             engram_cache_bytes: int = 1 << 30, engram_options: dict | None = None) -> "Model":
        """Load a checkpoint folder; `loader` sets the staging pool and progress bar (it is
        closed when loading ends, successful or not).

        engram="device" loads the Engram tables to `device`; "disk" leaves them on disk behind
        strata.engram_store (engram_cache_bytes of row cache, split between the tables;
        engram_options: further EngramStore keywords such as io_threads, direct)."""
        if engram not in ("device", "disk"):
            raise ValueError(f"engram={engram!r}: expected 'device' or 'disk'")
        model_dir = Path(model_dir)
        cfg = ModelConfig.from_model_dir(model_dir)
        numerics = numerics or Numerics.for_device(device)
        hasher = None
        if cfg.engram_layer_ids:
            token_map, n_classes = token_map_cached(tokenizer_path(model_dir), cache_dir)
            if n_classes != cfg.engram_compressed_vocab_size:
                raise ConfigError(
                    f"{model_dir}: the tokenizer gives {n_classes} Engram token classes but "
                    f"engram_compressed_vocab_size is {cfg.engram_compressed_vocab_size}")
            if len(token_map) != cfg.vocab_size:
                raise ConfigError(f"{model_dir}: the tokenizer has {len(token_map)} ids but "
                                  f"vocab_size is {cfg.vocab_size}")
            hasher = NgramHasher(NgramHashConfig(
                layer_ids=list(cfg.engram_layer_ids), max_ngram=cfg.engram_max_ngram_size,
                n_heads=cfg.engram_n_heads, vocab_start=cfg.engram_vocab_size,
                pad_token_id=cfg.engram_pad_token_id,
                compressed_vocab=cfg.engram_compressed_vocab_size), token_map)
            for layer, rows in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings):
                if hasher.rows(layer) != rows:
                    raise ConfigError(
                        f"{model_dir}: Engram layer {layer} hashes into {hasher.rows(layer)} rows "
                        f"but engram_num_embeddings says {rows}")
        folder = CheckpointFolder(model_dir)
        folder.validate()  # every shard header, before any weight streams (fail early)
        loader = loader or TensorLoader(device)
        try:
            if engram == "disk":
                per_table = engram_cache_bytes // max(1, len(cfg.engram_layer_ids))
                w = EngramDiskWeights(folder, device, loader,
                                      store_options=dict(engram_options or {},
                                                         cache_bytes=per_table))
            else:
                w = WeightReader(folder, device, loader)
            # On error nothing half-built escapes: the exception propagates, no model returns.
            return cls(cfg, w, numerics, hasher)
        finally:
            loader.close()  # frees the staging buffers: no host copy of weights remains

    def prefetch_engram(self, tokens: torch.Tensor, state: State) -> None:
        """Start the disk reads for the Engram rows that forwarding `tokens` at state.position
        will need (the next token, or a draft block), so the forward waits less; a no-op when the
        tables are in memory. The ids hash exactly as in forward (same token history)."""
        if not self.engram_stores or self.hasher is None:
            return
        start = state.position
        hist = state.tokens[max(0, start - self.cfg.engram_max_ngram_size + 1):start]
        ids = self.hasher.ids(tokens.to(self.device).view(-1).long(), hist)
        for layer, store in self.engram_stores.items():
            store.prefetch(ids[layer])

    def new_state(self, capacity: int) -> State:
        return State(self.cfg, capacity, self.device, kv_dtype=self.numerics.act_dtype)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, state: State, logits: str = "all",
                numerics: Numerics | None = None) -> tuple[torch.Tensor | None, ForwardContext]:
        """Consume tokens [T] at positions state.position.. ; logits 'all' | 'last' | 'none'.

        Returns (logits [T or 1, V] fp32 or None, the forward's context with DSpark taps).
        """
        cfg = self.cfg
        nx = numerics or self.numerics
        if logits not in ("all", "last", "none"):
            raise ValueError(f"logits={logits!r}: expected 'all', 'last' or 'none'")
        tokens = tokens.to(self.device).view(-1)
        if tokens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"token ids must be integers, got {tokens.dtype}")
        tokens = tokens.long()
        T = tokens.numel()
        if T == 0:
            raise ValueError("forward needs at least one token")
        if int(tokens.min()) < 0 or int(tokens.max()) >= cfg.vocab_size:
            raise ValueError(f"token ids must be in 0..{cfg.vocab_size - 1}")
        state.check_room(T)
        # A forward that fails part-way must not leave half-written rings behind: without a
        # caller's snapshot, it journals its own writes and undoes them on error.
        own_journal = state.journal is None
        if own_journal:
            state.begin()
        try:
            out = self._forward(tokens, state, logits, nx)
        except BaseException:
            if own_journal:
                state.rollback()
            raise
        if own_journal:
            state.commit()
        return out

    def _forward(self, tokens: torch.Tensor, state: State, logits: str,
                 nx: Numerics) -> tuple[torch.Tensor | None, ForwardContext]:
        cfg = self.cfg
        T = tokens.numel()
        start = state.position
        positions = torch.arange(start, start + T, device=self.device)
        ctx = ForwardContext(cfg, nx, start, positions)
        if self.hasher is not None:
            hist = state.tokens[max(0, start - cfg.engram_max_ngram_size + 1):start]
            ctx.engram_ids = self.hasher.ids(tokens, hist)
            # Disk tables: start every Engram layer's reads now, so a later layer's rows
            # arrive while the layers before it compute (a no-op for rows already cached or
            # in flight from an earlier prefetch_engram).
            for layer, store in self.engram_stores.items():
                store.prefetch(ctx.engram_ids[layer])

        h = self.embed[tokens].to(nx.act_dtype)
        h = h[:, None, :].expand(T, cfg.hc_mult, cfg.hidden_size).contiguous()
        pre = torch.zeros((T, cfg.hc_mult), dtype=torch.float32, device=self.device)
        pre[:, 0] = 1.0
        for block in self.layers:
            h, pre = block.forward(h, pre, ctx, state)
        state.advance(tokens)
        if ctx.published_keys:
            state.stale_index_source = ctx.published_keys[-1]
        if logits == "none":
            return None, ctx
        if logits == "last":
            h, pre = h[-1:], pre[-1:]
        z = rms_norm(collapse(h, pre), self.norm, cfg.rms_norm_eps)
        return self.head(z, nx, torch.float32), ctx
