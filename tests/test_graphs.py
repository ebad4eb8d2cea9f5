"""runtime/graphs.GraphedForward's bookkeeping — one capture per key, replays at later
positions, a replay's journaled writes filed (shifted) in the live journal so rejected rows
roll back — on CPU, through runtime.graphs.EagerReplay (there is no CUDA here), which
"captures" by keeping the region and "replays" by running it again, with the replay's
journaled writes copied into the tensors recorded at capture, which is what a real replay
does to them. The real capture and replay are GPU tests (tests/gpu/test_cuda_graph_gpu.py)."""
from __future__ import annotations

import gc
import itertools

import torch

from strata.model.model import Model
from strata.model.numerics import Numerics
from strata.runtime.graphs import CudaGraphs, EagerReplay, GraphedForward, no_cyclic_gc
from strata.runtime.sampling import SamplingParams
from strata.runtime.session import Session
from strata.runtime.speculative import SpecConfig
from strata.runtime.static_step import StaticStep
from util import continuation_drafts, random_tokens, stops_alike, windows_roll_back_alike


def _graphed(model, session) -> GraphedForward:
    session.graphed = GraphedForward(model, session.state, EagerReplay())
    return session.graphed


def test_plain_decode_captures_once_per_key_and_replays(tiny_dir):
    model = Model.load(tiny_dir, "cpu", Numerics("vendor"))
    prompt = random_tokens(246, seed=5)  # the step at 255 → 256 crosses an entry bucket
    ref = Session(model, 320)
    want = ref.run(prompt, 20, mode="plain").tokens
    s = Session(model, 320)
    g = _graphed(model, s)
    assert s.run(prompt, 20, mode="plain").tokens == want
    assert (g.captures, g.replays) == (2, 19 - 2)
    from strata.runtime.graphs import PART_LAYERS
    left, parts = len(model.layers), 0  # (parts of PART_LAYERS layers, the last size repeated)
    while left > 0:
        left -= PART_LAYERS[min(parts, len(PART_LAYERS) - 1)]
        parts += 1
    assert parts > 2 and all(len(c.graph.graphs) == parts for c in g.captured.values())
    live, ref_live = s.state.live_tensors(), ref.state.live_tensors()
    assert live.keys() == ref_live.keys()
    assert all(torch.equal(live[k], ref_live[k]) for k in live)
    # Released (as a group does before it leaves), every graph is reset and
    # the next forward captures anew, with the eager forward's logits.
    graphs = [p for c in g.captured.values() for p in c.graph.graphs]
    g.release()
    assert not g.captured and all(p.run is None for p in graphs)
    eager = s.state.clone()
    nxt = torch.tensor([want[-1]])
    got, _ = g.forward(nxt)
    assert g.captures == 3 and torch.equal(got, model.forward(nxt, eager, logits="last")[0])


def test_verify_windows_replay_and_roll_back_rejected_rows(tiny_dir):
    """DSpark with fixed-length windows whose drafts are plain decoding's continuation made
    wrong every third draft: the windows replay from graphs inside journals, the rejected
    rows roll back through the replayed writes, and tokens and live state equal plain
    decoding's."""
    model = Model.load(tiny_dir, "cpu", Numerics("vendor"))
    prompt = random_tokens(60, seed=6)
    ref = Session(model, 160)
    want = ref.run(prompt, 40, mode="plain").tokens
    block = model.cfg.dspark_block_size
    override = continuation_drafts(want, len(prompt), model.cfg.vocab_size)
    spec = SpecConfig(length=block, low_windows=10 ** 9)
    s = Session(model, 160, speculative=spec, draft_override=override)
    g = _graphed(model, s)
    got = s.run(prompt, 40, mode="dspark").tokens
    assert got == want
    assert s.stats.windows > 3 and s.stats.accepted < s.stats.drafted  # rejections happened
    assert g.replays >= s.stats.windows - 2
    # Every ring row and tag — the displaced rows the rollbacks restored included, which no
    # later read needs but a later truncation does — equals an eager DSpark run's.
    eager = Session(model, 160, speculative=spec, draft_override=override)
    assert eager.run(prompt, 40, mode="dspark").tokens == want
    full, ref_full = s.state.tensors(), eager.state.tensors()
    assert full.keys() == ref_full.keys()
    assert all(torch.equal(full[k], ref_full[k]) for k in full)


