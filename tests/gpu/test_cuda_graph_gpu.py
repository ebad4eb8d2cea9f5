"""A forward captured in a CUDA graph (strata/runtime/static_step.StaticStep.run under
torch.cuda.graph) and replayed at the following positions gives the eager forward's logits bit
for bit — plain decode steps and 6-row windows, on the fp8/fp4 fixture and the EXL3 one — the
mechanism the graphed decode is built on (issues 7 and 8). The time of a replayed step against
the same step run eagerly is recorded ($STRATA_GPU_RESULTS), not asserted."""
from __future__ import annotations

import time

import pytest
import torch

from conftest import record
from strata.model.model import Model
from strata.model.numerics import Numerics
from strata.runtime.session import Session
from strata.runtime.static_step import StaticStep
from util import continuation_drafts, random_tokens, stops_alike, windows_roll_back_alike

pytestmark = pytest.mark.gpu


def _ms(fn, n: int = 20) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t) / n


@pytest.mark.parametrize("fixture", ["tiny_dir", "exl3_dir"])
@pytest.mark.parametrize("T, mode", [(1, "last"), (6, "all")])
def test_a_captured_step_replays_at_later_positions(cuda, request, fixture, T, mode):
    model = Model.load(request.getfixturevalue(fixture), cuda, Numerics.for_device(cuda))
    s = Session(model, 512)
    s.prefill(random_tokens(150, seed=3))
    ref = s.state.clone()
    step = StaticStep(model, s.state, T, mode)

    tokens = random_tokens(T, seed=20)
    want, _ = model.forward(tokens, ref, logits=mode)
    ctx = step.prepare(tokens)
    side = torch.cuda.Stream()  # warm-up off the capture stream: kernels compile, buffers exist
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step.run()
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(step.logits, want)
    # Eager time before the capture: an eager run after it would rebind step.logits to its
    # own output, away from the buffer the graph writes. (Same position: writes idempotent.)
    eager_ms = _ms(step.run)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the same step again: its writes are idempotent
        step.run()
    graph.replay()
    assert torch.equal(step.logits, want)
    replay_ms = _ms(graph.replay)
    step.finish(ctx)

    for i in range(1, 6):
        tokens = random_tokens(T, seed=20 + i)
        want, _ = model.forward(tokens, ref, logits=mode)
        ctx = step.prepare(tokens)
        graph.replay()
        assert torch.equal(step.logits, want), f"step {i}"
        step.finish(ctx)
    record(test="cuda_graph_step", fixture=fixture, T=T, eager_ms=eager_ms,
           replay_ms=replay_ms)
    print(f"{fixture} T={T}: eager {eager_ms:.2f} ms, graph replay {replay_ms:.2f} ms")


@pytest.mark.parametrize("fixture", ["tiny_dir", "exl3_dir"])
def test_graphed_decode_gives_the_eager_tokens(cuda, request, fixture):
    """Session(graphs=True): plain decode replayed from graphs (runtime/graphs.py), across an
    entry-bucket edge (a new capture there), gives eager decoding's tokens; the graphed
    steps are replays after one capture per bucket."""
    model = Model.load(request.getfixturevalue(fixture), cuda, Numerics.for_device(cuda))
    edge = 257 * min(model.index_ratios) - 1  # a step here needs the second entry bucket
    prompt = random_tokens(edge - 10, seed=5)
    want = Session(model, edge + 64).run(prompt, 40, mode="plain").tokens
    s = Session(model, edge + 64, graphs=True)
    assert s.run(prompt, 40, mode="plain").tokens == want
    g = s.graphed
    assert g.captures == 2 and g.replays == 39 - 2, (g.captures, g.replays)


