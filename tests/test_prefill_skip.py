"""The exact prefill that runs the decoder layers only on the rows near the prompt's end
(Model.forward(decoder_from=…), Session(decoder_skip=True)): same logits, same continuation."""
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
    W = m.cfg.sliding_window
    assert m.prefill_reach == ring + (m.cfg.n_layers - 3 - 1) * (W - 1)
    # each decoder layer W − 1 rows later, the last one the ring's rows
    end, frm = 5000, 5000 - m.prefill_reach
    assert [m.rows_from(l, 4000, 1000, frm) for l in range(m.cfg.n_layers)] == \
        [0, 0, 0] + [max(0, frm + i * (W - 1) - 4000) for i in range(5)]
    assert m.rows_from(m.cfg.n_layers - 1, 0, end, frm) == end - ring
    assert m.rows_from(4, 0, 100, None) == 0


def test_a_context_of_some_rows(tiny_reference):
    """ForwardContext.rows: the rows' inputs and selections sliced, nested slices relative to
    the slice, what the forward publishes to its end shared with the whole, and what it
    derives made anew."""
    m = tiny_reference
    s = m.new_state(16)
    ctx = m.new_context(torch.arange(3, 11), s, m.numerics)
    ctx.decoder_from = 5
    ctx.sel[2] = torch.arange(16).view(8, 2)
    ctx.candidates = torch.arange(8).view(8, 1)
    ctx.rope(1)  # (derived: not carried into a slice)
    part = ctx.rows(3, 8)
    assert (part.start, part.T, part.offset, part.whole) == (3, 5, 3, ctx)
    assert part.positions.tolist() == [3, 4, 5, 6, 7]
    assert part.tokens.tolist() == part.device_tokens.tolist() == [6, 7, 8, 9, 10]
    for layer in m.cfg.engram_layer_ids:
        assert torch.equal(part.engram_ids_of(layer), ctx.engram_ids_of(layer)[3:])
    assert part.sel[2].tolist() == ctx.sel[2][3:].tolist()
    assert part.candidates.view(-1).tolist() == [3, 4, 5, 6, 7]
    assert part.decoder_from == 5 and not part._derived
    inner = part.rows(2, 5)
    assert (inner.start, inner.offset, inner.whole) == (5, 5, ctx)
    assert inner.positions.tolist() == [5, 6, 7] and inner.sel[2].tolist() == [[10, 11],
                                                                                 [12, 13],
                                                                                 [14, 15]]
    inner.main_hidden[7] = torch.zeros(3, 4)
    inner.published_keys.append(3)
    assert 7 in ctx.main_hidden and ctx.published_keys == [3]
    assert ctx.rows(0, 8) is ctx


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


def test_logits_of_rows_the_decoder_skips_are_refused(tiny_reference):
    """A forward asked for logits of rows its last layer does not run fails before it runs."""
    m = tiny_reference
    s = m.new_state(16)
    # decoder_from 0: the last layer's first row is far past these 4
    assert m.rows_from(m.cfg.n_layers - 1, 0, 4, 0) == 4
    for logits in ("last", "all"):
        with pytest.raises(ValueError, match="decoder_from=0 skips"):
            m.forward(torch.arange(3, 7), s, logits=logits, decoder_from=0)
    assert s.position == 0
    m.forward(torch.arange(3, 7), s, logits="none", decoder_from=0)
    assert s.position == 4


@pytest.mark.parametrize("mode", ["plain", "dspark"])
@pytest.mark.parametrize("reaches", [2.4, 0.5])
def test_skipping_prefill_is_exact(tiny_model, mode, reaches):
    """A prompt of 2.4 reaches (chunks of encoder rows only, then one of both kinds, then
    decoder rows) or of half a reach (its later decoder layers skip its first rows): the
    skipped prefill gives bit-identical last logits, then the same tokens and the same logits
    at every later step (plain and DSpark decoding)."""
    model = tiny_model
    n = int(model.prefill_reach * reaches)
    prompt = random_tokens(n, seed=7)
    spec = SpecConfig(length=3) if mode == "dspark" else None
    full = Session(model, n + 16, prefill_chunk=256, speculative=spec)
    fast = Session(model, n + 16, prefill_chunk=256, speculative=spec, decoder_skip=True)

    rows = {b.layer: [] for b in model.layers}  # rows each layer's forward ran
    for b in model.layers:
        b.forward = (lambda b, orig: lambda h, *a, **k: (
            rows[b.layer].append(h.shape[0]), orig(h, *a, **k))[1])(b, b.forward)
    try:
        want = full.prefill(prompt)
        rows_full = {l: sum(r) for l, r in rows.items()}
        for r in rows.values():
            r.clear()
        got = fast.prefill(prompt)
        rows_fast = {l: sum(r) for l, r in rows.items()}
    finally:
        for b in model.layers:
            del b.forward
    assert torch.equal(got, want)
    # The decoder really skipped: each decoder layer W − 1 rows fewer than the one before,
    # down to the ring's rows; the encoder ran every row.
    ds, W = model.decoder_start, model.cfg.sliding_window
    assert set(rows_full.values()) == {n}
    assert rows_fast == {l: n if l < ds else min(n, model.prefill_reach - (l - ds) * (W - 1))
                         for l in rows}
    assert rows_fast[model.cfg.n_layers - 1] == min(n, model.new_state(8).ring_size)
    assert sum(rows_fast.values()) < sum(rows_full.values())

    # The continuation: same picks and logits, forward by forward.
    run = dict(max_tokens=10, stop_ids=frozenset(), mode=mode)
    a = Session(model, n + 16, prefill_chunk=256, speculative=spec)
    b = Session(model, n + 16, prefill_chunk=256, speculative=spec, decoder_skip=True)
    assert b.run(prompt, **run).tokens == a.run(prompt, **run).tokens
    probe = random_tokens(4, seed=8)
    la, _ = model.forward(probe, a.state)
    lb, _ = model.forward(probe, b.state)
    assert torch.equal(la, lb)