def test_a_journal_with_writes_runs_eagerly(tiny_dir):
    """A replay's journaled writes live in the graph's tensors until it replays again, so a
    graphed forward must be its journal's only one: a second forward runs eagerly."""
    model = Model.load(tiny_dir, "cpu", Numerics("vendor"))
    s = Session(model, 64)
    s.prefill(random_tokens(20, seed=7))
    g = _graphed(model, s)
    s.state.begin()
    g.forward(random_tokens(2, seed=8), "all")
    assert g.captures == 1
    g.forward(random_tokens(2, seed=9), "all")
    assert (g.captures, g.replays) == (1, 0)
    s.state.rollback()
    assert s.state.position == 20


def test_a_replayed_window_rolls_back_like_an_eager_one(tiny_dir):
    """A verify window replayed at a later position than its capture, then rolled back past
    its rejected rows: every ring row and tag equals the same window run eagerly."""
    model = Model.load(tiny_dir, "cpu", Numerics("vendor"))
    s = Session(model, 128)
    s.prefill(random_tokens(30, seed=10))
    ref = s.state.clone()
    g = _graphed(model, s)
    windows_roll_back_alike(model, s.state, g, ref)
    assert (g.captures, g.replays) == (1, 2)


def test_a_replayed_draft_equals_the_eager_one(tiny_dir, monkeypatch):
    """The DSpark draft's stages and head from one capture, and its Markov picks from one
    capture per temperature and top-p, replayed at later positions: the same drafts, logits
    and confidences as DSparkHead.draft with that sampler — greedy requests share a capture,
    a sampler's capture replays any seed, and the oldest beyond MARKOV_GRAPHS is dropped."""
    from strata.runtime import graphs
    from strata.runtime.sampling import SamplingParams, sample
    model = Model.load(tiny_dir, "cpu", Numerics("vendor"))
    s = Session(model, 96, speculative=SpecConfig())
    s.prefill(random_tokens(40, seed=12))
    g = _graphed(model, s)
    assert g.can_draft()
    nx = model.numerics
    monkeypatch.setattr(graphs, "MARKOV_GRAPHS", 2)
    samplers = [SamplingParams(), SamplingParams(seed=9), SamplingParams(0.8, 0.9, seed=3),
                SamplingParams(1.2, seed=4), SamplingParams(0.8, 0.9, seed=99),
                SamplingParams(seed=2)]
    for anchor, params in zip((7, 100, 31, 55, 64, 12), samplers):
        def pick(lg, positions):
            return sample(lg, positions, params)
        want = model.dspark.draft(model.embed, model.head, anchor, s.state, nx, pick)
        got = g.draft(anchor, params)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logits, want.logits)
        assert torch.equal(got.confidence, want.confidence)
        start = s.state.position
        _, ctx = model.forward(torch.tensor([anchor]), s.state, logits="none")
        model.dspark.commit_context(model.dspark.main_hidden(ctx), start, s.state, nx)
    # captures: the region, greedy, (0.8, 0.9), (1.2, 1) — greedy dropped: two kept — and
    # greedy again, dropping (1.2, 1); replays: the region 5×, greedy, (0.8, 0.9) with seed 99
    assert (g.captures, g.replays) == (5, 7)
    assert list(g._markov) == [(0.8, 0.9), "greedy"]


