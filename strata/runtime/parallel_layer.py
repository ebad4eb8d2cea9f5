"""Layer split: each rank runs a contiguous range of backbone layers (runtime/parallel.py).

Rank 0 holds the embedding, its layers, the final norm, the head and the DSpark stages; rank r
holds layers ranges[r] and their caches. A forward travels as a ring of point-to-point
messages: rank 0 embeds and runs its layers, sends the carry to rank 1, ..., the last rank sends
the final rows back to rank 0, which computes the logits. Each hop is one message, a flat byte
buffer whose layout both sides derive from (T, the candidate mask's entry bucket, the split) —
no metadata crosses, and no host value of the position shapes it, so each rank's share of a
forward can be captured in a CUDA graph (the executor is the route of Model._forward: its
`enter` receives the stream, its `leave` sends it on).

What crosses a boundary after rank r (the carry):
- h [n, H, D] (the 4-copy hyper-connection stream) and pre [n, H] (the lagged collapse weights
  of the last FFN, spec §2.2) of the rows rank r's last layer ran: all T, but the last few in
  a decoder-skipping prefill's decoder layers (Model.rows_from);
- the forward's shared context that layers past the boundary read: the latest published top-k
  (`sel` of the most recent index source before the boundary, read by later reuse layers), the
  candidate-block mask (layer 20's, read by reindex layers), and the DSpark taps
  (`main_hidden`, each of its layer's rows) produced by ranks > 0, which go on to rank 0
  where the draft head lives;
- the compressed-KV and index-key entries this forward wrote for kv-source layers that later
  ranks read (layers 2/8/14/20 feed the layers after them, which may live on the next rank):
  the compressor's m entries from the group of the forward's first row (⌈T/r⌉, or T at ratio 1;
  the last may be unfinished and is invisible until a later forward completes it — the sender
  holds the same row); the receiving rank keeps its own copy of those caches in its State at the
  same absolute indices, so nothing else ever has to cross and rollback needs nothing (entries
  past the position are invisible).
The final message (last rank → rank 0) holds the rows the logits need ('all': T, 'last': 1,
'none': 0), their pre and the taps. (The list of kv sources that published keys does not
cross: only the vendor's stale-index-key quirk reads it, which the layer split refuses.)

Numerics are untouched: every rank runs the same code on the same values as a single device.
"""
from __future__ import annotations

import torch

from strata.model.compressor import entries_written, forward_entries
from strata.model.context import ForwardContext
from strata.model.model import Model
from strata.model.numerics import Numerics
from strata.runtime.parallel_comm import Comm
from strata.runtime.state import State, cache_sources, entry_bucket

ALIGN = 16