@pytest.mark.parametrize("fixture", ["tiny_dir", "exl3_dir"])
def test_graphed_plain_decode_runs_a_step_ahead_of_the_host(cuda, request, fixture,
                                                            monkeypatch):
    """Session._plain_ahead on CUDA graphs: each step launched on the token its
    predecessor's sampler left on the device (StaticStep.prepare copies it into the fixed
    inputs on the stream), the token read through pinned memory while the step runs. Greedy
    and a seeded sampler give the eager loop's tokens; a stop abandons the step launched on
    the stop token with the eager loop's position and live state, and the next turn
    continues alike. A step on device tokens where the host would hash the Engram ids is
    refused."""
    from strata.runtime.sampling import SamplingParams
    model = Model.load(request.getfixturevalue(fixture), cuda, Numerics.for_device(cuda))
    prompt, more = random_tokens(60, seed=9), random_tokens(7, seed=10)
    sampler = SamplingParams(temperature=0.8, top_p=0.9, seed=4)
    for params in (SamplingParams(), sampler):
        want = Session(model, 200).run(prompt, 30, params, mode="plain").tokens
        s = Session(model, 200, graphs=True)
        assert s._runs_ahead(None)
        assert s.run(prompt, 30, params, mode="plain").tokens == want
    stop = next(t for i, t in enumerate(want) if i >= 5 and t not in want[:i])
    s = Session(model, 200, graphs=True)
    stops_alike(Session(model, 200), s, prompt, more, sampler, 30, stop)
    step = StaticStep(model, s.state, 1)
    monkeypatch.setattr(Model, "hashes_on_device", property(lambda self: False))
    with pytest.raises(ValueError, match="stay on the device"):
        step.prepare(torch.tensor([5], device=cuda))


@pytest.mark.parametrize("fixture", ["tiny_dir", "exl3_dir"])
def test_graphed_verify_windows(cuda, request, fixture):
    """DSpark verify windows replayed from graphs inside journals: a replayed window rolled
    back equals the eager one ring for ring, and DSpark with rejected drafts gives plain
    decoding's tokens."""
    from strata.runtime.speculative import SpecConfig
    model = Model.load(request.getfixturevalue(fixture), cuda, Numerics.for_device(cuda))
    s = Session(model, 128, graphs=True)
    s.prefill(random_tokens(30, seed=10))
    windows_roll_back_alike(model, s.state, s.graphed, s.state.clone())
    assert (s.graphed.captures, s.graphed.replays) == (1, 2)

    prompt = random_tokens(60, seed=6)
    want = Session(model, 160).run(prompt, 40, mode="plain").tokens
    override = continuation_drafts(want, len(prompt), model.cfg.vocab_size)
    spec = SpecConfig(length=model.cfg.dspark_block_size, low_windows=10 ** 9)
    g = Session(model, 160, speculative=spec, draft_override=override, graphs=True)
    assert g.run(prompt, 40, mode="dspark").tokens == want
    assert g.stats.accepted < g.stats.drafted and g.graphed.replays >= g.stats.windows - 2


@pytest.mark.parametrize("fixture", ["tiny_dir", "exl3_dir"])
def test_graphed_windows_priced_and_followed(cuda, request, fixture):
    """measure_costs(graphs=True) times windows of 1 … block + 1 rows and a draft from
    replays (each shape's capture untimed, the scratch session's graphs released after); a
    graphed session following prices where two drafts cost what a step does and more cost
    far more verifies windows of two drafts and gives plain decoding's tokens."""
    from strata.runtime.speculative import SpecConfig, measure_costs
    model = Model.load(request.getfixturevalue(fixture), cuda, Numerics.for_device(cuda))
    block = model.cfg.dspark_block_size
    costs, draft = measure_costs(model, block + 1, repeats=2, graphs=True)
    assert len(costs) == block + 1 and min(costs) > 0 and draft > 0
    print(f"{fixture}: window ms by rows {[round(1e3 * c, 2) for c in costs]}, "
          f"draft {1e3 * draft:.2f}")
    prompt = random_tokens(60, seed=6)
    want = Session(model, 160).run(prompt, 30, mode="plain").tokens
    override = continuation_drafts(want, len(prompt), model.cfg.vocab_size)
    prices = ([1.0] * 3 + [1e3] * (block - 2), 0.0)
    s = Session(model, 160, speculative=SpecConfig(low_windows=10 ** 9),
                draft_override=override, costs=prices, graphs=True)
    assert s.run(prompt, 30, mode="dspark").tokens == want
    st = s.stats
    assert st.windows < st.drafted <= 2 * st.windows and s.graphed.replays > 0


