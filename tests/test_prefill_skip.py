"""The exact prefill that skips the decoder layers for rows far from the prompt's end
(Model.forward(decoder=False), Session(decoder_skip=True)): same logits, same continuation."""
from __future__ import annotations

import pytest
import torch

from strata.runtime.session import Session
from strata.runtime.speculative import SpecConfig
from tests.util import random_tokens


def test_reach_of_the_fixture(tiny_reference):
    m = tiny_reference
    assert m.decoder_start == m.cfg.candidate_source_layer_id == 3
    ring = m.new_state(8).ring_size
    assert m.prefill_reach == (m.cfg.n_layers - 3) * m.cfg.sliding_window + ring


def test_truncating_after_a_skipping_prefill_continues_exactly(tiny_reference):
    """Every position the rings allow truncating to (State.can_truncate) continues exactly as
    after a full prefill: the reach covers every row a ring can still hold."""
    model = tiny_reference
    n = model.prefill_reach + 400
    prompt = random_tokens(n, seed=11)
    full, fast = model.new_state(n + 8), model.new_state(n + 8)
    Session(model, 0, prefill_chunk=256, state=full).prefill(prompt)
    Session(model, 0, prefill_chunk=256, state=fast, decoder_skip=True).prefill(prompt)
    allowed = [c for c in range(n - 300, n + 1, 7) if fast.can_truncate(c)]
    assert allowed and min(allowed) < n - 100  # the rings reach back past one window
    assert not fast.can_truncate(n - model.prefill_reach)  # inside the skipped rows: refused
    probe = random_tokens(5, seed=12)
    for c in allowed:
        a, b = full.clone(), fast.clone()
        a.truncate(c)
        b.truncate(c)
        la, _ = model.forward(probe, a)
        lb, _ = model.forward(probe, b)
        assert torch.equal(la, lb), c


def test_engine_reuse_over_a_skipped_prefill_equals_cold(tiny_reference):
    """The engine prefills long prompts with the skip; a follow-up turn that extends the
    conversation, and one that diverges inside the first prompt, equal cold runs."""
    from strata.runtime.engine import Engine, Finished, GenRequest, Started, Token
    from strata.runtime.sampling import SamplingParams
    import threading

    def run(eng, prompt):
        done, events = threading.Event(), []

        def on_event(ev):
            events.append(ev)
            if isinstance(ev, Finished):
                done.set()
        eng.submit(GenRequest(list(prompt), 6, SamplingParams(1.0, 0.9, 3),
                              stop_ids=frozenset()), on_event)
        assert done.wait(120), events
        cached = next(e for e in events if isinstance(e, Started)).cached_tokens
        return [e.id for e in events if isinstance(e, Token)], cached

    def cold(prompt):
        return Session(tiny_reference, 4096).run(list(prompt), 6, SamplingParams(1.0, 0.9, 3),
                                                 stop_ids=frozenset()).tokens

    eng = Engine(tiny_reference, 4096, prefill_chunk=256).start()
    try:
        p1 = random_tokens(tiny_reference.prefill_reach + 500, seed=13).tolist()
        out1, cached = run(eng, p1)
        assert cached == 0 and out1 == cold(p1)
        p2 = p1 + out1 + random_tokens(30, seed=14).tolist()
        out2, cached = run(eng, p2)
        assert cached > len(p1) and out2 == cold(p2)
        p3 = p1[:300] + random_tokens(40, seed=15).tolist()  # diverges in the skipped rows
        out3, _ = run(eng, p3)
        assert out3 == cold(p3)
    finally:
        eng.stop()


def test_decoder_false_needs_no_logits(tiny_reference):
    s = tiny_reference.new_state(16)
    with pytest.raises(ValueError, match="decoder=False"):
        tiny_reference.forward(torch.arange(3, 7), s, logits="last", decoder=False)


@pytest.mark.parametrize("mode", ["plain", "dspark"])
def test_skipping_prefill_is_exact(tiny_model, mode):
    """A prompt of 2.3 reaches: the skipped prefill gives bit-identical last logits, then the
    same tokens and the same logits at every later step (plain and DSpark decoding)."""
    model = tiny_model
    n = model.prefill_reach * 2 + 300
    prompt = random_tokens(n, seed=7)
    spec = SpecConfig(length=3) if mode == "dspark" else None
    full = Session(model, n + 16, prefill_chunk=256, speculative=spec)
    fast = Session(model, n + 16, prefill_chunk=256, speculative=spec, decoder_skip=True)

    last = model.layers[-1]
    rows = []
    orig = type(last).forward
    last.forward = lambda h, *a, **k: (rows.append(h.shape[0]), orig(last, h, *a, **k))[1]
    try:
        want = full.prefill(prompt)
        rows_full = sum(rows)
        rows.clear()
        got = fast.prefill(prompt)
        rows_fast = sum(rows)
    finally:
        del last.forward
    assert torch.equal(got, want)
    assert rows_full == n and rows_fast == model.prefill_reach  # the decoder really skipped

    # The continuation: same picks and logits, forward by forward.
    run = dict(max_tokens=10, stop_ids=frozenset(), mode=mode)
    a = Session(model, n + 16, prefill_chunk=256, speculative=spec)
    b = Session(model, n + 16, prefill_chunk=256, speculative=spec, decoder_skip=True)
    assert b.run(prompt, **run).tokens == a.run(prompt, **run).tokens
    probe = random_tokens(4, seed=8)
    la, _ = model.forward(probe, a.state)
    lb, _ = model.forward(probe, b.state)
    assert torch.equal(la, lb)