def test_a_replayed_commit_of_the_draft_windows_equals_the_eager_one(tiny_dir):
    """DSparkHead.commit_context of a decode-time forward's first rows, replayed from one
    capture per row count at later positions: every DSpark window ring row and tag equals
    the eager commit's; more rows than a verify window, or an open journal, run eagerly."""
    model = Model.load(tiny_dir, "cpu", Numerics("vendor"))
    nx = model.numerics
    s = Session(model, 96, speculative=SpecConfig())
    s.prefill(random_tokens(40, seed=13))
    ref = s.state.clone()
    g = _graphed(model, s)
    big = model.cfg.dspark_block_size + 2
    for rows, tokens in ((1, [7]), (3, [5, 9, 11, 12]), (1, [4]), (3, [8, 2, 6]),
                         (big, list(range(3, 3 + big)))):
        start = s.state.position
        _, ctx = g.forward(torch.tensor(tokens), "all")
        g.commit_context(ctx, rows, start)
        _, rctx = model.forward(torch.tensor(tokens), ref, logits="all")
        model.dspark.commit_context(model.dspark.main_hidden(rctx)[:rows], start, ref, nx)
        for mine, theirs in zip(s.state.dspark, ref.dspark):
            assert torch.equal(mine.rows, theirs.rows) and torch.equal(mine.tags, theirs.tags)
    assert sorted(g._commits) == [1, 3]  # (the big commit ran eagerly)


def test_disk_engram_is_read_as_the_part_that_needs_it_is_launched(tiny_dir, monkeypatch):
    """Engram tables on disk: a graphed step reads its records on the host (the store's
    cache cannot run inside a graph) into a fixed buffer the graph dequantises, each Engram
    layer's just before the graph holding it is launched, so the GPU runs the graphs before
    it meanwhile (the tiny model's layers 1 and 4: the chain's second and third graphs).
    The plain loop still runs a step ahead: each step is launched on the token the step
    before left on the device, the host reading that token once the graph before the first
    Engram layer is launched (GraphedForward.launch); steps on host tokens (the loop not
    ahead) read the same way. The in-memory model's tokens, plain and in fixed-length DSpark
    windows (launched on their drafts' tokens), the rows counted as read."""
    from strata.runtime import graphs as graphs_module
    from strata.runtime import session as session_module
    mem = Model.load(tiny_dir, "cpu", Numerics("vendor"))
    disk = Model.load(tiny_dir, "cpu", Numerics("vendor"), engram="disk",
                      engram_cache_bytes=1 << 16)
    assert sorted(disk.engram_stores) == [1, 4]
    events = []
    replay, load = graphs_module.Chain.replay, StaticStep.load_records
    hash_ids = StaticStep.engram_ids

    def spy_replay(self, parts=slice(None)):
        events.append((parts.start, parts.stop))
        return replay(self, parts)

    def spy_hash(self, tokens):  # (its argument: the tokens' host copy, read just before)
        events.append("hash")
        return hash_ids(self, tokens)

    def spy_load(self, ids, layers):
        events.append(("records", tuple(layers)))
        return load(self, ids, layers)
    monkeypatch.setattr(graphs_module.Chain, "replay", spy_replay)
    monkeypatch.setattr(StaticStep, "load_records", spy_load)
    monkeypatch.setattr(StaticStep, "engram_ids", spy_hash)
    # a replayed step: graph 0, the tokens read and hashed, layer 1's records, graph 1,
    # layer 4's records, the rest
    step = [(0, 1), "hash", ("records", (1,)), (1, 2), ("records", (4,)), (2, None)]
    captured = [(None, None)]  # (a capture's one replay: its records read with its inputs)
    prompt = random_tokens(30, seed=13)
    want = Session(mem, 64).run(prompt, 8, mode="plain").tokens
    for ahead in (True, False):
        monkeypatch.setattr(session_module, "RUN_AHEAD", ahead)
        events.clear()
        s = Session(disk, 64)
        g = _graphed(disk, s)
        assert s.run(prompt, 8, mode="plain").tokens == want
        assert (g.captures, g.replays) == (1, 6)
        assert events == captured + step * 6
    assert all(st.stats().lookups >= 7 for st in disk.engram_stores.values())
    monkeypatch.setattr(session_module, "RUN_AHEAD", True)
    want = Session(mem, 64).run(prompt, 12, mode="plain").tokens
    d = Session(disk, 64, speculative=SpecConfig(length=3, low_windows=10 ** 6))
    _graphed(disk, d)
    events.clear()
    assert d.run(prompt, 12, mode="dspark").tokens == want
    # every replayed forward (windows and plain steps alike; drafts and commits replay
    # chains of their own, whole) reads as a plain step does
    starts = [i for i, e in enumerate(events) if e == step[0]]
    assert len(starts) >= d.stats.windows // 2  # (the windows replayed: not each length's first)
    assert all(events[i:i + len(step)] == step for i in starts)
    for store in disk.engram_stores.values():
        store.close()