@pytest.mark.parametrize("fixture", ["tiny_dir", "exl3_dir"])
def test_graphed_draft(cuda, request, fixture):
    """The DSpark draft's stages and head, and its Markov picks with the request's sampler
    (greedy; temperature and top-p), replayed from graphs at later positions give
    DSparkHead.draft's drafts, logits and confidences bit for bit."""
    from strata.runtime.sampling import SamplingParams, sample
    from strata.runtime.speculative import SpecConfig
    model = Model.load(request.getfixturevalue(fixture), cuda, Numerics.for_device(cuda))
    s = Session(model, 96, speculative=SpecConfig(), graphs=True)
    s.prefill(random_tokens(40, seed=12))
    nx = model.numerics
    samplers = [SamplingParams(), SamplingParams(0.8, 0.9, seed=3), SamplingParams(seed=5),
                SamplingParams(0.8, 0.9, seed=8)]  # (the sampler's capture, another seed)
    for anchor, params in zip((7, 100, 31, 55), samplers):
        def pick(lg, positions):
            return sample(lg, positions, params)
        want = model.dspark.draft(model.embed, model.head, anchor, s.state, nx, pick)
        got = s.graphed.draft(anchor, params)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logits, want.logits)
        assert torch.equal(got.confidence, want.confidence)
        start = s.state.position
        _, ctx = model.forward(torch.tensor([anchor]), s.state, logits="none")
        model.dspark.commit_context(model.dspark.main_hidden(ctx), start, s.state, nx)
    # the region and two samplers captured; the region replayed 3×, each sampler once
    assert (s.graphed.captures, s.graphed.replays) == (3, 5)


@pytest.mark.parametrize("fixture", ["tiny_dir", "exl3_dir"])
def test_graphed_commit_of_the_draft_windows(cuda, request, fixture):
    """DSparkHead.commit_context of a decode-time forward's first rows replayed from CUDA
    graphs (one per row count) at later positions: the DSpark window rings equal the eager
    commit's bit for bit (the tokens alone would not show a wrong window: only acceptance)."""
    from strata.runtime.speculative import SpecConfig
    model = Model.load(request.getfixturevalue(fixture), cuda, Numerics.for_device(cuda))
    nx = model.numerics
    s = Session(model, 96, speculative=SpecConfig(), graphs=True)
    s.prefill(random_tokens(40, seed=13))
    ref = s.state.clone()
    for rows, tokens in ((1, [7]), (3, [5, 9, 11, 12]), (1, [4]), (3, [8, 2, 6])):
        start = s.state.position
        _, ctx = s.graphed.forward(torch.tensor(tokens), "all")
        s.graphed.commit_context(ctx, rows, start)
        _, rctx = model.forward(torch.tensor(tokens), ref, logits="all")
        model.dspark.commit_context(model.dspark.main_hidden(rctx)[:rows], start, ref, nx)
        for mine, theirs in zip(s.state.dspark, ref.dspark):
            assert torch.equal(mine.rows, theirs.rows) and torch.equal(mine.tags, theirs.tags)
    assert sorted(s.graphed._commits) == [1, 3]


