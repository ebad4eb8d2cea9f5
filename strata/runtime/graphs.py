"""Forwards replayed from CUDA graphs: one capture per (rows, logits, journal, entry buckets).

A decode step launches a few thousand small kernels; eagerly, the host's Python and launch
cost is most of the step (bench/results/performance.md). Graphs replay the whole region
(runtime/static_step.StaticStep: embedding → layers → head) in a few launches: a chain of
graphs of PART_LAYERS layers (small first, so the GPU starts soon), so the GPU runs one part
while the host launches the next. Its ops depend on
the number of rows, the logits mode, whether a journal is open (then the ring rows a write
displaces are saved too) and, through the indexer's scored-entry count, on the entry bucket
of each indexer ratio at the forward's end (Model.graph_key) — never on the position within
a bucket (strata/graph_check.py) — so one capture serves every step of a bucket, and a step
crossing into a new bucket captures once more.

Verify windows run inside a journal (state.begin(): the rejected rows are rolled back). A
replay saves the displaced rows into the tensors of the writes recorded at capture; after
it, those writes — shifted to the replay's position — are filed in the live journal. They
are valid until the same graph replays again, so a graphed forward must be the journal's
only one (a journal that already holds writes runs eagerly).

Engram tables on disk: a step's records are read on the host into a fixed device buffer,
which the graph dequantises — each layer's just before the graph holding it is launched, so
the GPU runs the graphs before it meanwhile (layer 14's reads overlap the graphs of the
layers before it; for a step launched on tokens the host has not read yet, the host reads
them after the graphs before the first Engram layer: `launch`'s host_tokens,
StaticStep.load_records).

The DSpark draft replays from more graphs: its block through the stages and the head
(DraftRegion: a chain of one graph per stage), then the Markov picks with the request's sampler (MarkovPicks: a capture per
temperature and top-p, any seed, few kept — every greedy request shares one); eager, the
picks were ~60 launches a
window that the GPU idled through. So do the draft windows of the rows a step or a window
commits (CommitRegion: a capture per row count).

What a graph cannot replay runs eagerly instead (`Model.forward`): a CPU model and the
vendor's stale-index-key quirk.

A state's graphs hold a memory pool per kind of region (CudaGraphs: steps, draft, commit):
a later capture may reuse what an earlier one of its pool freed, which is safe only where
the earlier graph never replays before the later one's results are read. The graphs live on
their State (Model.graphed), so a retained conversation keeps its captures — and their
pools, which the prefix cache's byte budget counts (GraphedForward.nbytes).
"""
from __future__ import annotations

import functools
import gc
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from strata.captures import holding
from strata.current_device import made_current, upload
from strata.errors import StrataError
from strata.model.context import ForwardContext
from strata.model.dspark import Draft
from strata.runtime.sampling import SamplingParams, sample
from strata.runtime.state import Journal, RingWrite, State
from strata.runtime.static_step import StaticStep


# A step is captured as a chain of graphs of these many layers (the last count repeated):
# launching a graph costs host time per kernel node (~1.5 µs; 4.5 ms for a 20-layer step as
# one graph, measured), and replayed in order the GPU runs one part while the host launches
# the next. The GPU idles until the first part's launch returns (the host has just read the
# previous step's token and prepared this one's inputs), so the first parts are small — each
# launch then takes less time than the part before it runs.
PART_LAYERS = (1, 2, 4)

# Markov-pick graphs kept per state, one per sampler's temperature and top-p (the seed is a
# device input; every greedy request shares one): another sampler captures anew (a few ms).
MARKOV_GRAPHS = 4


class Chain:
    """Graphs replayed one after another on the stream (the parts of one step)."""

    def __init__(self, graphs: list) -> None:
        self.graphs = graphs

    def replay(self, parts: slice = slice(None)) -> None:
        for g in self.graphs[parts]:
            g.replay()

    def reset(self) -> None:
        for g in self.graphs:
            g.reset()


