"""The parity ladder (DESIGN.md): one prefill == token-by-token decode == chunked prefill ==
k-token forwards at any start position, in both numerics modes.

Tolerance: exact (bit-identical logits). The CPU path is batch-invariant by construction
(per-row products, fixed-length key sets per query, fixed summation orders, and the portable
ATEN_CPU_CAPABILITY kernels), so any difference is a bug, not rounding. 300 tokens cross the
128-slot window, the 256-slot ring wrap, ratio-2 pair boundaries, 8-entry candidate blocks and
the index top-k (16) saturation.
"""
from __future__ import annotations

import pytest
import torch

from util import random_tokens

N = 300


@pytest.fixture(scope="module")
def run(tiny_model):
    tokens = random_tokens(N, seed=1)
    state = tiny_model.new_state(1024)
    full, _ = tiny_model.forward(tokens, state)
    return tiny_model, tokens, full


def forward_in_chunks(model, tokens, sizes):
    """Logits of consecutive forwards of the given sizes (cycled) over all tokens."""
    state = model.new_state(1024)
    out, i, k = [], 0, 0
    while i < tokens.numel():
        n = sizes[k % len(sizes)]
        out.append(model.forward(tokens[i:i + n], state)[0])
        i, k = i + n, k + 1
    return torch.cat(out), state


def test_decode_equals_prefill(run):
    model, tokens, full = run
    dec, _ = forward_in_chunks(model, tokens, [1])
    assert torch.equal(dec, full)


@pytest.mark.parametrize("sizes", [[7], [64], [129], [2, 3, 5, 1, 6], [128, 1, 1, 127]])
def test_chunked_prefill_equals_prefill(run, sizes):
    model, tokens, full = run
    got, _ = forward_in_chunks(model, tokens, sizes)
    assert torch.equal(got, full)


# Start positions at the state's boundaries: Engram history (0-3), ratio-2 pairs (odd/even),
# candidate blocks of 8 entries (ratio 1: 15/16/17), the window (125, 127-129), the ring
# wrap (255/256) and index top-k saturation (ratio 2 reaches 16 entries at 32).
STARTS = [0, 1, 2, 3, 15, 16, 17, 31, 32, 33, 125, 127, 128, 129, 254, 255, 256]


@pytest.mark.parametrize("k", [1, 2, 6])
def test_k_token_forward_at_any_start(run, k):
    model, tokens, full = run
    for s in STARTS:
        state = model.new_state(1024)
        if s:
            model.forward(tokens[:s], state, logits="none")
        got, _ = model.forward(tokens[s:s + k], state)
        assert torch.equal(got, full[s:s + k]), f"start {s}, k {k}"


def test_logits_last_row(run):
    model, tokens, full = run
    state = model.new_state(1024)
    last, _ = model.forward(tokens[:50], state, logits="last")
    assert torch.equal(last[0], full[49])


def test_chunked_caches_equal_decode_caches(run):
    """Not just the logits: every cache a later forward can read is identical."""
    model, tokens, _ = run
    _, a = forward_in_chunks(model, tokens[:200], [1])
    _, b = forward_in_chunks(model, tokens[:200], [200])
    ta, tb = a.live_tensors(), b.live_tensors()
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name


def test_vendor_stale_index_k_switch(tiny_dir):
    """The vendor quirk changes ratio-2 decode at even positions only: prefill is the same,
    token-by-token decode differs (which is why it is off by default)."""
    from strata.model.model import Model
    from strata.model.numerics import Numerics
    default = Model.load(tiny_dir, numerics=Numerics(mode="vendor"))
    quirk = Model.load(tiny_dir, numerics=Numerics(mode="vendor", vendor_stale_index_k=True))
    tokens = random_tokens(80, seed=2)
    full_d, _ = default.forward(tokens, default.new_state(128))
    full_q, _ = quirk.forward(tokens, quirk.new_state(128))
    assert torch.equal(full_d, full_q)
    dec_q, _ = forward_in_chunks(quirk, tokens, [1])
    assert not torch.equal(dec_q, full_q)
    # Odd-position forwards publish their own keys: the first position that can differ is
    # an even one with visible ratio-2 entries.
    diff = (dec_q != full_q).any(-1).nonzero().flatten()
    assert int(diff[0]) % 2 == 0