def test_graphs_hold_the_set_plans_they_read(cuda, exl3_dir):
    """A graph keeps the EXL3 ragged-set plans its kernels read by address (strata.captures):
    the plan cache emptied halfway through a graphed DSpark run — and the freed memory handed
    back to the driver and refilled with junk — the graphs' replays still give plain
    decoding's tokens, their plans alive in them. (Before, a plan the cache dropped was
    freed while a graph read its table: an illegal-address fault on the H200, in a
    benchmark's later session, once ~700 plans had overflowed the cache's old limit.)"""
    from strata.kernels import exl3 as X
    from strata.runtime.speculative import SpecConfig
    model = Model.load(exl3_dir, cuda, Numerics.for_device(cuda))
    prompt = random_tokens(60, seed=6)
    want = Session(model, 160).run(prompt, 40, mode="plain").tokens
    override = continuation_drafts(want, len(prompt), model.cfg.vocab_size)
    spec = SpecConfig(length=model.cfg.dspark_block_size, low_windows=10 ** 9)
    g = Session(model, 160, speculative=spec, draft_override=override, graphs=True)
    run = g.generate(prompt, 40, mode="dspark")
    got = [next(run) for _ in range(20)]
    gr = g.graphed
    graphs = [x for c in gr.captured.values() for x in c.graph.graphs]
    graphs += [x for r in gr._commits.values() for x in r.graph.graphs]
    held = [p for x in graphs for p in x.held if isinstance(p, X._SetPlan)]
    assert held
    torch.cuda.synchronize()
    X._SET_PLANS.clear()
    torch.cuda.empty_cache()
    junk = [torch.full((64,), -1, dtype=torch.int64, device=cuda) for _ in range(4096)]
    replays = gr.replays
    got += list(run)
    assert got == want and gr.replays > replays
    del junk


@pytest.mark.parametrize("fixture", ["tiny_dir", "exl3_dir"])
def test_a_dspark_sessions_plain_steps_run_ahead_on_graphs(cuda, request, fixture):
    """A graphed DSpark session's plain steps run a step ahead of the host (Session.
    _plain_ahead, the draft windows committed behind each forward by the commit graph): the
    fallback's runs while the drafts keep failing, and a plain request, give the eager
    session's tokens, plain steps and live state (the draft windows included), and the next
    DSpark turn continues alike."""
    from strata.runtime.speculative import SpecConfig
    model = Model.load(request.getfixturevalue(fixture), cuda, Numerics.for_device(cuda))
    prompt, more = random_tokens(40, seed=9), random_tokens(7, seed=10)
    want = Session(model, 200).run(prompt, 30, mode="plain").tokens
    override = continuation_drafts(want, len(prompt), model.cfg.vocab_size, wrong_at=0)
    spec = SpecConfig(length=3, low_windows=2, plain_backoff=4)
    for mode, n in (("dspark", 30), ("plain", 20)):
        ref = Session(model, 200, speculative=spec, draft_override=override)
        s = Session(model, 200, speculative=spec, draft_override=override, graphs=True)
        assert s._runs_ahead(None)
        assert [x.run(prompt, n, mode=mode).tokens for x in (ref, s)] == [want[:n]] * 2
        if mode == "dspark":
            assert s.stats.plain_steps == ref.stats.plain_steps >= 12
        live, ref_live = s.state.live_tensors(), ref.state.live_tensors()
        assert all(torch.equal(live[k], ref_live[k]) for k in ref_live), mode
        nxt = [x.run(more, 12, mode="dspark").tokens for x in (ref, s)]
        assert nxt[0] == nxt[1]


@pytest.mark.parametrize("drafts", [None, 3])
def test_the_servers_engine_on_graphs_gives_a_cold_eager_sessions_tokens(cuda, tiny_dir,
                                                                         drafts):
    """The server's engine as `strata serve` runs it by default (warmed up, CUDA graphs kept
    on the retained states), plain and with DSpark windows of `drafts` drafts (`--speculative`): a
    conversation continued, a fork truncated back into it and a fresh prompt, greedy and
    sampled — each request's tokens those of a cold eager plain session."""
    import threading

    from strata.runtime.engine import Engine, Failed, Finished, GenRequest, Started, Token
    from strata.runtime.sampling import SamplingParams
    model = Model.load(tiny_dir, cuda, Numerics.for_device(cuda))

    def run(engine, prompt, params):
        done, events = threading.Event(), []

        def on_event(ev):
            events.append(ev)
            if isinstance(ev, (Finished, Failed)):
                done.set()
        engine.submit(GenRequest(list(prompt), 6, params, stop_ids=frozenset()), on_event)
        assert done.wait(120) and not isinstance(events[-1], Failed), events
        started = next(e for e in events if isinstance(e, Started))
        return [e.id for e in events if isinstance(e, Token)], started.cached_tokens

    def cold(prompt, params):
        return Session(model, 1024).run(list(prompt), 6, params, stop_ids=frozenset()).tokens

    from strata.runtime.speculative import SpecConfig
    spec = None if drafts is None else SpecConfig(length=drafts)
    eng = Engine(model, 1024, prefill_chunk=64, graphs=True, speculative=spec)
    assert eng.warm_up() > 0 and len(eng.cache) == 0  # (as serve starts on CUDA)
    eng.start()
    try:
        for k, params in enumerate((SamplingParams(), SamplingParams(1.0, 0.9, 3))):
            def prompt(n, seed):  # (each pass its own prompts: nothing shared across them)
                return random_tokens(n, seed=10 * k + seed).tolist()
            base = prompt(200, 1)
            out, cached = run(eng, base, params)
            assert cached == 0 and out == cold(base, params)
            p2 = base + out + prompt(30, 2)
            out2, cached = run(eng, p2, params)
            assert cached == len(base) + len(out) - 1 and out2 == cold(p2, params)
            p3 = p2[:220] + prompt(10, 3)
            out3, cached = run(eng, p3, params)
            assert cached == 220 and out3 == cold(p3, params)
            other = [4 + k] + prompt(50, 6)
            out4, cached = run(eng, other, params)
            assert cached == 0 and out4 == cold(other, params)
    finally:
        eng.stop()