@dataclass
class Captured:
    step: StaticStep
    graph: Chain
    start: int                 # the position it was captured at
    writes: list[RingWrite]    # its journaled writes (empty without a journal)
    # the graphs of the chain holding Engram layers whose tables are on disk, in order:
    # (its index in the chain, those layers) — their records are queued before it runs
    disk_layers: list[tuple[int, list[int]]]


class CudaGraphs:
    """How a step is captured and replayed: torch's CUDA graphs, in a memory pool per kind of
    region. Graphs of one pool share memory: a capture may take the blocks an earlier one
    freed — its scratch, which that graph writes again at every replay. So the results of a
    graph captured later may lie in an earlier one's scratch, and are lost once it replays:
    safe for the steps, whose results are read before the next step replays, but not across
    kinds — a verify window's journal is read by its rollback after the window's commit and
    the draft launched behind it have replayed (the draft's scratch overwrote a later-captured
    window's journal: an illegal address in the rollback's restore, on the H200)."""

    def __init__(self) -> None:
        self.pools: dict[str, object] = {}

    def release_pools(self) -> None:
        """Forget the pools (their graphs released: the memory goes when they do); later
        captures start new ones."""
        self.pools = {}

    def pool_bytes(self) -> int:
        """The device memory the pools hold: their segments, read from the allocator. A
        pool keeps every segment a capture took until all its graphs are gone — the
        captures' scratch too, freed at their end but reserved for the pool — and a
        capture's growth of the reserved counter misses what it took from segments the
        pool already had (on the H200 that growth counted 34 MiB where dropping the graphs
        freed 120)."""
        if not self.pools:
            return 0
        ours = {tuple(p) for p in self.pools.values()}
        return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                   if tuple(seg["segment_pool_id"]) in ours)

    def supports(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def warm_up(self, run) -> None:
        """Run once off the capture stream: Triton compiles, lazily built tables are made
        outside the graph's pool."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)

    def capture(self, run, state: State, pool: str = "steps") -> torch.cuda.CUDAGraph:
        """Record run()'s kernels (they do not run: replay() runs them) into the memory pool
        named `pool`."""
        if pool not in self.pools:
            self.pools[pool] = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # The collector is off from before capture_begin to after capture_end: while it is
        # disabled, allocations still count towards the next collection, so switching it back
        # on inside the capture would collect at the first allocation (torch.cuda.graph's
        # __exit__ runs Python before capture_end).
        with holding([]) as held, no_cyclic_gc(), torch.cuda.graph(graph, pool=self.pools[pool]):
            run()
        graph.held = held  # (what its kernels read by address from caches: strata.captures)
        return graph


@contextmanager
def no_cyclic_gc():
    """Python's cycle collector off inside the block. A collection during a capture can free
    an unreachable session's CUDA graphs, and destroying a graph is an operation CUDA forbids
    while a stream captures: the capture is invalidated (seen on the H200: the previous
    benchmark mode's graphs freed mid-capture)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class EagerReplay(CudaGraphs):
    """The same regions, keys, captures and journal bookkeeping as CUDA graphs, on any device,
    without capturing: a "capture" keeps the region and a "replay" runs it again, with the
    replay's journaled writes copied into the tensors recorded at capture — what a real
    replay does to them. It is how CPU tests (a group of gloo ranks included) exercise the
    graph path, and how to tell a capture problem from a region problem on a GPU
    (ParallelSpec.graph_backend="eager")."""

    def supports(self, device: torch.device) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def warm_up(self, run) -> None:
        run()

    def capture(self, run, state: State, pool: str = "steps") -> "_Rerun":
        # A CUDA capture records without running; running here writes the same step's rows
        # again and journals them in the graph's own journal, as the capture records them.
        own = state.journal
        first = 0 if own is None else len(own.writes)
        run()
        return _Rerun(run, state, None if own is None else own.writes[first:])


class _Rerun:
    def __init__(self, run, state: State, recorded: list[RingWrite] | None) -> None:
        self.run, self.state, self.recorded = run, state, recorded

    def replay(self) -> None:
        live = self.state.journal
        self.state.journal = None if self.recorded is None else Journal(start=0)
        try:
            self.run()
            if self.recorded is not None:
                fresh = self.state.journal.writes
                if len(fresh) != len(self.recorded):
                    raise RuntimeError("a replayed region journaled other writes than its "
                                       "capture: it is not a static region")
                for old, new in zip(self.recorded, fresh):
                    for name in ("slots", "positions", "old_rows", "old_tags"):
                        getattr(old, name).copy_(getattr(new, name))
        finally:
            self.state.journal = live

    def reset(self) -> None:
        self.run = None  # (a released graph is never replayed)


GRAPH_BACKENDS = {"cuda": CudaGraphs, "eager": EagerReplay}


class DraftRegion:
    """The DSpark draft's block through the stages and the head on fixed buffers (anchor and
    positions copied in), the region its graph captures."""

    def __init__(self, model, state: State) -> None:
        cfg, dev = model.cfg, model.device
        g = cfg.dspark_block_size
        self.model, self.state = model, state
        self.tokens = torch.full((g,), cfg.dspark_noise_token_id, dtype=torch.long, device=dev)
        self.ctx = ForwardContext(cfg, model.numerics, 0, torch.zeros(g, dtype=torch.long,
                                                                     device=dev))
        self.offsets = torch.arange(g, device=dev)
        # the stream between the pieces, then the rows and base logits: kept here, with
        # the graphs (their memory in the graphs' pool stays theirs)
        self.h = self.pre = self.x = self.base = None

    def prepare(self, anchor: int | torch.Tensor, P: int | torch.Tensor) -> None:
        """The block's anchor and positions: host ints, or tensors [1] on the device (copied
        on the stream; the context's host `start` then keeps its last value: no op reads
        it)."""
        g = self.tokens.numel()
        if isinstance(anchor, torch.Tensor):
            self.tokens[:1].copy_(anchor)
            torch.add(self.offsets, P, out=self.ctx.positions)
            return
        self.tokens[0] = anchor  # (a fill with a scalar: no host upload)
        upload(torch.arange(P, P + g), self.tokens.device, out=self.ctx.positions)  # (one copy)
        self.ctx.start = P  # (host bookkeeping only: no op reads it)

    def run(self) -> None:
        for part in self.parts():
            part()

    def parts(self) -> list:
        """The region as consecutive pieces, one a stage (the embedding with the first, the
        head with the last), each a graph of its own: replayed in order, the GPU runs the
        first stage while the host launches the next (one graph of the whole draft took the
        host ~0.4 ms to launch while the GPU waited: bench/results/performance.md, session
        19). The same ops as DSparkHead.draft_rows."""
        m = self.model
        dspark, stages = m.dspark, m.dspark.stages

        def piece(i: int):
            def run() -> None:
                if i == 0:
                    self.ctx.reset_derived()
                    self.h, self.pre = dspark.block_stream(m.embed, self.tokens, m.numerics)
                if stages:
                    self.h, self.pre = stages[i].forward(self.h, self.pre, self.ctx, self.state)
                if i == max(len(stages), 1) - 1:
                    self.x, self.base = dspark.block_logits(self.h, self.pre, m.head,
                                                            m.numerics)
            return run
        return [piece(i) for i in range(max(len(stages), 1))]


class MarkovPicks:
    """The draft's Markov picks with one sampler after its DraftRegion (its rows, base
    logits, anchor and positions read from the region's buffers; the sampler's seed from a
    buffer of its own: one capture serves every seed), the region a graph captures; `out` is
    the draft it computes."""

    def __init__(self, region: DraftRegion, params: SamplingParams) -> None:
        self.region, self.params = region, params
        self.seed = torch.zeros((), dtype=torch.long, device=region.tokens.device)
        self.out: Draft | None = None
        self.graph = None

    def prepare(self, params: SamplingParams) -> None:
        if not params.greedy:  # (greedy reads no noise)
            self.seed.fill_(params.seed)  # (a fill with a scalar: no host upload)

    def run(self) -> None:
        r = self.region

        def pick(lg, positions):
            return sample(lg, positions, self.params, seed=self.seed)
        self.out = r.model.dspark.markov(r.x, r.base, r.tokens[:1], r.ctx.positions + 1, pick)


class CommitRegion:
    """DSparkHead.commit_context for `rows` rows on fixed buffers (the taps' rows and their
    positions copied in), the region a graph captures."""

    def __init__(self, model, state: State, rows: int) -> None:
        self.model, self.state, self.rows = model, state, rows
        self.positions = torch.zeros(rows, dtype=torch.long, device=model.device)
        self.hidden: torch.Tensor | None = None
        self.start = 0
        self.graph = None

    def prepare(self, ctx: ForwardContext, start: int) -> None:
        """The first `rows` rows of a forward's DSpark taps, at positions start.. ."""
        m = self.model
        taps = [ctx.main_hidden[l][:self.rows] for l in m.cfg.dspark_target_layer_ids]
        if self.hidden is None:
            self.hidden = torch.cat(taps, dim=-1)
        else:
            torch.cat(taps, dim=-1, out=self.hidden)
        upload(torch.arange(start, start + self.rows), m.device, out=self.positions)
        self.start = start  # (host bookkeeping only: no op reads it)

    def run(self) -> None:
        m = self.model
        m.dspark.commit_rows(self.hidden, self.positions, self.start, self.state, m.numerics)


class GraphedForward:
    """A state's forwards from graphs. `route` (runtime/static_step): a rank's executor in a
    multi-device group, whose graphs then hold its collectives or point-to-point hand-offs —
    every rank captures and replays the same forwards together."""

    def __init__(self, model, state: State, backend: CudaGraphs | None = None,
                 route=None) -> None:
        if not hasattr(model, "graph_key"):
            raise StrataError("CUDA graphs run a Model (a rank's own part in a group), not a "
                              f"{type(model).__name__}")
        self.model, self.state, self.route = model, state, route
        self.backend = backend or CudaGraphs()
        self.captured: dict[tuple, Captured] = {}
        self.captures = self.replays = 0  # (counts, for tests and benchmarks)
        self.capture_s = 0.0  # time spent warming up and capturing (benchmarks subtract it)
        self._draft: tuple[DraftRegion, object] | None = None
        self._markov: OrderedDict[object, MarkovPicks] = OrderedDict()  # by sampler
        self._commits: dict[int, CommitRegion] = {}  # by row count

    def release(self) -> None:
        """Free every graph now (a later forward captures anew). A group must do this
        before it leaves: NCCL cannot destroy a communicator while a live graph holds
        collectives or hand-offs on it (destroy_process_group blocks for good)."""
        for c in self.captured.values():
            c.graph.reset()
        if self._draft is not None:
            self._draft[1].reset()
        for region in (*self._markov.values(), *self._commits.values()):
            region.graph.reset()
        self.captured, self._draft, self._markov, self._commits = {}, None, OrderedDict(), {}
        self.backend.release_pools()

    def nbytes(self) -> int:
        """Device memory the graphs hold: their memory pools' segments (a retained state's
        share of the prefix cache's budget, runtime/prefix_cache.py; the regions' fixed
        input buffers, a few KB, aside)."""
        return self.backend.pool_bytes()

    def usable(self) -> bool:
        m, j = self.model, self.state.journal
        return (self.backend.supports(m.device) and not m.numerics.vendor_stale_index_k
                and (j is None or (not j.writes and not j.n_written)))

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, logits: str = "last",
                host_tokens=None) -> tuple[torch.Tensor, ForwardContext]:
        """Model.forward(tokens, state, logits), from a graph where one can run: the same
        logits bit for bit, the state advanced (and, inside a journal, journaled) the same
        way. Returns (logits, the step's context — its DSpark taps valid until the next
        call). `tokens` on the device (a draft's, not yet read): `host_tokens()` gives their
        host copy — called once the replay is launched (eagerly: first)."""
        if not self.usable():
            return self.model.forward(tokens if host_tokens is None else host_tokens(),
                                      self.state, logits=logits)
        return self.run(tokens, logits, host_tokens)

    def run(self, tokens: torch.Tensor, logits: str,
            host_tokens=None) -> tuple[torch.Tensor | None, ForwardContext]:
        """The graph path (the caller checked `usable`; in a group, rank 0 did, and every
        rank runs it). Logits None where the route computes none (a group's other ranks)."""
        host_tokens = None if host_tokens is None else functools.cache(host_tokens)
        c, ctx = self.launch(tokens, logits, host_tokens)
        out = None if c.step.logits is None else c.step.logits.clone()
        c.step.finish(ctx, None if host_tokens is None else host_tokens())
        return out, c.step.ctx

    def launch(self, tokens: torch.Tensor, logits: str,
               host_tokens=None) -> tuple[Captured, ForwardContext]:
        """`run` up to the replay: the forward is queued (captured first where its key is
        new), the state not yet advanced — `Captured.step.finish(ctx)` does that, and
        `Captured.step.logits` holds the logits until the next replay. `tokens` on the host,
        or on the device (StaticStep.prepare: a sample the host has not read) — then, with
        Engram tables on disk, `host_tokens()` (the same tensor at every call) gives their
        host copy. With disk tables each Engram layer's records are read as the graph
        holding it is launched (`_replay_reading_records`)."""
        model, state = self.model, self.state
        T = tokens.numel()
        journaled = state.journal is not None
        disk = bool(model.engram_stores)
        if disk and host_tokens is None:
            host_tokens = lambda: tokens  # noqa: E731  (on the host already)
        key = (T, logits, journaled) + model.graph_key(state.position, T)
        with made_current(model.device):
            c = self.captured.get(key)
            if c is None:  # (a capture reads its records with its other inputs)
                c, ctx = self._capture(host_tokens() if disk else tokens, logits)
                self.captured[key] = c
            else:
                ctx = c.step.prepare(tokens, records=not disk)  # (checks the arguments)
                if disk:
                    self._replay_reading_records(c, host_tokens)
                else:
                    c.graph.replay()
                self.replays += 1
                if journaled:
                    state.journal.writes.extend(w.shifted(ctx.start - c.start)
                                                for w in c.writes)
        return c, ctx

    def _replay_reading_records(self, c: Captured, host_tokens) -> None:
        """A step's graphs replayed in order, each holding a disk Engram layer launched once
        the host has read that layer's records into its buffer (queued behind the graphs
        before it, which the GPU runs meanwhile): the graphs before the first Engram layer,
        the tokens' host copy hashed, then each layer's rows read as its graph is due."""
        at, ids = 0, None
        for part, layers in c.disk_layers:
            c.graph.replay(slice(at, part))
            if ids is None:
                ids = c.step.engram_ids(host_tokens())
            c.step.load_records(ids, layers)
            at = part
        c.graph.replay(slice(at, None))

    def can_draft(self) -> bool:
        """Whether the draft can replay: not with the stages' experts in a host-managed cache
        (Model.load(draft_experts="cache") brings each step's experts in from the host)."""
        m = self.model
        return (getattr(m, "dspark", None) is not None and self.backend.supports(m.device)
                and getattr(m, "draft_expert_cache", None) is None)

    @torch.no_grad()
    def draft(self, anchor: int | torch.Tensor, params: SamplingParams,
              position: torch.Tensor | None = None) -> Draft:
        """DSparkHead.draft with the sampler of `params`, replayed from graphs — at the
        state's position, or from an anchor and `position` on the device ([1] each: a
        verify window's next, before the host has read them): the stages
        and the head (one capture for the session: the block's size is fixed and its ops do
        not depend on the position), then the Markov picks (a capture per sampler's
        temperature and top-p — any seed; one for every greedy request — the last
        MARKOV_GRAPHS kept). The draft's tensors are valid until the next call."""
        model, state = self.model, self.state
        P = state.position if position is None else position
        with made_current(model.device):
            if self._draft is None:
                region = DraftRegion(model, state)
                region.prepare(anchor, P)
                self._draft = region, self._capture_region("draft", *region.parts())
            else:
                region, graph = self._draft
                region.prepare(anchor, P)
                graph.replay()
                self.replays += 1
            key = "greedy" if params.greedy else (params.temperature, params.top_p)
            picks = self._markov.pop(key, None)
            if picks is None:
                picks = MarkovPicks(region, params)
                picks.prepare(params)
                picks.graph = self._capture_region("draft", picks.run)
                while len(self._markov) >= MARKOV_GRAPHS:
                    self._markov.pop(next(iter(self._markov))).graph.reset()
            else:
                picks.prepare(params)
                picks.graph.replay()
                self.replays += 1
            self._markov[key] = picks  # (the most recent last)
            return picks.out

    @torch.no_grad()
    def commit_context(self, ctx: ForwardContext, rows: int, start: int) -> None:
        """DSparkHead.commit_context of the first `rows` rows of a decode-time forward's taps
        (`ctx`) at positions start.., replayed from a graph per row count (at most a verify
        window's: eager, ~25 launches the GPU idled through after every window); more rows
        run eagerly. Its ring writes are never journaled, so a verify window's commit replays
        before the window's rollback too."""
        model, state = self.model, self.state
        if rows > model.cfg.dspark_block_size + 1 or not self.backend.supports(model.device):
            model.dspark.commit_context(model.dspark.main_hidden(ctx)[:rows], start, state,
                                        model.numerics)
            return
        with made_current(model.device):
            region = self._commits.get(rows)
            if region is None:
                region = self._commits[rows] = CommitRegion(model, state, rows)
                region.prepare(ctx, start)
                region.graph = self._capture_region("commit", region.run)
            else:
                region.prepare(ctx, start)
                region.graph.replay()
                self.replays += 1

    def _capture_region(self, pool: str, *parts) -> Chain:
        """Warm up, capture and replay once a region whose inputs are in place, as a chain
        of one graph per part (its pieces in order), in the memory pool `pool` (the draft's
        and the commit's replay between a window and its rollback: not the steps' pool,
        CudaGraphs): its results are computed by the replay (a capture records kernels
        without running them)."""
        self.backend.synchronize()
        t0 = time.perf_counter()
        for run in parts:
            self.backend.warm_up(run)
        graph = Chain([self.backend.capture(run, self.state, pool) for run in parts])
        self.backend.synchronize()
        self.capture_s += time.perf_counter() - t0
        self.captures += 1
        graph.replay()
        return graph

    def _capture(self, tokens: torch.Tensor, logits: str) -> tuple[Captured, ForwardContext]:
        """Warm up, capture, and replay once: the step's results are computed by the replay
        (a capture records kernels without running them). The warm-up's writes to the state
        are those of the same step, which the replay makes again — and the warm-up journals
        them in the live journal with the rows they displaced; the capture's journaled
        writes go to a journal of their own, the graph's."""
        state, backend = self.state, self.backend
        step = StaticStep(self.model, state, tokens.numel(), logits, self.route)
        ctx = step.prepare(tokens)
        backend.synchronize()
        t0 = time.perf_counter()
        backend.warm_up(step.run)
        live = state.journal
        if live is not None:
            state.journal = Journal(start=live.start)
        try:
            graph = Chain([backend.capture(part, state)
                           for part in step.parts(PART_LAYERS)])
        finally:
            writes = state.journal.writes if live is not None else []
            state.journal = live
        backend.synchronize()
        self.capture_s += time.perf_counter() - t0
        graph.replay()
        self.captures += 1
        stores = self.model.engram_stores
        disk = [(i, [b.layer for b in group if b.layer in stores])
                for i, group in enumerate(step.groups(PART_LAYERS))]
        return Captured(step, graph, ctx.start, writes, [d for d in disk if d[1]]), ctx