def test_a_disk_read_failing_mid_step_leaves_the_state_usable(tiny_dir, monkeypatch):
    """A graphed step whose second Engram layer's read fails (the disk gone) raises the
    read's error after the graphs before it ran: the state is not advanced, and the next
    forward at that position — another token — gives the logits a model that never saw the
    failed step gives (the failed step's writes at the position are rewritten)."""
    from strata.errors import CheckpointError
    mem = Model.load(tiny_dir, "cpu", Numerics("vendor"))
    disk = Model.load(tiny_dir, "cpu", Numerics("vendor"), engram="disk")
    prompt = random_tokens(30, seed=21)
    s = Session(disk, 64)
    g = _graphed(disk, s)
    s.prefill(prompt)
    s.forward(torch.tensor([7]), "last")  # (captured: the next forward replays)
    at = s.state.position
    store = disk.engram_stores[4]

    def gone(ids):
        raise CheckpointError("Engram row read failed: the disk is gone")
    monkeypatch.setattr(store, "records", gone)
    first = disk.engram_stores[1].stats().lookups
    try:
        s.forward(torch.tensor([9]), "last")
    except CheckpointError as e:
        assert "disk is gone" in str(e)
    else:
        raise AssertionError("the failed read did not surface")
    # (the graphs up to layer 4's ran: layer 1's rows were read, its layers wrote at `at`)
    assert disk.engram_stores[1].stats().lookups == first + 1
    assert s.state.position == at and (g.captures, g.replays) == (1, 0)
    monkeypatch.undo()
    logits, _ = s.forward(torch.tensor([11]), "last")
    ref = mem.new_state(64)
    mem.forward(torch.tensor(s.state.tokens[:at].tolist()), ref, logits="none")
    want, _ = mem.forward(torch.tensor([11]), ref, logits="last")
    assert torch.equal(logits, want) and g.replays == 1
    for st in disk.engram_stores.values():
        st.close()


def test_graphs_stay_with_their_state(tiny_dir):
    """A state keeps its graphs (a retained conversation reuses its captures in the next
    request); a clone — other buffers — starts without; the engine and the CLI take
    --graphs (on CPU every forward runs eagerly: the same tokens)."""
    from strata.cli import main
    from strata.runtime.engine import Engine
    model = Model.load(tiny_dir, "cpu", Numerics("vendor"))
    st = model.new_state(32)
    g = model.graphed(st)
    assert model.graphed(st) is g and st.graphs is g
    assert st.clone().graphs is None
    assert Session(model, 32, state=st, graphs=True).graphed is g
    assert Engine(model, 64, graphs=True).graphs
    assert main(["generate", "--model", str(tiny_dir), "--tokens", "5 6 7", "--max-tokens",
                 "3", "--graphs", "--quiet"]) == 0


def test_the_stale_index_key_quirk_runs_eagerly(tiny_dir):
    """The vendor's stale-index-key quirk needs per-forward host bookkeeping a replay does
    not run: with it on, a graphed session never captures, and decodes like an eager one."""
    model = Model.load(tiny_dir, "cpu", Numerics("vendor", vendor_stale_index_k=True))
    prompt = random_tokens(30, seed=14)
    want = Session(model, 64).run(prompt, 5, mode="plain").tokens
    s = Session(model, 64)
    g = _graphed(model, s)
    assert not g.usable()
    assert s.run(prompt, 5, mode="plain").tokens == want
    assert (g.captures, g.replays) == (0, 0)


def test_no_cycle_collection_inside_a_capture():
    """A capture runs with the cycle collector off (freeing an unreachable session's graphs
    mid-capture invalidates it on CUDA) and leaves the collector as it found it, error or not."""
    assert gc.isenabled()
    with no_cyclic_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    try:
        with no_cyclic_gc():
            raise ValueError("a capture that fails")
    except ValueError:
        pass
    assert gc.isenabled()
    gc.disable()
    try:
        with no_cyclic_gc():
            pass
        assert not gc.isenabled()  # a caller that turned it off keeps it off
    finally:
        gc.enable()


