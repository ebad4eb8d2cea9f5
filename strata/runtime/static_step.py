"""A forward of T tokens whose every input lives in a fixed device buffer: the region a CUDA
graph captures (embedding → layers → head) and replays at later positions.

Graph replay runs the captured kernels on the captured buffers, so each step's inputs must be
copied into the buffers the first step used: the token ids, the context's positions and Engram
row ids, one buffer (ForwardContext.inputs). `prepare` does that on the host (validation,
Engram hashing, one upload into that buffer); `run` is the
region — called directly it is an ordinary eager forward, under `torch.cuda.graph` it is what
gets captured; `finish` records the tokens in the state. The layers' ops do not depend on the
position within an entry bucket (strata/graph_check.py), so one capture serves every step of a
bucket.

Inside a journal (state.begin()) the region also saves the ring rows it displaces, as an eager
forward does; runtime/graphs.py re-files a replay's saved rows in the live journal. The
vendor's stale-index-key quirk is refused (it needs per-forward bookkeeping that a replay
does not run).
"""
from __future__ import annotations

import torch

from strata.model.context import ForwardContext
from strata.runtime.state import State


class StaticStep:
    def __init__(self, model, state: State, T: int, logits: str = "last", route=None) -> None:
        if model.numerics.vendor_stale_index_k:
            raise ValueError("a static step cannot reproduce the stale-index-key quirk")
        self.model, self.state, self.T, self.mode = model, state, T, logits
        # Where the stream enters and leaves (Model._forward's route): the model itself, or a
        # group rank's executor (receives it / sends it on; logits on rank 0 only).
        self.route = route or model
        self.ctx: ForwardContext | None = None  # the first step's: its buffers are the region's
        self.logits: torch.Tensor | None = None
        self._h = self._pre = None  # the stream between parts
        # disk tables: each layer's pinned staging for its records' copy (None on the CPU)
        self._staging: dict[int, torch.Tensor | None] = {}

    def prepare(self, tokens: torch.Tensor, records: bool = True) -> ForwardContext:
        """This step's inputs into the fixed buffers; returns the step's own context (for
        `finish`). The first call's context becomes the fixed one.
        `tokens` on the host, or on the model's GPU — a sampler's output the host has not
        read (Session.generate's plain loop runs a step ahead): then the inputs are uploaded
        with placeholder ids and the ids copied in after them on the stream (nothing read
        back), and the context's host tokens stay None until `finish` is given them. The
        GPU hashes the Engram ids from them — or, the tables on disk, `records` False: the
        host hashes them and reads each layer's records later (`engram_ids`, then
        `load_records` as the part holding the layer is launched)."""
        model, state = self.model, self.state
        later = not records and bool(model.engram_stores)
        on_device = tokens.device.type != "cpu"
        if on_device:
            if model.hasher is not None and not model.hashes_on_device and not later:
                raise ValueError("a step's tokens can stay on the device only where the GPU "
                                 "hashes the Engram ids, or with the tables on disk and "
                                 "their records read later (records=False)")
            device_tokens, tokens = tokens.view(-1), torch.zeros(tokens.numel(),
                                                                 dtype=torch.long)
        if later and self.ctx is None:
            raise ValueError("a static step's first inputs need their records (the "
                             "buffers are made from them)")
        tokens = model.check_forward(tokens, state, self.mode)
        if tokens.numel() != self.T:
            raise ValueError(f"this static step takes {self.T} tokens, got {tokens.numel()}")
        # (after the first step, uploaded straight into the first step's buffer)
        ctx = model.new_context(tokens, state, model.numerics,
                                None if self.ctx is None else self.ctx.inputs,
                                engram_ids=not later)
        if not later:
            self._copy_records(ctx, ctx.engram_ids)
        if self.ctx is None:
            self.ctx = ctx
        else:
            self.ctx.start = ctx.start  # (host bookkeeping only: no op reads it)
        if on_device:
            ctx.device_tokens.copy_(device_tokens)  # (the fixed buffer's ids: a view of it)
            ctx.tokens = None
        return ctx

    def engram_ids(self, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
        """The Engram row ids of a step prepared with records=False, from its tokens' host
        copy (hashed at the state's position, the step's): {layer: ids}."""
        return self.model._engram_ids(tokens, self.state)

    def load_records(self, ids: dict[int, torch.Tensor], layers: list[int]) -> None:
        """Disk tables, a step prepared with records=False: the records of `layers` (of its
        `engram_ids`) into the fixed buffers — queued on the stream, so the parts launched
        before run meanwhile."""
        self._copy_records(self.ctx, ids, layers)

    def _copy_records(self, ctx: ForwardContext, ids: dict[int, torch.Tensor],
                      layers=None) -> None:
        """Each disk table's records of `ids` read on the host (the store's cache and reads
        cannot run inside a graph) into a fixed device buffer the region dequantises —
        through pinned staging, so the copy queues behind the stream's work and the host
        goes on (the staging is rewritten a step later, when the copy is long done: the host
        has read that step's output since). `layers`: those only (default: every disk
        table's)."""
        stores = self.model.engram_stores
        for layer in stores if layers is None else layers:
            raw = torch.from_numpy(stores[layer].records(ids[layer]))
            if layer not in self._staging:
                ctx.engram_records[layer] = raw.to(self.model.device)
                self._staging[layer] = (torch.empty(raw.shape, dtype=raw.dtype,
                                                    pin_memory=True)
                                        if self.model.device.type == "cuda" else None)
                continue
            staging = self._staging[layer]
            if staging is None:
                self.ctx.engram_records[layer].copy_(raw)
            else:
                staging.copy_(raw)
                self.ctx.engram_records[layer].copy_(staging, non_blocking=True)

    def run(self) -> None:
        """The region: embedding, the layers, the head; logits into self.logits. Everything
        derived from the inputs is recomputed inside it (so a capture records it)."""
        for part in self.parts((len(self.model.layers),)):
            part()

    def parts(self, sizes: tuple[int, ...]) -> list:
        """The region as consecutive pieces — the stream's entry (the embedding, or a rank's
        receive) with the first layers, the next layers, …, the last ones with its exit (the
        head, or a rank's send) — which run one after another on the stream
        (h and pre handed on through self). `sizes`: the pieces' layer counts, the last one
        repeated. Each can be a graph of its own: replayed in order, the GPU runs one piece
        while the host launches the next."""
        model = self.model
        groups = self.groups(sizes)

        def part(i: int, group: list):
            def run() -> None:
                if i == 0:
                    self.ctx.reset_derived()
                    self._h, self._pre, _ = self.route.enter(self.ctx.device_tokens,
                                                             self.ctx, self.state)
                # (a step runs every row: its stream's context is the step's own)
                self._h, self._pre, _ = model.run_layers(self._h, self._pre, self.ctx,
                                                         self.state, blocks=group)
                if i == len(groups) - 1:
                    self.logits = self.route.leave(self._h, self._pre, self.ctx, self.state,
                                                   self.mode)
            return run
        return [part(i, g) for i, g in enumerate(groups)]

    def groups(self, sizes: tuple[int, ...]) -> list[list]:
        """The layers of each of `parts(sizes)` (one empty group for a model without any)."""
        blocks = self.model.layers
        groups, i, k = [], 0, 0
        while i < len(blocks):
            per = max(1, sizes[min(k, len(sizes) - 1)])
            groups.append(blocks[i:i + per])
            i, k = i + per, k + 1
        return groups or [[]]

    def finish(self, ctx: ForwardContext, tokens: torch.Tensor | None = None) -> None:
        """Record the step's tokens in the state (its position advances); `tokens`: their
        host copy, for a step prepared from tokens on the device."""
        if tokens is not None:
            ctx.tokens = tokens
        self.model.end_forward(ctx, self.state)
