"""Snapshot → forward → commit / rollback (runtime/state.py)."""
from __future__ import annotations

import pytest
import torch

from util import random_tokens


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("prefix,k", [(0, 6), (5, 1), (126, 6), (127, 3), (250, 6), (255, 2)])
def test_full_rollback_is_bit_identical(tiny_model, prefix, k):
    tokens = random_tokens(prefix + k, seed=3)
    state = tiny_model.new_state(512)
    if prefix:
        tiny_model.forward(tokens[:prefix], state, logits="none")
    before = state.clone()
    state.begin()
    tiny_model.forward(tokens[prefix:], state)
    state.rollback()
    assert state.position == prefix
    assert_same(state.tensors(), before.tensors())
    assert state.stale_index_source == before.stale_index_source


@pytest.mark.parametrize("prefix", [40, 127, 200, 253])
@pytest.mark.parametrize("accept", [0, 1, 3, 5, 6])
def test_partial_rollback_equals_plain_decode(tiny_model, prefix, accept):
    """Verify-style: run 6 rows, keep `accept` of them; the state must equal decoding just
    those tokens, and the next forward must give the same logits."""
    tokens = random_tokens(prefix + 8, seed=4)
    plain = tiny_model.new_state(512)
    tiny_model.forward(tokens[:prefix + accept], plain, logits="none")

    state = tiny_model.new_state(512)
    tiny_model.forward(tokens[:prefix], state, logits="none")
    state.begin()
    wrong = tokens[prefix:prefix + 6].clone()
    wrong[accept:] = (wrong[accept:] + 7) % 300 + 3  # rows after `accept` are rejected drafts
    tiny_model.forward(wrong, state)
    state.rollback(to=prefix + accept)
    assert state.position == prefix + accept
    assert_same(state.live_tensors(), plain.live_tensors())

    nxt = tokens[prefix + accept:prefix + accept + 2]
    a, _ = tiny_model.forward(nxt, state)
    b, _ = tiny_model.forward(nxt, plain)
    assert torch.equal(a, b)


def test_commit_keeps_rows(tiny_reference):
    tokens = random_tokens(20, seed=5)
    a = tiny_reference.new_state(64)
    a.begin()
    tiny_reference.forward(tokens, a)
    a.commit()
    b = tiny_reference.new_state(64)
    tiny_reference.forward(tokens, b)
    assert_same(a.tensors(), b.tensors())


def test_rollback_of_a_chunk_longer_than_the_ring(tiny_reference):
    """A prefill chunk that wraps the ring can be undone whole; a partial rollback into
    the rows it could not keep is refused instead of leaving a silently wrong window."""
    tokens = random_tokens(400, seed=6)
    state = tiny_reference.new_state(512)
    tiny_reference.forward(tokens[:50], state, logits="none")
    before = state.clone()
    state.begin()
    tiny_reference.forward(tokens[50:], state, logits="none")
    state.rollback()
    assert_same(state.tensors(), before.tensors())

    state.begin()
    tiny_reference.forward(tokens[50:], state, logits="none")
    with pytest.raises(ValueError, match="cannot roll back"):
        state.rollback(to=100)


def test_rollback_rules(tiny_reference):
    state = tiny_reference.new_state(64)
    with pytest.raises(RuntimeError):
        state.rollback()
    state.begin()
    with pytest.raises(RuntimeError):
        state.begin()
    tiny_reference.forward(random_tokens(4, seed=7), state)
    with pytest.raises(ValueError):
        state.rollback(to=5)
    state.rollback(to=2)
    assert state.position == 2


def test_bookmark_restore_and_truncate(tiny_reference):
    """Prefix reuse: go back to a bookmark (or truncate while the rings still hold the rows)
    and continue with different tokens — same logits and state as a cold run."""
    m = tiny_reference
    a, b = random_tokens(300, seed=10), random_tokens(40, seed=11)
    state = m.new_state(512)
    m.forward(a[:100], state, logits="none")
    bm = state.bookmark()
    m.forward(a[100:], state, logits="none")      # 200 more: the rings have wrapped
    assert not state.can_truncate(100)
    with pytest.raises(ValueError, match="cannot truncate"):
        state.truncate(100)
    state.restore(bm)
    got, _ = m.forward(b, state)
    cold = m.new_state(512)
    m.forward(a[:100], cold, logits="none")
    want, _ = m.forward(b, cold)
    assert torch.equal(got, want)
    assert_same(state.live_tensors(), cold.live_tensors())

    assert state.can_truncate(state.position - 20)
    state.truncate(state.position - 20)
    cold2 = m.new_state(512)
    m.forward(torch.cat((a[:100], b[:20])), cold2, logits="none")
    x, _ = m.forward(b[25:30], state)
    y, _ = m.forward(b[25:30], cold2)
    assert torch.equal(x, y)
    with pytest.raises(ValueError, match="ahead"):
        state.restore(m.new_state(512).bookmark().__class__(10**6, bm.rings, None))