def test_the_collector_stays_off_until_the_capture_has_ended(monkeypatch):
    """CudaGraphs.capture turns the collector back on only after capture_end: switched on
    inside the capture it collects at the first allocation (the count grows while it is off),
    which on the H200 invalidated a capture. torch.cuda.graph is replaced by a recorder here
    (no CUDA in CI): what is checked is the order of the two context managers."""
    seen = []

    class Recorder:
        def __init__(self, graph, pool=None):
            pass

        def __enter__(self):
            seen.append(("begin", gc.isenabled()))

        def __exit__(self, *exc):
            seen.append(("end", gc.isenabled()))

    class Graph:
        pass

    monkeypatch.setattr(torch.cuda, "graph", Recorder)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    CudaGraphs().capture(lambda: seen.append(("run", gc.isenabled())), state=None)
    assert seen == [("begin", False), ("run", False), ("end", False)]
    assert gc.isenabled()


def test_a_graph_holds_what_its_capture_was_handed_to_hold(monkeypatch):
    """strata.captures: what a captured kernel reads by address from a cache (an EXL3 set
    plan's table) is held by the graph, so the cache may drop it while the graph replays;
    outside a capture `hold` keeps nothing. torch.cuda.graph is replaced by a no-op context
    here (no CUDA in CI): the GPU test test_graphs_hold_the_set_plans_they_read runs it real."""
    import contextlib
    import weakref
    from strata.captures import hold

    class Graph:
        pass

    class Table:
        pass

    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    backend = CudaGraphs()
    tables = [Table(), Table()]
    gone = weakref.ref(tables[1])
    graph = backend.capture(lambda: hold(tables[0]), state=None)
    hold(tables[1])  # (no capture in progress)
    assert graph.held == [tables[0]]
    kept = weakref.ref(tables[0])
    tables.clear()
    gc.collect()
    assert kept() is graph.held[0] and gone() is None


def test_the_draft_and_the_commit_capture_outside_the_steps_pool(tiny_dir, monkeypatch):
    """A graph captured later in a pool may hold its results in an earlier graph's scratch,
    which that graph's replay overwrites. The window's commit and the draft launched behind
    it replay between a window and its rollback, which reads the window's journal: so they
    capture into pools of their own ("commit", "draft"), the steps into "steps" — one handle
    per name. torch.cuda.graph is replaced by a recorder of the pool it is given (no CUDA in
    CI); the GPU test test_graphed_verify_windows runs the real pools (it faulted in the
    rollback's restore with the draft in the steps' pool)."""
    import contextlib
    pools = []

    class Graph:
        pass

    def graph(g, pool=None):
        pools.append(pool)
        return contextlib.nullcontext()
    handles = iter(range(100))
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(handles))
    backend = CudaGraphs()
    for name in ("steps", "draft", "steps", "commit", "draft"):
        backend.capture(lambda: None, state=None, pool=name)
    assert pools == [0, 1, 0, 2, 1] and backend.pools == {"steps": 0, "draft": 1, "commit": 2}

    class Recording(EagerReplay):  # the real regions and order, each capture's pool noted
        def __init__(self):
            super().__init__()
            self.kinds = []

        def capture(self, run, state, pool="steps"):
            self.kinds.append((getattr(run, "__qualname__", ""), pool))
            return super().capture(run, state, pool)
    model = Model.load(tiny_dir, "cpu", Numerics("vendor"))
    s = Session(model, 200, speculative=SpecConfig(length=3))
    backend = Recording()
    s.graphed = GraphedForward(model, s.state, backend)
    s.run(random_tokens(30, seed=4), 12, mode="dspark")
    by_pool = {}
    for name, pool in backend.kinds:
        by_pool.setdefault(pool, set()).add(name.split(".")[0])
    assert by_pool == {"steps": {"StaticStep"}, "draft": {"DraftRegion", "MarkovPicks"},
                       "commit": {"CommitRegion"}}, by_pool


