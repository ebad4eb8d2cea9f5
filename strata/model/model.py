"""The V4.1 text model: embed → blocks (mHC, attention, MoE, Engram) → collapse → norm → head.

`Model.forward(tokens, state)` consumes T new tokens at the state's position — decode (T=1),
verify (T=k) and prefill chunks are the same call — writes the state's caches and returns
logits for the requested rows. The caller brackets it with state.begin()/commit()/rollback().
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from strata.checkpoint.loader import TensorLoader
from strata.checkpoint.pack import open_checkpoint
from strata.checkpoint.weights import WeightReader
from strata.config import ModelConfig
from strata.current_device import made_current, upload
from strata.engram_store import EngramDiskWeights
from strata.errors import ConfigError
from strata.kernels import engram as engram_kernels
from strata.model.block import Block
from strata.model.context import ForwardContext
from strata.model.dspark import DSparkHead
from strata.model.mhc import collapse_norm
from strata.model.ngram_hash import NgramHashConfig, NgramHasher, token_map_cached
from strata.model.numerics import Numerics
from strata.runtime.state import State, entry_bucket
from strata.tokenizer import tokenizer_path
from strata.trace import scope


@dataclass(frozen=True)
class ModelPart:
    """What one process of a multi-device group holds (runtime/parallel.py); the default is
    the whole model. `layers`: the backbone layers (None: all); `embed`: the token embedding;
    `head`: final norm, head and DSpark stages; `wrap_reader`: applied to the weight reader
    before anything loads (tensor parallelism loads only its shards through it)."""

    layers: Sequence[int] | None = None
    embed: bool = True
    head: bool = True
    wrap_reader: Callable[[WeightReader], WeightReader] | None = None


class Model:
    def __init__(self, cfg: ModelConfig, w: WeightReader, numerics: Numerics,
                 hasher: NgramHasher | None, part: ModelPart | None = None) -> None:
        self.cfg, self.numerics, self.hasher = cfg, numerics, hasher
        # the last host hash of Engram ids: (tokens, history) → ids (`_engram_ids`)
        self._hashed: tuple[tuple, dict[int, torch.Tensor]] | None = None
        self.part = part = part or ModelPart()
        self.device = w.device
        D, V = cfg.hidden_size, cfg.vocab_size
        self.embed = w.tensor("embed.weight", ("BF16", "F32"), (V, D)) if part.embed else None
        # The blocks held, in layer order (all of them unless a part says otherwise).
        ids = range(cfg.n_layers) if part.layers is None else sorted(part.layers)
        self.layers = [Block(cfg, l, w, f"layers.{l}") for l in ids]
        self.norm = w.float_tensor("norm.weight", (D,)) if part.head else None
        self.head = w.linear("head", V, D) if part.head else None
        self.dspark = DSparkHead(cfg, w) if part.head and cfg.num_nextn_predict_layers else None
        if cfg.engram_layer_ids and hasher is None:
            raise ConfigError("the config has Engram layers but no n-gram hasher was given")
        # Disk-resident tables, by layer: prefetch_engram starts their reads early.
        self.engram_stores = {b.layer: b.engram.table for b in self.layers
                              if b.engram is not None and getattr(b.engram.table, "prefetches",
                                                                  False)}
        # The indexers' ratios: their scored-entry buckets shape a forward's ops — the held
        # layers' and, in a layer split, the candidate mask that crosses ranks; taken from the
        # config, so that every rank's graphs change bucket at the same forwards.
        self.index_ratios = sorted({cfg.ratio(l) for l in cfg.index_source_layer_ids})
        # Model.load(draft_experts="cache"): the ExpertCache holding the draft stages' experts.
        self.draft_expert_cache = None

    @classmethod
    def load(cls, model_dir: str | Path, device: torch.device | str = "cpu",
             numerics: Numerics | None = None, cache_dir: Path | None = None,
             loader: TensorLoader | None = None, engram: str = "device",
             engram_cache_bytes: int = 1 << 30, engram_options: dict | None = None,
             verify: str = "size", part: ModelPart | None = None,
             draft_experts: str = "device", draft_cache_bytes: int | None = None) -> "Model":
        """Load a checkpoint folder; `loader` sets the staging pool and progress bar (it is
        closed when loading ends, successful or not).

        engram="device" loads the Engram tables to `device`; "disk" leaves them on disk behind
        strata.engram_store (engram_cache_bytes of row cache, split between the tables;
        engram_options: further EngramStore keywords such as io_threads, direct).

        `model_dir` may be a checkpoint folder or a runtime pack (`strata pack`); a pack is
        checked against its manifest before any weight streams: verify="size" (sizes, and
        checksums of files changed since packing), "full" (every checksum) or "none".

        draft_experts="cache" keeps the DSpark stages' routed experts off the device, brought
        in per draft step through a bounded cache (runtime.expert_cache; draft_cache_bytes,
        default 1 GiB or more with free device memory) — for when they do not fit beside the
        backbone. Drafts are bit-identical either way."""
        if engram not in ("device", "disk"):
            raise ValueError(f"engram={engram!r}: expected 'device' or 'disk'")
        if draft_experts not in ("device", "cache"):
            raise ValueError(f"draft_experts={draft_experts!r}: expected 'device' or 'cache'")
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
        # A pack: files vs manifest; either way every header, before any weight streams.
        folder = open_checkpoint(model_dir, verify=verify)
        loader = loader or TensorLoader(device)
        try:
            if engram == "disk":
                per_table = engram_cache_bytes // max(1, len(cfg.engram_layer_ids))
                w = EngramDiskWeights(folder, device, loader,
                                      store_options=dict(engram_options or {},
                                                         cache_bytes=per_table))
            else:
                w = WeightReader(folder, device, loader)
            if part is not None and part.wrap_reader is not None:
                w = part.wrap_reader(w)
            draft_cache = None
            if draft_experts == "cache" and cfg.num_nextn_predict_layers:
                from strata.runtime.expert_cache import DraftExpertReader
                w = DraftExpertReader(w, draft_cache_bytes)
                draft_cache = w.cache
            # On error nothing half-built escapes: the exception propagates, no model returns.
            model = cls(cfg, w, numerics, hasher, part)
            model.draft_expert_cache = draft_cache
            return model
        finally:
            loader.close()  # frees the staging buffers: no host copy of weights remains

    def prefetch_engram(self, tokens: torch.Tensor, state: State) -> None:
        """Start the disk reads for the Engram rows that forwarding `tokens` at state.position
        will need (the next token, or a draft block), so the forward waits less; a no-op when the
        tables are in memory. The ids hash exactly as in forward (same token history)."""
        if not self.engram_stores or self.hasher is None:
            return
        ids = self._engram_ids(tokens.view(-1).long().cpu(), state)
        for layer, store in self.engram_stores.items():
            store.prefetch(ids[layer])

    def _engram_ids(self, tokens: torch.Tensor, state: State) -> dict[int, torch.Tensor]:
        """The host hash of tokens [T] at state.position: {layer: ids [T, width]} — the last
        one remembered, since a decode step hashes its token twice (prefetch_engram as the
        token is handed over, then the forward; ~30 µs each on the host, with the GPU idle
        when the tables are on disk). A pure function of the tokens and their history."""
        history = self._history(state)
        key = (tuple(tokens.tolist()), tuple(history.tolist()))
        hashed = self._hashed  # (read once: one tuple, whichever thread last replaced it)
        if hashed is None or hashed[0] != key:
            hashed = self._hashed = key, self.hasher.ids(tokens, history)
        return hashed[1]

    def new_state(self, capacity: int) -> State:
        return State(self.cfg, capacity, self.device, kv_dtype=self.numerics.act_dtype,
                     layers=self.part.layers, dspark=self.dspark is not None)

    @property
    def decoder_start(self) -> int | None:
        """The first decoder layer when the model has V4.1's encoder-decoder shape (one ratio-1
        kv source that every later layer reads, nothing else kept per row past it but window
        rings), else None. Its rows far from a prefill's end need not run past it: see
        prefill_reach."""
        cfg = self.cfg
        ds = cfg.candidate_source_layer_id
        if ds is None or ds not in cfg.kv_source_layer_ids:
            return None
        later = range(ds, cfg.n_layers)
        if any(cfg.compress_ratios[l] != 1 or cfg.kv_source_of(l) != ds for l in later):
            return None
        return ds

    @property
    def prefill_reach(self) -> int:
        """Rows before a prefill's end that the decoder layers must run for an exact result:
        a decoder row reads only the W rows before it at its own layer (plus the source's
        compressed entries, published for every row), so a row is exact at every decoder
        layer once (decoder layers)·W full rows precede it. Adding a whole window ring's rows
        makes every row a ring can still hold exact, so any later truncation the rings allow
        (State.can_truncate) continues exactly, and the DSpark windows are exact too."""
        from strata.runtime.placement import ring_rows
        W = self.cfg.sliding_window
        return (self.cfg.n_layers - self.decoder_start) * W + ring_rows(self.cfg)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, state: State, logits: str = "all",
                numerics: Numerics | None = None,
                decoder: bool = True) -> tuple[torch.Tensor | None, ForwardContext]:
        """Consume tokens [T] at positions state.position.. ; logits 'all' | 'last' | 'none'.

        decoder=False (prefill rows at least `prefill_reach` before the prompt's end, logits
        'none'): the encoder layers run in full, the first decoder layer only publishes the
        compressed entries and index keys every later row reads, and the other decoder layers
        are skipped — what follows is bit-identical to running them (tests/test_prefill_skip.py).

        Returns (logits [T or 1, V] fp32 or None, the forward's context with DSpark taps).
        """
        nx = numerics or self.numerics
        tokens = self.check_forward(tokens, state, logits)
        if not decoder and (logits != "none" or self.decoder_start is None):
            raise ValueError("decoder=False needs logits='none' and a model with an "
                             "encoder-decoder split (Model.decoder_start)")
        # A forward that fails part-way must not leave half-written rings behind: without a
        # caller's snapshot, it journals its own writes and undoes them on error.
        own_journal = state.journal is None
        if own_journal:
            state.begin()
        try:
            with made_current(self.device):
                out = self._forward(tokens, state, logits, nx, decoder)
        except BaseException:
            if own_journal:
                state.rollback()
            raise
        if own_journal:
            state.commit()
        return out

    def graphed(self, state: State):
        """Forwards on `state` replayed from CUDA graphs (runtime/graphs.py), kept on the
        state: a retained conversation state reuses its captures in the next request."""
        from strata.runtime.graphs import GraphedForward
        if state.graphs is None or state.graphs.model is not self:
            state.graphs = GraphedForward(self, state)
        return state.graphs

    def graph_key(self, start: int, T: int) -> tuple[int, ...]:
        """What, besides T and the logits mode, the ops of a forward of T rows at `start`
        depend on: the entry bucket each held indexer scores (runtime/graphs.py)."""
        return tuple(entry_bucket((start + T) // r) for r in self.index_ratios)

    def check_forward(self, tokens: torch.Tensor, state: State, logits: str) -> torch.Tensor:
        """The forward's arguments checked (before anything runs); tokens as int64 [T] on
        the host."""
        cfg = self.cfg
        if logits not in ("all", "last", "none"):
            raise ValueError(f"logits={logits!r}: expected 'all', 'last' or 'none'")
        tokens = tokens.view(-1)
        if tokens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"token ids must be integers, got {tokens.dtype}")
        T = tokens.numel()
        if T == 0:
            raise ValueError("forward needs at least one token")
        # Checked where the ids are (the host, for every caller here): a check on the device
        # would wait for all the work queued before it. They stay there (the state's token
        # history is host work); the forward moves them to the device.
        tokens = tokens.cpu().long()
        ids = tokens.numpy()  # (numpy: a decode step's host time is its GPU's idle time)
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(f"token ids must be in 0..{cfg.vocab_size - 1}")
        state.check_room(T)
        return tokens

    def _forward(self, tokens: torch.Tensor, state: State, logits: str, nx: Numerics,
                 decoder: bool = True, route=None) -> tuple[torch.Tensor | None, ForwardContext]:
        """The forward's pieces in order; `route` (default: this model) says where the
        stream comes from and goes to — a multi-device rank's executor receives and sends it."""
        route = route or self
        with scope("embed"):
            ctx = self.new_context(tokens.cpu(), state, nx)
        h, pre = route.enter(ctx.device_tokens, ctx, state, decoder)
        h, pre = self.run_layers(h, pre, ctx, state, decoder)
        out = route.leave(h, pre, ctx, state, logits, decoder)
        self.end_forward(ctx, state)
        return out, ctx

    # -- the pieces of a forward: a multi-device group runs them on different ranks --------
    # (runtime/parallel.py: embed on the first, a contiguous layer range on each, the head on
    # the first again; the stream h, the lagged pre and the context cross between them.)
    # A route's two ends (Model._forward): a whole model embeds the tokens and computes the
    # logits; a rank of a group receives and sends the stream instead (its executor).
    def enter(self, tokens: torch.Tensor, ctx: ForwardContext, state: State,
              decoder: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        with scope("embed"):
            return self.embed_stream(tokens, ctx.numerics)

    def leave(self, h: torch.Tensor, pre: torch.Tensor, ctx: ForwardContext, state: State,
              logits: str, decoder: bool = True) -> torch.Tensor | None:
        with scope("head"):
            return self.logits(h, pre, logits, ctx.numerics)

    def new_context(self, tokens: torch.Tensor, state: State, nx: Numerics,
                    inputs: torch.Tensor | None = None,
                    engram_ids: bool = True) -> ForwardContext:
        """A fresh context for tokens [T] (int64, on the host) at state.position: the token
        ids, positions and the Engram row ids — or, hashing on the device, the ids before
        the tokens — made on the host and uploaded in one copy (ForwardContext.inputs; into
        `inputs` if given — a graphed step's fixed buffer) — each small upload or device op
        costs a decode step's idle GPU a launch. `engram_ids` False, hashing on the host:
        placeholder ids (a graphed step with the tables on disk: its ids hashed and its
        records read later, StaticStep.engram_ids / load_records)."""
        T = tokens.numel()
        start = state.position
        # (assembled in numpy: a decode step's ~15 small torch ops on the host cost ~250 µs
        # that its GPU sat idle through, scripts/probe_host.py)
        parts = [tokens.numpy(), np.arange(start, start + T)]
        ids, on_device = {}, self.hasher is not None and self.hashes_on_device
        if on_device:  # the ids before the tokens, −1 before the start: hashed in the forward
            history = self._history(state).numpy()
            parts += [np.full(self.cfg.engram_max_ngram_size - 1 - history.size, -1), history]
        elif self.hasher is not None and not engram_ids:
            ids = {layer: torch.zeros((T, self.hasher.width), dtype=torch.long)
                   for layer in self.cfg.engram_layer_ids}
            parts += [v.reshape(-1).numpy() for v in ids.values()]
        elif self.hasher is not None:
            # Hashed on the host, where the tokens and their history are (disk tables: their
            # reads start here; CPU models).
            ids = self._engram_ids(tokens, state)
            # Disk tables: start every Engram layer's reads now, so a later layer's rows
            # arrive while the layers before it compute (a no-op for rows already cached or
            # in flight from an earlier prefetch_engram).
            for layer, store in self.engram_stores.items():
                store.prefetch(ids[layer])
            parts += [v.reshape(-1).numpy() for v in ids.values()]
        inputs = upload(torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False)),
                        self.device, inputs)
        ctx = ForwardContext(self.cfg, nx, start, inputs[T:2 * T], tokens, inputs=inputs,
                             device_tokens=inputs[:T])
        at = 2 * T
        if on_device:
            ctx.engram_history, ctx.engram_hasher = inputs[at:], self.hasher
        for layer, v in ids.items():
            ctx.engram_ids[layer] = inputs[at:at + v.numel()].view(v.shape)
            at += v.numel()
        return ctx

    @property
    def hashes_on_device(self) -> bool:
        """Engram ids hashed inside the forward on the GPU (strata.kernels.engram.ngram_ids):
        tables in device memory, a CUDA device. On the host the hash took a graphed decode
        step ~150–200 µs (of ~650 µs the GPU idles between steps, scripts/probe_host.py)."""
        return not self.engram_stores and engram_kernels.available_on(self.device)

    def _history(self, state: State) -> torch.Tensor:
        """The committed tokens an n-gram at state.position reaches back to (host)."""
        start = state.position
        return state.tokens[max(0, start - self.cfg.engram_max_ngram_size + 1):start]

    def embed_stream(self, tokens: torch.Tensor, nx: Numerics) -> tuple[torch.Tensor, torch.Tensor]:
        """The initial stream h [T, H, D] (every copy the embedding) and pre = one-hot(0)."""
        cfg = self.cfg
        T = tokens.numel()
        h = self.embed[tokens].to(nx.act_dtype)
        h = h[:, None, :].expand(T, cfg.hc_mult, cfg.hidden_size).contiguous()
        pre = torch.zeros((T, cfg.hc_mult), dtype=torch.float32, device=self.device)
        pre[:, 0].fill_(1.0)
        return h, pre

    def run_layers(self, h: torch.Tensor, pre: torch.Tensor, ctx: ForwardContext,
                   state: State, decoder: bool = True,
                   blocks: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The held blocks (or `blocks`, consecutive ones of them) in order: (h, pre) in,
        (h, last block's FFN pre) out.
        decoder=False: stop at the first decoder layer after it publishes (see forward)."""
        for block in self.layers if blocks is None else blocks:
            if not decoder and block.layer >= self.decoder_start:
                if block.layer == self.decoder_start:
                    block.publish(h, pre, ctx, state)
                continue
            h, pre = block.forward(h, pre, ctx, state)
        return h, pre

    def end_forward(self, ctx: ForwardContext, state: State) -> None:
        """Record the forward's tokens in the state (the caller commits or rolls back)."""
        state.advance(ctx.tokens)
        if ctx.published_keys:
            state.stale_index_source = ctx.published_keys[-1]

    def logits(self, h: torch.Tensor, pre: torch.Tensor, logits: str,
               nx: Numerics) -> torch.Tensor | None:
        """Final collapse → norm → head for the requested rows ('all' | 'last' | 'none')."""
        if logits == "none":
            return None
        if logits == "last":
            h, pre = h[-1:], pre[-1:]
        z = collapse_norm(h, pre, self.norm, self.cfg.rms_norm_eps)
        return self.head(z, nx, torch.float32)
