"""The per-forward context: what one forward's layers publish to later layers.

The vendor keeps these in a module-level `shared_attn`; here they are an explicit object made
fresh for every forward (the persistent part lives in runtime.state.State).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, TypeVar

import torch

from strata.config import ModelConfig
from strata.model.numerics import Numerics
from strata.model.rope import rope_cos_sin, rope_inv_freq

D = TypeVar("D")


@dataclass
class ForwardContext:
    cfg: ModelConfig
    numerics: Numerics
    start: int                      # absolute position of the first new token
    positions: torch.Tensor         # [T] absolute positions
    tokens: torch.Tensor | None = None  # [T] the token ids, on the host (the state's history)
    # Model.new_context: the forward's int64 inputs in one device buffer (one upload) — the
    # token ids [T], the positions [T], then each Engram layer's row ids [T, n_ids] — of
    # which `device_tokens`, `positions` and `engram_ids` are views
    inputs: torch.Tensor | None = None
    device_tokens: torch.Tensor | None = None
    engram_ids: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [T, n_ids]
    # layer -> a disk table's raw records of engram_ids, read before the forward (graphs only)
    engram_records: dict[int, torch.Tensor] = field(default_factory=dict)
    # Engram ids hashed on the device inside the forward (Model.new_context, tables in device
    # memory): the max_ngram − 1 ids before the tokens (a view of `inputs`, −1 before the
    # sequence's start) and the hasher (NgramHasher.device_ids); engram_ids_of hashes once
    engram_history: torch.Tensor | None = None
    engram_hasher: object | None = None
    # index-source layer -> [T, topk] selected compressed entries (ascending, -1 = empty)
    sel: dict[int, torch.Tensor] = field(default_factory=dict)
    # the candidate source's kept blocks [T, ≤ candidate_topk_blocks] (ascending, −1 = none)
    candidates: torch.Tensor | None = None
    published_keys: list[int] = field(default_factory=list)  # kv sources with new keys
    # DSpark taps: layer -> [n, D], the forward's last n rows (those the layer ran: all T but in
    # a decoder-skipping prefill)
    main_hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    # A layer split's kv-source entries passed through this rank for later ones (by carry name)
    relay: dict[str, torch.Tensor] = field(default_factory=dict)
    # A decoder-skipping prefill (Model.forward): the position from which the first decoder
    # layer runs its rows in full, each later one W − 1 rows later (Model.rows_from); None:
    # every layer runs every row.
    decoder_from: int | None = None
    # A context of some of a forward's rows (`rows`): the whole forward's context and where
    # these rows begin in it; None and 0 for the whole forward's own.
    root: ForwardContext | None = None
    offset: int = 0
    _derived: dict[tuple, object] = field(default_factory=dict)  # see `derived`

    @property
    def T(self) -> int:
        return self.positions.numel()

    @property
    def whole(self) -> ForwardContext:
        """The whole forward's context (this one, unless it holds only some of the rows)."""
        return self if self.root is None else self.root

    def rows(self, lo: int, hi: int) -> ForwardContext:
        """The context of this context's rows lo..hi−1, for the layers that run only those
        (a decoder-skipping prefill's decoder layers, Model.run_layers): their positions,
        token ids, Engram ids and the selections made so far, sliced; what the forward
        publishes to its end (the DSpark taps, the kv sources with new keys, a layer split's
        relayed entries) shared with the whole; what a forward derives, derived anew."""
        if (lo, hi) == (0, self.T):
            return self
        ids = self.engram_id_map() if self.cfg.engram_layer_ids else {}
        return ForwardContext(
            self.cfg, self.numerics, self.start + lo, self.positions[lo:hi],
            tokens=None if self.tokens is None else self.tokens[lo:hi],
            device_tokens=None if self.device_tokens is None else self.device_tokens[lo:hi],
            engram_ids={l: v[lo:hi] for l, v in ids.items()},
            engram_records={l: v[lo:hi] for l, v in self.engram_records.items()},
            sel={l: v[lo:hi] for l, v in self.sel.items()},
            candidates=None if self.candidates is None else self.candidates[lo:hi],
            published_keys=self.published_keys, main_hidden=self.main_hidden,
            relay=self.relay, decoder_from=self.decoder_from, root=self.whole,
            offset=self.offset + lo)

    def reset_derived(self) -> None:
        """Forget what a forward derived (RoPE tables, selections, candidate blocks, DSpark
        taps, published keys) and keep its inputs (positions, Engram ids and records): the
        context can then serve another forward whose inputs were copied into it
        (runtime/static_step)."""
        self._derived.clear()
        self.sel.clear()
        self.candidates = None
        self.published_keys.clear()
        self.main_hidden.clear()
        self.relay.clear()

    def engram_ids_of(self, layer: int) -> torch.Tensor:
        """An Engram layer's row ids [T, n_ids]: uploaded with the inputs (hashed on the host),
        or hashed on the device — every layer's at the first ask, in one launch (derived:
        a graphed region hashes inside it)."""
        return self.engram_id_map()[layer]

    def engram_id_map(self) -> dict[int, torch.Tensor]:
        """Every Engram layer's row ids (engram_ids_of)."""
        if self.engram_hasher is None:
            return self.engram_ids
        return self.derived(("engram_ids",), lambda: self.engram_hasher.device_ids(
            self.engram_history, self.device_tokens))

    def derived(self, key: tuple, make: Callable[[], D]) -> D:
        """What every layer of this forward derives alike from its inputs (RoPE tables, the
        window, a ratio's entry indices, the entries each query sees…): make() at the first
        ask, then the same value — small device ops once a forward instead of once a layer."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def inv_freq(self, ratio: int) -> torch.Tensor:
        return rope_inv_freq(self.cfg, ratio, self.positions.device)

    def rope(self, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin at this forward's positions for the table of a layer of this ratio."""
        return self.derived(("rope", ratio > 0),
                            lambda: rope_cos_sin(self.inv_freq(ratio), self.positions))

    def rope_at(self, ratio: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(self.inv_freq(ratio), positions)

    def window(self, W: int, ring_size: int) -> tuple[torch.Tensor, ...]:
        """Each query's W most recent positions and where they live, the same for every layer
        of the forward (made once, not per layer): kpos [T, W] (position order), existing
        (kpos ≥ 0), in_chunk (this forward's rows), row (the row of this forward's kv that
        holds it, where in_chunk) and slot (the ring slot, otherwise)."""
        def make():
            p = self.positions
            first = p[:1]  # (a device tensor: the ops do not depend on the position)
            kpos = p[:, None] - (W - 1) + torch.arange(W, device=p.device)[None]
            return (kpos, kpos >= 0, kpos >= first, (kpos - first).clamp(min=0),
                    kpos.clamp(min=0) % ring_size)
        return self.derived(("window", W, ring_size), make)