def _first_new(tokens: list[int], at_least: int) -> int:
    """The index (≥ at_least) of a token that does not occur before it."""
    return next(i for i in range(at_least, len(tokens)) if tokens[i] not in tokens[:i])


def test_the_plain_loop_runs_a_step_ahead_with_the_plain_loops_tokens_and_state(tiny_dir):
    """Session.generate's graphed plain loop launches each step before it reads the token
    the step consumes (Session._plain_ahead): greedy and a seeded sampler give the eager
    loop's tokens; a stop token abandons the step already launched on it — the state stays
    at the stop (not advanced) and its live tensors equal the eager loop's — and so does a
    cancellation; a later turn on the same states continues alike; the last token of
    max_tokens launches no step."""
    model = Model.load(tiny_dir, "cpu", Numerics("vendor"))
    prompt = random_tokens(40, seed=9)
    sampler = SamplingParams(temperature=0.8, top_p=0.9, seed=4)
    for params in (SamplingParams(), sampler):
        want = Session(model, 160).run(prompt, 24, params, mode="plain").tokens
        s = Session(model, 160)
        g = _graphed(model, s)
        assert s._runs_ahead(None)
        assert s.run(prompt, 24, params, mode="plain").tokens == want
        assert g.captures + g.replays == 23  # no step for the 24th token
    more = random_tokens(7, seed=10)
    s = Session(model, 160)
    _graphed(model, s)
    stops_alike(Session(model, 160), s, prompt, more, sampler, 24, want[_first_new(want, 5)])
    # a cancellation after 6 tokens, and the next turn
    ref, s = Session(model, 160), Session(model, 160)
    _graphed(model, s)
    got = []
    for x in (ref, s):
        seen = []
        gen = x.generate(prompt, 24, sampler, mode="plain",
                         should_stop=lambda seen=seen: len(seen) >= 6)
        for t in gen:
            seen.append(t)
        got.append(seen)
    assert got[0] == got[1] == want[:6]
    assert s.state.position == ref.state.position
    nxt = [x.run(more, 10, sampler, mode="plain").tokens for x in (ref, s)]
    assert nxt[0] == nxt[1]


def test_a_dspark_sessions_plain_steps_run_ahead_alike(tiny_dir, monkeypatch):
    """A DSpark session's plain steps — a plain request's, and the fallback's runs while the
    drafts keep failing — run a step ahead of the host too (Session._plain_ahead), each
    forward's draft windows committed behind it: the tokens, the plain steps counted and the
    live state (the draft windows included) equal the eager session's; a cancellation inside
    a run abandons its launched forward alike; the next DSpark turn continues alike."""
    model = Model.load(tiny_dir, "cpu", Numerics("vendor"))
    prompt, more = random_tokens(40, seed=9), random_tokens(7, seed=10)
    want = Session(model, 200).run(prompt, 30, mode="plain").tokens
    override = continuation_drafts(want, len(prompt), model.cfg.vocab_size, wrong_at=0)
    spec = SpecConfig(length=3, low_windows=2, plain_backoff=4)
    runs = []
    real = Session._plain_ahead

    def spy(self, first, params, steps, *rest):
        runs.append(steps)
        return (yield from real(self, first, params, steps, *rest))
    monkeypatch.setattr(Session, "_plain_ahead", spy)

    def pair():
        ref = Session(model, 200, speculative=spec, draft_override=override)
        s = Session(model, 200, speculative=spec, draft_override=override)
        _graphed(model, s)
        return ref, s

    def alike(ref, s):
        assert s.state.position == ref.state.position
        live, ref_live = s.state.live_tensors(), ref.state.live_tensors()
        assert all(torch.equal(live[k], ref_live[k]) for k in ref_live)
        nxt = [x.run(more, 12, mode="dspark").tokens for x in (ref, s)]
        assert nxt[0] == nxt[1]

    ref, s = pair()
    assert [x.run(prompt, 30, mode="dspark").tokens for x in (ref, s)] == [want, want]
    assert runs[:2] == [4, 8] and s.stats.backoffs == ref.stats.backoffs
    assert (s.stats.plain_steps, s.stats.windows) == (ref.stats.plain_steps, ref.stats.windows)
    alike(ref, s)
    # cancelled at the 5th token: inside the first plain run (tokens 4 … 7 after 2 windows)
    ref, s = pair()
    runs.clear()
    got = []
    for x in (ref, s):
        seen = []
        for t in x.generate(prompt, 30, mode="dspark",
                            should_stop=lambda seen=seen: len(seen) >= 5):
            seen.append(t)
        got.append(seen)
    assert got == [want[:5], want[:5]] and runs == [4]
    alike(ref, s)
    # a plain request on the DSpark session: one run ahead, the draft windows kept
    ref, s = pair()
    runs.clear()
    assert [x.run(prompt, 20, mode="plain").tokens for x in (ref, s)] == [want[:20]] * 2
    assert runs == [19]
    alike(ref, s)


