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
    assert m.prefill_reach == (m.cfg.n_layers - 3) * m.cfg.sliding_window + m.cfg.sliding_window


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
