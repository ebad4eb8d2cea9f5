"""Prefix reuse, cancellation and faults: over real HTTP with the fixture model, and the
engine's prefix cache directly (every way back to a common prefix: truncate, bookmark, fresh)."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
import torch

from strata.model.model import Model
from strata.runtime.engine import Engine, Failed, Finished, GenRequest, Started, Token
from strata.runtime.prefix_cache import PrefixCache, Retained
from strata.runtime.sampling import SamplingParams
from strata.runtime.session import Session
from tests.serve_helpers import M, LiveServer, sse_events


@pytest.fixture(scope="module")
def model(real_vocab_dir):
    return Model.load(real_vocab_dir)


@pytest.fixture(scope="module")
def live(model, real_vocab_dir):
    with LiveServer(model, real_vocab_dir, capacity=8192, prefill_chunk=256) as srv:
        yield srv


@pytest.fixture(scope="module")
def cold(model, real_vocab_dir):
    """A second server that retains nothing: every request runs cold."""
    with LiveServer(model, real_vocab_dir, capacity=8192, prefix_cache_bytes=0) as srv:
        yield srv


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def chat(srv, messages, n=6, **kw):
    return client(srv).chat.completions.create(model=M, messages=messages, max_tokens=n,
                                               seed=5, **kw)


def text(r) -> tuple[str, str]:
    m = r.choices[0].message
    return (m.model_extra.get("reasoning_content") or "", m.content or "")


def test_second_turn_reuses_the_prefix_and_equals_a_cold_run(live, cold):
    turn1 = [{"role": "system", "content": "You help with code."},
             {"role": "user", "content": "Write a haiku about caches."}]
    r1 = chat(live, turn1)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    reasoning, content = text(r1)
    turn2 = turn1 + [{"role": "assistant", "content": content, "reasoning_content": reasoning},
                     {"role": "user", "content": "Now one about queues."}]
    r2 = chat(live, turn2)
    r2_cold = chat(cold, turn2)
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    assert r2_cold.usage.prompt_tokens_details.cached_tokens == 0
    assert text(r2) == text(r2_cold)
    assert (r2.usage.prompt_tokens, r2.usage.completion_tokens) == \
        (r2_cold.usage.prompt_tokens, r2_cold.usage.completion_tokens)
    # The same request again continues the retained state even further.
    r3 = chat(live, turn2)
    assert r3.usage.prompt_tokens_details.cached_tokens == r3.usage.prompt_tokens - 1
    assert text(r3) == text(r2)


def test_conversations_do_not_disturb_each_other(live, cold):
    a = [{"role": "user", "content": "Explain recursion in one line."}]
    b = [{"role": "user", "content": "Explain iteration in one line."}]
    want_a, want_b = text(chat(cold, a)), text(chat(cold, b))
    for _ in range(2):  # interleaved, each continuing its own retained state
        assert text(chat(live, a)) == want_a
        assert text(chat(live, b)) == want_b


def test_cancel_mid_stream_then_same_output_as_a_fresh_server(live, cold):
    long = [{"role": "user", "content": "Tell a long story about a lighthouse."}]
    with httpx.stream("POST", live.url + "/v1/chat/completions", timeout=60, json={
            "model": M, "messages": long, "max_tokens": 400, "stream": True, "seed": 1}) as s:
        lines = s.iter_lines()
        n = 0
        for line in lines:
            n += line.startswith("data: ")
            if n == 4:
                break  # leave mid-stream: the client closes the connection
    t0 = time.monotonic()
    live.wait_idle()
    assert time.monotonic() - t0 < 5  # the worker was freed, long before 400 tokens
    follow = [{"role": "user", "content": "Tell a long story about a lighthouse keeper."}]
    assert text(chat(live, follow)) == text(chat(cold, follow))
    assert text(chat(live, long, n=4)) == text(chat(cold, long, n=4))


def test_cancel_non_streamed_request(live):
    def ask():
        try:
            httpx.post(live.url + "/v1/chat/completions", timeout=0.5, json={
                "model": M, "max_tokens": 400, "messages": [{"role": "user", "content": "x"}]})
        except httpx.TimeoutException:
            pass  # the client gave up and disconnected

    ask()
    t0 = time.monotonic()
    live.wait_idle()
    assert time.monotonic() - t0 < 5


def test_engine_exception_is_reported_and_the_next_request_works(live, model):
    bad = model.cfg.vocab_size + 7  # the scripted token is fed to the next forward: it fails
    live.script([{"match": "FAULT", "tokens": [100, bad]}])
    try:
        msgs = [{"role": "user", "content": "FAULT please"}]
        r = live.post("/v1/chat/completions", {"model": M, "messages": msgs, "max_tokens": 5})
        assert r.status_code == 500
        assert "token ids must be in" in r.json()["error"]["message"]
        with httpx.stream("POST", live.url + "/v1/messages", timeout=60, json={
                "model": M, "messages": msgs, "max_tokens": 5, "stream": True}) as s:
            events = sse_events(s)
        assert events[-1][0] == "error" and "token ids" in events[-1][1]
        with httpx.stream("POST", live.url + "/v1/responses", timeout=60, json={
                "model": M, "input": msgs, "max_output_tokens": 5, "stream": True}) as s:
            events = [(name, json.loads(data)) for name, data in sse_events(s)]
        assert events[-1][0] == "error" and "token ids" in events[-1][1]["message"]
        # (the error event continues the stream's numbering, as every Responses event does)
        assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    finally:
        live.script(None)
    r = chat(live, [{"role": "user", "content": "hello again"}])
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens > 0


def test_request_during_prefill_waits_then_completes(live, cold):
    """A arrives first with a long prompt; B arrives while A prefills, waits in the queue
    (seen on /health) and completes with the output it has alone."""
    big = [{"role": "user", "content": "lorem ipsum " * 600}]
    small = [{"role": "user", "content": "Short question?"}]
    want_b = text(chat(cold, small))
    live.engine.cache.clear()
    out: dict[str, object] = {}
    lines_a: list[str] = []

    def run_a():
        with httpx.stream("POST", live.url + "/v1/chat/completions", timeout=120, json={
                "model": M, "messages": big, "max_tokens": 3, "stream": True}) as s:
            lines_a.extend(line for line in s.iter_lines() if line)
        out["a"] = True

    ta = threading.Thread(target=run_a)
    ta.start()
    deadline = time.monotonic() + 30
    while live.engine.running is None and time.monotonic() < deadline:
        time.sleep(0.01)
    tb = threading.Thread(target=lambda: out.__setitem__("b", text(chat(live, small))))
    tb.start()
    seen_waiting = False
    while tb.is_alive() and time.monotonic() < deadline:
        seen_waiting |= httpx.get(live.url + "/health").json()["queue_depth"] == 1
        time.sleep(0.02)
    ta.join(60)
    tb.join(60)
    assert seen_waiting
    assert out.get("a") and out.get("b") == want_b
    # The first event (the assistant role) goes out when A starts; while its prompt is
    # prefilled, keep-alive comments hold the connection until the first token.
    assert lines_a[0].startswith("data: ") and lines_a[1] == ": keep-alive"


def test_full_queue_gets_429_with_retry_after(model, real_vocab_dir):
    with LiveServer(model, real_vocab_dir, capacity=2048, max_queue=1) as srv:
        body = {"model": M, "messages": [{"role": "user", "content": "go"}], "max_tokens": 400,
                "stream": True}
        streams = []
        try:
            for _ in range(2):  # one running, one waiting
                cm = httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60)
                s = cm.__enter__()
                assert s.status_code == 200
                streams.append(cm)
                deadline = time.monotonic() + 10
                while srv.engine.running is None and time.monotonic() < deadline:
                    time.sleep(0.01)
            deadline = time.monotonic() + 10
            while srv.engine.queue_depth < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            r = srv.post("/v1/chat/completions", dict(body, stream=False))
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            r = srv.post("/v1/messages", dict(body, stream=False))
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        finally:
            for cm in streams:
                cm.__exit__(None, None, None)
        srv.wait_idle()
        r = srv.post("/v1/chat/completions", dict(body, stream=False, max_tokens=2))
        assert r.status_code == 200


def test_metrics(live):
    chat(live, [{"role": "user", "content": "metrics please"}])
    chat(live, [{"role": "user", "content": "metrics please"}])
    text_ = httpx.get(live.url + "/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text_.splitlines()
              if line and not line.startswith("#")}
    assert values["strata_prompt_tokens_total"] > 0
    assert values["strata_generated_tokens_total"] > 0
    assert values["strata_prefix_cache_hit_tokens_total"] > 0
    assert values["strata_decode_tokens_per_second"] > 0
    assert values["strata_time_to_first_token_seconds_count"] >= 2
    assert values["strata_queue_depth"] == 0
    assert values['strata_requests_total{endpoint="chat",outcome="ok"}'] >= 2


def test_metrics_count_each_requests_outcome(live):
    """A non-streamed request whose client leaves is `cancelled`, not `ok`; a stream closed
    early too, its delivered tokens counted; a request refused before it runs, by the kind of
    error (invalid_request, not_found, …)."""
    def values():
        text_ = httpx.get(live.url + "/metrics").text
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text_.splitlines()
                if line and not line.startswith("#")}

    def outcome(v, what, endpoint="chat"):
        return v.get(f'strata_requests_total{{endpoint="{endpoint}",outcome="{what}"}}', 0)
    before = values()
    body = {"model": M, "messages": [{"role": "user", "content": "go on and on"}],
            "max_tokens": 4000, "reasoning_effort": "none", "temperature": 0}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(live.url + "/v1/chat/completions", json=body, timeout=1.0)
    with httpx.stream("POST", live.url + "/v1/chat/completions", json=dict(body, stream=True),
                      timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 8:
                break
    live.wait_idle(60)
    assert live.post("/v1/chat/completions", dict(body, max_tokens=0)).status_code == 400
    assert live.post("/v1/messages", {"model": "nope", "max_tokens": 1,
                                      "messages": body["messages"]}).status_code == 404
    after = values()
    assert outcome(after, "cancelled") == outcome(before, "cancelled") + 2
    assert outcome(after, "ok") == outcome(before, "ok")
    assert outcome(after, "invalid_request") == outcome(before, "invalid_request") + 1
    assert outcome(after, "not_found", "messages") == outcome(before, "not_found",
                                                              "messages") + 1
    assert (after["strata_generated_tokens_total"]
            >= before["strata_generated_tokens_total"] + 4)


def test_metrics_report_disk_engram_rows(real_vocab_dir):
    """With the Engram tables on disk, /metrics shows each table's rows by how they were
    served, and the bytes read."""
    disk = Model.load(real_vocab_dir, engram="disk", engram_cache_bytes=1 << 20)
    with LiveServer(disk, real_vocab_dir, capacity=2048) as srv:
        chat(srv, [{"role": "user", "content": "rows from disk"}], n=3)
        text_ = httpx.get(srv.url + "/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text_.splitlines()
              if line and not line.startswith("#")}
    for layer in disk.cfg.engram_layer_ids:
        served = [values[f'strata_engram_rows_total{{layer="{layer}",outcome="{o}"}}']
                  for o in ("cache_hits", "prefetch_hits", "misses")]
        assert sum(served) > 0, (layer, served)
        assert values[f'strata_engram_read_bytes_total{{layer="{layer}"}}'] > 0
    for store in disk.engram_stores.values():
        store.close()


# ---- the prefix cache and engine directly (small-vocabulary fixture) ----------------------------
def _run(engine: Engine, prompt, n=6, params=SamplingParams(1.0, 0.9, 3)):
    done, events = threading.Event(), []

    def on_event(ev):
        events.append(ev)
        if isinstance(ev, (Finished, Failed)):
            done.set()

    engine.submit(GenRequest(list(prompt), n, params, stop_ids=frozenset()), on_event)
    assert done.wait(60)
    started = next(e for e in events if isinstance(e, Started))
    return [e.id for e in events if isinstance(e, Token)], started.cached_tokens


def _cold(model, prompt, n=6, params=SamplingParams(1.0, 0.9, 3)):
    return Session(model, 1024).run(list(prompt), n, params, stop_ids=frozenset()).tokens


def _prompt(seed, n):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefix_cache_truncate_bookmark_and_fork(tiny_reference):
    eng = Engine(tiny_reference, 1024, prefill_chunk=64).start()
    try:
        base = _prompt(1, 200)
        out, cached = _run(eng, base)
        assert cached == 0 and out == _cold(tiny_reference, base)
        # Continuation: the retained state is handed over whole.
        p2 = base + out + _prompt(2, 30)
        out2, cached = _run(eng, p2)
        assert cached == len(base) + len(out) - 1 and out2 == _cold(tiny_reference, p2)
        # Diverging close to the end: a fork truncated (the rings still hold what follows).
        p3 = p2[:220] + _prompt(3, 10)
        out3, cached = _run(eng, p3)
        assert cached == 220 and out3 == _cold(tiny_reference, p3)
        # The fork left the original alone: p2's conversation continues whole.
        p2b = p2 + out2 + [5, 6]
        out2b, cached = _run(eng, p2b)
        assert cached == len(p2) + len(out2) - 1 and out2b == _cold(tiny_reference, p2b)
        # Nothing in common: a fresh state.
        other = [4] + _prompt(6, 50)
        out6, cached = _run(eng, other)
        assert cached == 0 and out6 == _cold(tiny_reference, other)
    finally:
        eng.stop()


@pytest.mark.parametrize("drafts", [None, 3])
def test_a_warm_up_retains_nothing_and_changes_no_answer(tiny_reference, drafts):
    """Engine.warm_up (strata serve's start on CUDA) runs a throwaway request's work —
    plain or with DSpark windows — and leaves the prefix cache empty: the first request
    starts cold and gets a cold session's tokens."""
    from strata.runtime.speculative import SpecConfig
    spec = None if drafts is None else SpecConfig(length=drafts)
    eng = Engine(tiny_reference, 1024, prefill_chunk=64, speculative=spec)
    assert eng.warm_up() > 0 and len(eng.cache) == 0
    eng.start()
    try:
        base = _prompt(1, 100)
        out, cached = _run(eng, base)
        assert cached == 0 and out == _cold(tiny_reference, base)
    finally:
        eng.stop()


def test_prefix_cache_restores_a_bookmark_past_the_rings_reach(tiny_reference):
    eng = Engine(tiny_reference, 1024, prefill_chunk=64).start()
    try:
        base = _prompt(1, 200)
        out, _ = _run(eng, base)
        long = base + out + _prompt(4, 400)  # goes far past the rings' 256 rows
        _run(eng, long)
        # Diverging right after `base`: truncation cannot reach back that far; the bookmark
        # taken one token before the end of the first prompt is restored.
        p4 = base + _prompt(5, 20)
        entry = next(iter(eng.cache._entries.values()))[0]
        assert not entry.state.can_truncate(len(base))
        assert [b.position for b in entry.bookmarks][0] == len(base) - 1
        out4, cached = _run(eng, p4)
        assert cached == len(base) - 1 and out4 == _cold(tiny_reference, p4)
    finally:
        eng.stop()


def test_prefix_cache_budget_evicts_least_recent(tiny_reference):
    one = Retained(tiny_reference.new_state(256)).nbytes()
    cache = PrefixCache(budget_bytes=2 * one + one // 2)
    for seed in range(3):
        entry = Retained(tiny_reference.new_state(256))
        tiny_reference.forward(torch.tensor(_prompt(seed, 20)), entry.state, logits="none")
        cache.put(entry)
    assert len(cache) == 2 and cache.nbytes <= cache.budget_bytes
    assert cache.take(torch.tensor(_prompt(0, 20) + [1]))[0] is None  # the oldest went
    entry, cached = cache.take(torch.tensor(_prompt(2, 20) + [1]))
    assert entry is not None and cached == 20
    assert PrefixCache(0).take(torch.tensor([1, 2])) == (None, 0)


def test_a_budget_below_one_conversation_says_so_once(tiny_reference, caplog):
    """A budget no conversation fits in retains nothing — the operator is told (once), not
    left to find the prefix-cache hits at zero."""
    one = Retained(tiny_reference.new_state(256)).nbytes()
    cache = PrefixCache(budget_bytes=one // 2)
    with caplog.at_level("WARNING", logger="strata.prefix_cache"):
        for _ in range(2):
            cache.put(Retained(tiny_reference.new_state(256)))
    assert len(cache) == 0
    warned = [r for r in caplog.records if "--prefix-cache-mb" in r.getMessage()]
    assert len(warned) == 1 and "no prompt is reused" in warned[0].getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger="strata.prefix_cache"):
        PrefixCache(0).put(Retained(tiny_reference.new_state(256)))  # (0: reuse off, quietly)
    assert not caplog.records


def test_a_retained_states_graphs_count_in_the_budget(tiny_reference, monkeypatch):
    """A retained state keeps its CUDA graphs, whose memory pools hold device memory (their
    scratch stays reserved while the graphs live): the prefix cache counts the segments
    the allocator gives the state's pools. torch.cuda's capture and allocator are stand-ins
    here (no CUDA in CI): each capture's run takes a segment as large as a state's caches
    in its pool, another pool (someone else's graphs) holds one too; what is checked is
    the accounting — only this state's pools' segments, counted with the caches, none once
    the graphs are released (the eviction's)."""
    import contextlib
    import itertools
    from strata.runtime.graphs import CudaGraphs, GraphedForward
    segments, current, ids = [], [None], itertools.count()

    class Graph:
        pass

    @contextlib.contextmanager
    def graph(g, pool=None):
        current[0] = pool
        yield
        current[0] = None
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, next(ids) + 1))
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: list(segments))

    caches = Retained(tiny_reference.new_state(256)).nbytes()

    def take():
        segments.append({"total_size": caches, "segment_pool_id": current[0]})
    segments.append({"total_size": 7 * caches, "segment_pool_id": (0, 0)})  # (not a pool)
    entry = Retained(tiny_reference.new_state(256))
    g = GraphedForward(tiny_reference, entry.state, CudaGraphs())
    entry.state.graphs = g
    other = CudaGraphs()  # another state's graphs
    other.capture(take, entry.state, "steps")
    assert g.nbytes() == 0
    for pool in ("steps", "steps", "draft"):
        g.backend.capture(take, entry.state, pool)
    assert g.nbytes() == 3 * caches and entry.nbytes() == 4 * caches
    assert other.pool_bytes() == caches
    cache = PrefixCache(budget_bytes=5 * caches + caches // 2)
    cache.put(entry)
    cache.put(Retained(tiny_reference.new_state(256)))
    assert len(cache) == 2  # 5 states' worth: within the budget
    cache.put(Retained(tiny_reference.new_state(256)))
    assert len(cache) == 2 and cache.nbytes == 2 * caches  # 6 over it: the graphed one went first
    assert entry.state.graphs is None and g.nbytes() == 0 and g.backend.pools == {}


def test_evicted_and_failed_states_let_go_of_their_graphs(tiny_reference, monkeypatch):
    """A state and its CUDA graphs refer to each other: a state the prefix cache evicts or
    clears, or a failed request's, drops its graphs, so its memory is freed at once — not
    at a cycle collection, which may not come for long (GBs of caches at long context).
    (On the CPU the graphs object is made but runs its forwards eagerly; what is checked is
    that nothing keeps the state alive.)"""
    import gc
    import weakref
    from strata.runtime.state import State
    one = Retained(tiny_reference.new_state(256)).nbytes()
    cache = PrefixCache(budget_bytes=one + one // 2)
    first = Retained(tiny_reference.new_state(256))
    tiny_reference.graphed(first.state)
    gone = weakref.ref(first.state)
    gc.disable()
    try:
        cache.put(first)
        del first
        cache.put(Retained(tiny_reference.new_state(256)))  # evicts the first
        assert len(cache) == 1 and gone() is None
        kept = next(iter(cache._entries.values()))[0].state
        tiny_reference.graphed(kept)
        gone = weakref.ref(kept)
        del kept
        cache.clear()
        assert gone() is None
    finally:
        gc.enable()
    dropped = []
    real = State.drop_graphs
    monkeypatch.setattr(State, "drop_graphs", lambda st: (dropped.append(st.graphs is not None),
                                                          real(st)))
    eng = Engine(tiny_reference, 64, graphs=True).start()
    try:
        done, events = threading.Event(), []
        vocab = tiny_reference.cfg.vocab_size
        eng.submit(GenRequest([5, 6, vocab + 3], 4),  # a token id past the vocabulary
                   lambda ev: (events.append(ev), isinstance(ev, (Finished, Failed)) and done.set()))
        assert done.wait(30)
        assert isinstance(events[-1], Failed) and dropped == [True]
    finally:
        eng.stop()


def test_engine_worker_survives_a_failing_job(tiny_reference):
    eng = Engine(tiny_reference, 64).start()
    try:
        done, events = threading.Event(), []
        eng.submit(GenRequest(list(range(3, 100)), 4),  # longer than the capacity
                   lambda ev: (events.append(ev), isinstance(ev, (Finished, Failed)) and done.set()))
        assert done.wait(30)
        assert isinstance(events[-1], Failed) and "capacity" in events[-1].message
        out, _ = _run(eng, _prompt(9, 20))
        assert out == _cold(tiny_reference, _prompt(9, 20))
    finally:
        eng.stop()


def test_dspark_engine_equals_plain_with_reuse_and_reports_acceptance(tiny_reference, tiny_dir):
    """With --speculative the engine decodes with DSpark: same tokens as plain decoding, cold
    or continuing a retained state, and the drafted/accepted counts reach /metrics."""
    from strata.runtime.speculative import SpecConfig
    greedy = SamplingParams()
    with LiveServer(tiny_reference, tiny_dir, capacity=1024,
                    speculative=SpecConfig(length=3, low_windows=10 ** 6)) as srv:
        eng = srv.engine
        base = _prompt(1, 150)
        out, _ = _run(eng, base, 12, greedy)
        assert out == _cold(tiny_reference, base, 12, greedy)
        p2 = base + out + _prompt(2, 20)
        out2, cached = _run(eng, p2, 12, greedy)
        assert cached > len(base) and out2 == _cold(tiny_reference, p2, 12, greedy)
        r = srv.post("/v1/completions", {"model": M, "prompt": base, "max_tokens": 12,
                                         "temperature": 0}).json()
        assert r["usage"]["completion_tokens"] == 12
        values = {line.split(" ")[0]: float(line.split(" ")[1])
                  for line in httpx.get(srv.url + "/metrics").text.splitlines()
                  if line and not line.startswith("#")}
    assert values["strata_speculative_drafted_tokens_total"] > 0
    assert 0 <= values["strata_speculative_accepted_tokens_total"] <= \
        values["strata_speculative_drafted_tokens_total"]