def test_each_draft_is_launched_before_the_tokens_before_it_are_handed_over(tiny_dir,
                                                                            monkeypatch):
    """A graphed DSpark session launches a window's draft as soon as the step before it has
    committed (DSparkDecoder._draft_ahead), so the GPU drafts while the caller handles that
    step's tokens: when the caller gets a window's last token (the next anchor), the draft
    from it is already launched — and the tokens are plain decoding's, with it or without
    (STRATA_DRAFT_AHEAD=0)."""
    from strata.runtime import speculative
    model = Model.load(tiny_dir, "cpu", Numerics("vendor"))
    prompt = random_tokens(40, seed=9)
    want = Session(model, 200).run(prompt, 24, mode="plain").tokens
    full = continuation_drafts(want, len(prompt), model.cfg.vocab_size, wrong_at=10)
    launched = []
    real = speculative.DSparkDecoder._launch_draft

    def spy(self, anchor, params, position=None):
        launched.append(anchor)
        return real(self, anchor, params, position)
    monkeypatch.setattr(speculative.DSparkDecoder, "_launch_draft", spy)
    for ahead in (True, False):
        monkeypatch.setattr(speculative, "DRAFT_AHEAD", ahead)
        launched.clear()
        s = Session(model, 200, speculative=SpecConfig(length=3, low_windows=10 ** 6),
                    draft_override=full)
        _graphed(model, s)
        got, at_anchors = [], []
        for t in s.generate(prompt, 24, mode="dspark"):
            got.append(t)
            if len(got) % 4 == 1 and 1 < len(got) < 22:  # a window's last token (4 a window)
                at_anchors.append(len(launched))
        assert got == want and s.stats.accepted == s.stats.drafted
        k = range(1, len(at_anchors) + 1)
        assert at_anchors == [i + 1 if ahead else i for i in k], ahead


def test_the_next_draft_launches_behind_a_window_before_its_picks_are_read(tiny_dir,
                                                                           monkeypatch):
    """A graphed window launches the next step's draft right behind its commit, before the
    host reads the window's picks (DSparkDecoder._draft_behind): its anchor and position
    computed on the device from the window's tokens and picks. Whatever the window accepted
    (0 to all of its drafts, at a seeded sampler's positions), the draft the next window uses
    equals DSparkHead.draft's from that anchor on that state, and the tokens are plain
    decoding's."""
    from strata.runtime import speculative
    from strata.runtime.sampling import sample
    model = Model.load(tiny_dir, "cpu", Numerics("vendor"))
    prompt = random_tokens(40, seed=9)
    params = SamplingParams(0.8, 0.9, seed=5)
    want = Session(model, 200).run(prompt, 30, params, mode="plain").tokens
    vocab = model.cfg.vocab_size

    wrong_at = itertools.cycle(range(4))

    def varied(P, L):  # a window's draft at index 0, 1, 2, 3 (none), … wrong
        i, k = P - len(prompt), next(wrong_at)
        out = list(want[i + 1:i + 1 + L])
        if k < len(out):
            out[k] = (out[k] + 1) % vocab
        return out
    events = []
    launch, download, used = (speculative.DSparkDecoder._launch_draft, speculative.download,
                              speculative.DSparkDecoder._draft)

    def spy_launch(self, anchor, params, position=None):
        events.append("draft" if position is None else "draft behind")
        return launch(self, anchor, params, position)

    def spy_download(t):
        wait = download(t)

        def read():
            events.append("read")
            return wait()
        return read

    def checked(self, anchor, params):
        d = used(self, anchor, params)
        ref = model.dspark.draft(model.embed, model.head, anchor, self.session.state,
                                 model.numerics, lambda lg, pos: sample(lg, pos, params))
        assert torch.equal(d.tokens, ref.tokens) and torch.equal(d.confidence, ref.confidence)
        return d
    monkeypatch.setattr(speculative.DSparkDecoder, "_launch_draft", spy_launch)
    monkeypatch.setattr(speculative, "download", spy_download)
    monkeypatch.setattr(speculative.DSparkDecoder, "_draft", checked)
    s = Session(model, 200, speculative=SpecConfig(length=3, low_windows=10 ** 6),
                draft_override=varied)
    _graphed(model, s)
    assert s.run(prompt, 30, params, mode="dspark").tokens == want
    assert set(s.stats.committed) == {1, 2, 3, 4}
    behind = [i for i, e in enumerate(events) if e == "draft behind"]
    assert len(behind) >= s.stats.windows - 2  # (not where a window may end the budget)
    assert all(events[i + 1] == "read" for i in behind)