@pytest.mark.parametrize("fixture", ["tiny_dir", "exl3_dir"])
def test_graphed_logprobs_are_the_eager_sessions(cuda, request, fixture):
    """A request for logprobs on graphs (plain steps not run ahead; DSpark windows with some
    drafts rejected): the tokens and every token's figures those of an eager session."""
    from strata.runtime.sampling import Logprobs, SamplingParams
    from strata.runtime.speculative import SpecConfig
    model = Model.load(request.getfixturevalue(fixture), cuda, Numerics.for_device(cuda))
    prompt = random_tokens(40, seed=12)
    want = Session(model, 200).run(prompt, 24, mode="plain").tokens
    override = continuation_drafts(want, len(prompt), model.cfg.vocab_size, wrong_at=1)
    for spec in (None, SpecConfig(length=3)):
        runs = []
        for graphs in (False, True):
            lp = Logprobs(top=5)
            s = Session(model, 200, speculative=spec, graphs=graphs,
                        draft_override=None if spec is None else override)
            toks = list(s.generate(prompt, 24, SamplingParams(), stop_ids=frozenset(),
                                   logprobs=lp))
            assert toks == want and len(lp.items) == 24
            runs.append(lp.items)
        assert runs[0] == runs[1], spec


def test_graphed_constrained_generation_is_the_eager_sessions(cuda, real_vocab_dir):
    """A response format on graphs (plain steps and DSpark windows; the masks applied to the
    replayed logits on the device): the eager plain session's tokens, an answer that parses
    and fits the schema."""
    import json

    from strata.runtime.constraint import Grammars, grammar, json_answer
    from strata.runtime.sampling import SamplingParams
    from strata.runtime.speculative import SpecConfig
    from strata.tokenizer import load_tokenizer
    model = Model.load(real_vocab_dir, cuda, Numerics.for_device(cuda))
    tok = load_tokenizer(real_vocab_dir)
    schema = {"type": "object", "required": ["ok", "n"], "additionalProperties": False,
              "properties": {"ok": {"type": "boolean"},
                             "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    grammars = Grammars(tok.to_str(), model.cfg.vocab_size, [model.cfg.eos_token_id])
    prompt = tok.encode("Answer in JSON:", add_special_tokens=False).ids
    runs = []
    for graphs in (False, True):
        for mode in ("plain", "dspark"):
            s = Session(model, 400, speculative=SpecConfig(length=3), graphs=graphs)
            runs.append(list(s.generate(
                prompt, 200, SamplingParams(temperature=1.0, seed=9), mode=mode,
                constraint=grammars.constraint(grammar(json_answer(schema))))))
    assert all(r == runs[0] for r in runs[1:])
    assert runs[0][-1] == model.cfg.eos_token_id
    answer = json.loads(tok.decode(runs[0][:-1]))
    assert set(answer) == {"ok", "n"} and type(answer["ok"]) is bool
