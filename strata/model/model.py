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
from strata.device_memory import DeviceMemory, device_memory
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

    def memory(self, reset_peak: bool = False) -> list[DeviceMemory]:
        """This model's devices' memory (one here; ParallelModel.memory: every rank's)."""
        return [device_memory(self.device, reset_peak)]

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
        """Rows before a prefill's end from which its decoder layers run (rows_from): the
        last decoder layer runs the last R rows (R: a window ring's rows), each layer before
        it W − 1 rows more, so a reach of R + (decoder layers − 1)·(W − 1).

        Why that is exact: a decoder row reads only its own layer's W most recent rows (plus
        the source's compressed entries, which the first decoder layer publishes for every
        row). The first decoder layer's input, the encoder's output, is exact at every row,
        so its rows from the reach on are exact in its window ring and exact in its output
        from W − 1 rows later, where the next layer starts, and so on. Every layer thus holds
        exact rows in the R slots of its ring — what a full prefill leaves there — so any
        truncation the rings allow (State.can_truncate) continues exactly, and the DSpark
        windows, made of the last layers' inputs, are exact too."""
        from strata.runtime.placement import ring_rows
        n_dec = self.cfg.n_layers - self.decoder_start
        return ring_rows(self.cfg) + (n_dec - 1) * (self.cfg.sliding_window - 1)

    def rows_from(self, layer: int, start: int, T: int, decoder_from: int | None) -> int:
        """The first of a forward's T rows (at positions start..) that `layer` runs in full
        (T: none of them). Every row, except in a decoder-skipping prefill (decoder_from,
        see forward): decoder layer decoder_start + i runs the rows from position
        decoder_from + i·(W − 1) on (prefill_reach says why that is exact)."""
        ds = self.decoder_start
        if decoder_from is None or ds is None or layer < ds:
            return 0
        first = decoder_from + (layer - ds) * (self.cfg.sliding_window - 1)
        return min(T, max(0, first - start))

    def check_decoder_from(self, start: int, T: int, logits: str,
                           decoder_from: int | None) -> None:
        """A decoder-skipping forward's arguments checked: the model must have an encoder-
        decoder split, and the rows the logits need must run the last layer."""
        if decoder_from is None:
            return
        if self.decoder_start is None:
            raise ValueError("decoder_from needs a model with an encoder-decoder split "
                             "(Model.decoder_start)")
        first = self.rows_from(self.cfg.n_layers - 1, start, T, decoder_from)
        need = {"all": 0, "last": T - 1, "none": T}[logits]
        if first > need:
            raise ValueError(f"logits={logits!r} needs rows that decoder_from={decoder_from} "
                             f"skips: the last layer runs positions from {start + first} on "
                             f"(this forward: {start}..{start + T - 1})")

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, state: State, logits: str = "all",
                numerics: Numerics | None = None,
                decoder_from: int | None = None) -> tuple[torch.Tensor | None, ForwardContext]:
        """Consume tokens [T] at positions state.position.. ; logits 'all' | 'last' | 'none'.

        decoder_from (a decoder-skipping prefill: the prompt's end minus prefill_reach, the
        same for each of its forwards): the encoder layers run every row; decoder layer
        decoder_start + i only the rows from position decoder_from + i·(W − 1) on (rows_from),
        the first decoder layer publishing the compressed entries and index keys of the rows
        before them, which every later row reads — what follows is bit-identical to running
        every row (tests/test_prefill_skip.py).

        Returns (logits [T or 1, V] fp32 or None, the forward's context with DSpark taps).
        """
        nx = numerics or self.numerics
        tokens = self.check_forward(tokens, state, logits)
        self.check_decoder_from(state.position, tokens.numel(), logits, decoder_from)
        # A forward that fails part-way must not leave half-written rings behind: without a
        # caller's snapshot, it journals its own writes and undoes them on error.
        own_journal = state.journal is None
        if own_journal:
            state.begin()
        try:
            with made_current(self.device):
                out = self._forward(tokens, state, logits, nx, decoder_from)
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
                 decoder_from: int | None = None,
                 route=None) -> tuple[torch.Tensor | None, ForwardContext]:
        """The forward's pieces in order; `route` (default: this model) says where the
        stream comes from and goes to — a multi-device rank's executor receives and sends it."""
        route = route or self
        with scope("embed"):
            ctx = self.new_context(tokens.cpu(), state, nx)
        ctx.decoder_from = decoder_from
        h, pre, rows = route.enter(ctx.device_tokens, ctx, state)
        h, pre, rows = self.run_layers(h, pre, rows, state)
        out = route.leave(h, pre, rows, state, logits)
        self.end_forward(ctx, state)
        return out, ctx

    # -- the pieces of a forward: a multi-device group runs them on different ranks --------
    # (runtime/parallel.py: embed on the first, a contiguous layer range on each, the head on
    # the first again; the stream h, the lagged pre and the context cross between them.)
    # A route's two ends (Model._forward): a whole model embeds the tokens and computes the
    # logits; a rank of a group receives and sends the stream instead (its executor). The
    # stream's rows are those of a context (ForwardContext.rows: fewer than the forward's in
    # a decoder-skipping prefill's decoder layers), which each end takes or gives with it.
    def enter(self, tokens: torch.Tensor, ctx: ForwardContext,
              state: State) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        with scope("embed"):
            return (*self.embed_stream(tokens, ctx.numerics), ctx)

    def leave(self, h: torch.Tensor, pre: torch.Tensor, rows: ForwardContext, state: State,
              logits: str) -> torch.Tensor | None:
        with scope("head"):
            return self.logits(h, pre, logits, rows.numerics)

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

    def run_layers(self, h: torch.Tensor, pre: torch.Tensor, rows: ForwardContext,
                   state: State, blocks: list | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        """The held blocks (or `blocks`, consecutive ones of them) in order: (h, pre) of the
        context `rows`'s rows in, (h, last block's FFN pre, their context) out. In a
        decoder-skipping prefill each decoder layer drops the rows it does not run
        (rows_from; the first decoder layer publishes theirs first): the rows out are then
        the forward's last few, or none."""
        whole = rows.whole
        for block in self.layers if blocks is None else blocks:
            k = self.rows_from(block.layer, whole.start, whole.T, whole.decoder_from) - rows.offset
            if k > 0:
                if block.layer == self.decoder_start:
                    block.publish(h[:k], pre[:k], rows.rows(0, k), state)
                h, pre, rows = h[k:], pre[k:], rows.rows(k, rows.T)
            if rows.T:
                h, pre = block.forward(h, pre, rows, state)
        return h, pre, rows

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