def test_a_fixed_length_window_launches_before_its_drafts_are_read(tiny_dir, monkeypatch):
    """A window whose length needs no read of its draft (SpecConfig.length) is launched on
    the draft's tokens where they are (DSparkDecoder._step: the window's tokens on the
    device, their host copy queued before it) and the host reads the drafts only once the
    window is launched — the tokens plain decoding's, sampled and greedy, with it and
    without (STRATA_WINDOW_AHEAD=0, every window's drafts then read before its launch). A
    draft override (oracle benchmarks, tests) is not read either: its windows launch on its
    tokens without waiting for the head's draft."""
    from strata.runtime import speculative
    model = Model.load(tiny_dir, "cpu", Numerics("vendor"))
    prompt = random_tokens(40, seed=9)
    events = []
    launch, download = GraphedForward.launch, speculative.download

    def spy_launch(self, tokens, logits, host_tokens=None):
        events.append("launch")
        return launch(self, tokens, logits, host_tokens)

    def spy_download(t):
        wait = download(t)

        def read():
            events.append(t.numel())  # (a window's L drafts, or its L + 1 picks)
            return wait()
        return read
    monkeypatch.setattr(GraphedForward, "launch", spy_launch)
    monkeypatch.setattr(speculative, "download", spy_download)
    for params in (SamplingParams(), SamplingParams(0.8, 0.9, seed=5)):
        want = Session(model, 200).run(prompt, 30, params, mode="plain").tokens
        for ahead in (True, False):
            monkeypatch.setattr(speculative, "WINDOW_AHEAD", ahead)
            s = Session(model, 200, speculative=SpecConfig(length=3, low_windows=10 ** 6))
            _graphed(model, s)
            events.clear()
            assert s.run(prompt, 30, params, mode="dspark").tokens == want, (params, ahead)
            # each window: launched, then (ahead) its L drafts read, then its L + 1 picks
            reads = [i for i, e in enumerate(events) if e != "launch"]
            drafts_read = [i for i in reads if events[i + 1:i + 2] == [events[i] + 1]]
            assert len(reads) == (2 if ahead else 1) * s.stats.windows, events
            assert len(drafts_read) == (s.stats.windows if ahead else 0), events
            assert all(events[i - 1] == "launch" for i in drafts_read)
    want = Session(model, 200).run(prompt, 30, mode="plain").tokens
    s = Session(model, 200, speculative=SpecConfig(length=3, low_windows=10 ** 6),
                draft_override=continuation_drafts(want, len(prompt), model.cfg.vocab_size))
    _graphed(model, s)
    events.clear()
    assert s.run(prompt, 30, mode="dspark").tokens == want
    assert len([e for e in events if e != "launch"]) == s.stats.windows  # (the picks alone)