class Layout:
    """Named pieces of a flat byte buffer, each aligned so it can be viewed in place."""

    def __init__(self, pieces: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        self.pieces, self.offsets, n = pieces, {}, 0
        for name, shape, dtype in pieces:
            size = dtype.itemsize
            for d in shape:
                size *= d
            self.offsets[name] = (n, size)
            n += -(-size // ALIGN) * ALIGN
        self.nbytes = n

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for name, shape, dtype in self.pieces:
            o, size = self.offsets[name]
            out[name] = buf[o:o + size].view(dtype).view(shape)
        return out

    def pack(self, values: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
        buf = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        for name, view in self.views(buf).items():
            view.copy_(values[name])
        return buf


class LayerExecutor:
    """The forward of one rank of a layer split (every rank builds the same one)."""

    def __init__(self, model: Model, comm: Comm, ranges: list[range]) -> None:
        self.m, self.comm, self.ranges = model, comm, ranges
        self.rank, self.world = comm.rank, len(ranges)
        self.last = self.world - 1
        cfg = self.cfg = model.cfg
        self.reads = [cache_sources(cfg, r) for r in ranges]
        self.kv_dtype = model.numerics.act_dtype  # the States' cache dtype (Model.new_state)
        self.taps_from = ranges[1].start if cfg.num_nextn_predict_layers else cfg.n_layers

    # ---- what crosses each boundary -----------------------------------------------------------
    def _needed_after(self, r: int) -> set[int]:
        out: set[int] = set()
        for reads in self.reads[r + 1:]:
            out |= reads
        return out

    def _rows(self, layer: int, ctx: ForwardContext) -> int:
        """How many of the forward's (last) rows a layer runs: all but in a decoder-skipping
        prefill (Model.rows_from)."""
        return ctx.T - self.m.rows_from(layer, ctx.start, ctx.T, ctx.decoder_from)

    def _carry_layout(self, r: int, ctx: ForwardContext) -> Layout:
        """The message rank r sends to rank r+1 (what the layers after it that run read; the
        kv-source entries go on either way: later ranks keep them for later forwards), for
        the forward of `ctx` (the whole). Its shape depends on T, the candidate source's
        entry bucket and the decoder skip's rows only, never on the position within the
        bucket: a rank's forward can be captured in a CUDA graph. The stream and the
        selections are of the rows rank r's last layer ran (its last n)."""
        cfg, T, start = self.cfg, ctx.T, ctx.start
        hi = self.ranges[r].stop
        n = self._rows(hi - 1, ctx)
        later = [l for l in range(hi, cfg.n_layers) if self._rows(l, ctx)]
        pieces = self._stream(n, ctx.numerics)
        done = [s for s in cfg.index_source_layer_ids if s < hi]
        if done and any(cfg.ratio(l) > 0 and cfg.index_source_of(l) == done[-1] for l in later):
            pieces.append((f"sel.{done[-1]}", (n, cfg.index_topk), torch.int64))
        c = cfg.candidate_source_layer_id
        if cfg.candidates_enabled and c < hi and any(cfg.is_reindex(l) for l in later):
            nb = -(-entry_bucket((start + T) // cfg.ratio(c)) // cfg.candidate_block_size)
            pieces.append(("cand", (n, min(cfg.candidate_topk_blocks, nb)), torch.int64))
        for s in sorted(self._needed_after(r)):
            if s < hi:
                m = entries_written(cfg.ratio(s), T)
                pieces.append((f"kv.{s}", (m, cfg.head_dim), self.kv_dtype))
                if cfg.is_index_source(s):
                    pieces.append((f"ik.{s}", (m, cfg.index_head_dim), self.kv_dtype))
        pieces += self._taps(ctx, hi)
        return Layout(pieces)

    def _final_layout(self, ctx: ForwardContext, logits: str) -> Layout:
        """The message the last rank sends back to rank 0."""
        n = {"all": ctx.T, "last": 1, "none": 0}[logits]
        return Layout(self._stream(n, ctx.numerics) + self._taps(ctx, self.cfg.n_layers))

    def _stream(self, n: int, nx: Numerics):
        H, D = self.cfg.hc_mult, self.cfg.hidden_size
        return [("h", (n, H, D), nx.act_dtype), ("pre", (n, H), torch.float32)]

    def _taps(self, ctx: ForwardContext, hi: int):
        """The DSpark taps made past rank 0 before layer hi (each of its layer's rows)."""
        taps = [(l, self._rows(l, ctx)) for l in self.cfg.dspark_target_layer_ids
                if self.taps_from <= l < hi]
        return [(f"tap.{l}", (n, self.cfg.hidden_size), torch.float32) for l, n in taps if n]

    # ---- one forward: Model._forward with this rank's ends of the stream ----------------------
    def forward(self, tokens: torch.Tensor, state: State, logits: str, nx: Numerics,
                decoder_from: int | None = None) -> tuple[torch.Tensor | None, ForwardContext]:
        return self.m._forward(tokens, state, logits, nx, decoder_from, route=self)

    def enter(self, tokens: torch.Tensor, ctx: ForwardContext,
              state: State) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        """Rank 0 embeds the tokens; every other rank receives the carry from the one before
        (the rows the rank before ran, and their context)."""
        m, r = self.m, self.rank
        if r == 0:
            return m.enter(tokens, ctx, state)
        lay = self._carry_layout(r - 1, ctx)
        got = lay.views(self.comm.recv(torch.empty(lay.nbytes, dtype=torch.uint8,
                                                   device=m.device), r - 1))
        rows = ctx.rows(ctx.T - got["h"].shape[0], ctx.T)
        self._unpack_context(got, rows, state)
        return got["h"], got["pre"], rows

    def leave(self, h: torch.Tensor, pre: torch.Tensor, rows: ForwardContext, state: State,
              logits: str) -> torch.Tensor | None:
        """Every rank but the last sends the carry on; the last sends rank 0 the rows the
        logits need and the taps; rank 0 receives them and computes the logits."""
        m, r, comm, ctx = self.m, self.rank, self.comm, rows.whole
        if r < self.last:
            self._send_carry(r, h, pre, rows, state)
        elif r != 0:
            lay = self._final_layout(ctx, logits)
            n = h.shape[0]  # (every row for 'all': Model.check_decoder_from)
            take = {"all": slice(0, n), "last": slice(n - 1, n), "none": slice(0, 0)}[logits]
            vals = {"h": h[take], "pre": pre[take],
                    **{name: ctx.main_hidden[int(name[4:])] for name, _, _ in lay.pieces
                       if name.startswith("tap.")}}
            comm.send(lay.pack(vals, m.device), 0)
        if r != 0:
            return None
        lay = self._final_layout(ctx, logits)
        got = lay.views(comm.recv(torch.empty(lay.nbytes, dtype=torch.uint8, device=m.device),
                                  self.last))
        for name, t in got.items():
            if name.startswith("tap."):
                ctx.main_hidden[int(name[4:])] = t
        return m.leave(got["h"], got["pre"], rows, state, logits)

    def _unpack_context(self, got: dict[str, torch.Tensor], rows: ForwardContext,
                        state: State) -> None:
        """The carry into `rows` (the stream's rows: their selections) and the state (the
        kv-source entries, at the whole forward's entries)."""
        for name, t in got.items():
            kind, _, key = name.partition(".")
            if kind == "sel":
                rows.sel[int(key)] = t
            elif kind == "cand":
                rows.candidates = t
            elif kind == "tap":
                rows.main_hidden[int(key)] = t
            elif kind in ("kv", "ik"):
                s = int(key)
                cache = (state.comp_kv if kind == "kv" else state.index_k).get(s)
                if cache is None:  # a source only later ranks read: pass it on
                    rows.relay[name] = t
                else:
                    cache[forward_entries(rows.whole, self.cfg.ratio(s))] = t

    def _send_carry(self, r: int, h, pre, rows: ForwardContext, state: State) -> None:
        lay = self._carry_layout(r, rows.whole)
        vals = {"h": h, "pre": pre}
        for name, _, _ in lay.pieces:
            kind, _, key = name.partition(".")
            if kind == "sel":
                vals[name] = rows.sel[int(key)]
            elif kind == "cand":
                vals[name] = rows.candidates
            elif kind == "tap":
                vals[name] = rows.main_hidden[int(key)]
            elif kind in ("kv", "ik"):
                if name in rows.relay:
                    vals[name] = rows.relay[name]
                else:
                    s = int(key)
                    cache = state.comp_kv[s] if kind == "kv" else state.index_k[s]
                    vals[name] = cache[forward_entries(rows.whole, self.cfg.ratio(s))]
        self.comm.send(lay.pack(vals, self.m.device), r + 1)
