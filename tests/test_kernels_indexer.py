"""The indexer's one-launch scores (strata.kernels.indexer) against the torch steps of
strata.model.indexer.Indexer.select, under TRITON_INTERPRET=1 on CPU
(tests/gpu/test_kernels_fused_ops_gpu.py runs it compiled)."""
from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is first launched

from strata.kernels.indexer import index_scores  # noqa: E402


def torch_steps(q, keys, w, visible):
    per_head = torch.relu(torch.bmm(q.float(), keys.float().T.expand(q.shape[0], -1, -1)))
    scores = torch.bmm(w.float().unsqueeze(1), per_head).squeeze(1)
    seen = torch.arange(keys.shape[0])[None] < visible[:, None]
    return torch.where(seen, scores, torch.full_like(scores, float("-inf")))


@pytest.mark.parametrize("H", [3, 40])  # fewer heads than a tile, and a second tile of heads
def test_matches_the_torch_steps_and_scores_stand_alone(H):
    g = torch.Generator().manual_seed(H)
    T, n, D = 4, 150, 72  # entries past one block, a head dimension past one k slice
    q = torch.randn(T, H, D, generator=g)
    keys = torch.randn(n, D, generator=g)
    w = torch.randn(T, H, generator=g)
    visible = torch.tensor([0, 40, 149, 150])  # none, some, all but one, all
    got = index_scores(q, keys, w, visible)
    torch.testing.assert_close(got, torch_steps(q, keys, w, visible), rtol=1e-5, atol=1e-4)
    assert torch.isinf(got[0]).all() and torch.isfinite(got[3]).all()
    # a query alone (in another row of its program's tile than in the batch), an odd count,
    # and fewer entries (the bucketed count grows with the context): the same bits
    assert torch.equal(index_scores(q[3:4], keys, w[3:4], visible[3:4]), got[3:4])
    assert torch.equal(index_scores(q[:3], keys, w[:3], visible[:3]), got[:3])
    assert torch.equal(index_scores(q, keys[:70], w, visible), got[:, :70])
    # the weights' scale applied inside (Indexer.select's 1/√(head_dim·heads)): w·s's bits
    s = 128 ** -0.5 * 32 ** -0.5
    assert torch.equal(index_scores(q, keys, w, visible, s), index_scores(q, keys, w * s, visible))
    # bf16 operands (vendor numerics: fp4 values) accumulate their exact products in fp32
    qb, kb = q.to(torch.bfloat16), keys.to(torch.bfloat16)
    torch.testing.assert_close(index_scores(qb, kb, w, visible), torch_steps(qb, kb, w, visible),
                               rtol=1e-5, atol=1e-4)


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="do not match"):
        index_scores(torch.zeros(2, 3, 8), torch.zeros(5, 9), torch.zeros(2, 3),
                     torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="do not match"):
        index_scores(torch.zeros(2, 3, 8), torch.zeros(5, 8), torch.zeros(2, 3),
                     torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="entries"):
        index_scores(torch.zeros(2, 3, 8), torch.zeros(5, 8), torch.zeros(2, 3),
                     torch.zeros(2, dtype=torch.long), entries=torch.zeros(3, 4, dtype=torch.long))


@pytest.mark.parametrize("H", [3, 40])
def test_a_querys_own_entries_have_their_bits_among_all(H):
    """`entries` (a reindex layer's candidates: each query's own ids, ascending, −1 none):
    each score has the bits it has among all the entries; −1, unseen and past-the-keys ids
    give −inf; more ids than a tile, and a query alone."""
    g = torch.Generator().manual_seed(10 + H)
    T, n, D = 3, 300, 72
    q = torch.randn(T, H, D, generator=g)
    keys = torch.randn(n, D, generator=g)
    w = torch.randn(T, H, generator=g)
    visible = torch.tensor([300, 120, 0])
    full = index_scores(q, keys, w, visible)
    ids = torch.stack([torch.randperm(n, generator=g)[:200].sort().values for _ in range(T)])
    ids[0, 190:] = -1
    ids[1, 0] = n + 5  # (no such key row)
    got = index_scores(q, keys, w, visible, entries=ids)
    assert got.shape == (T, 200)
    want = torch.where(ids >= 0, full.gather(1, ids.clamp(0, n - 1)), float("-inf"))
    want[1, 0] = float("-inf")
    assert torch.equal(got, want)
    assert torch.isinf(got[0, 190:]).all() and torch.isinf(got[2]).all()
    assert torch.isfinite(got[1][(ids[1] < 120) & (ids[1] >= 0)]).all()
    assert torch.equal(index_scores(q[1:2], keys, w[1:2], visible[1:2], entries=ids[1:2]),
                       got[1:2])


def test_a_reindex_layers_picks_from_its_candidates_alone(tiny_reference, monkeypatch):
    """Indexer.select's CUDA path for a reindex layer — its candidate entries alone scored
    (`entries`), their top-k mapped back to entry ids — run here under the interpreter by
    reporting the kernels available on CPU: the picks the torch path makes from all the
    entries masked to the candidates, in a 200-token forward whose candidate source keeps 3
    of 25 blocks a query."""
    from strata.kernels import indexer as kernels
    from strata.kernels import ranking
    from strata.model import indexer
    from util import random_tokens
    model, cfg = tiny_reference, tiny_reference.cfg
    layer = next(l for l in cfg.index_source_layer_ids if cfg.is_reindex(l))
    select, calls = indexer.Indexer.select, []

    def spy(self, *args, **kwargs):
        picks = select(self, *args, **kwargs)
        if self.layer == layer:
            calls.append((self, args, kwargs, picks))
        return picks

    monkeypatch.setattr(indexer.Indexer, "select", spy)
    model.forward(random_tokens(200, seed=9, vocab=cfg.vocab_size), model.new_state(256),
                  logits="none")
    (idx, args, kwargs, want), = calls
    ctx = args[2]
    assert ctx.candidates.shape == (200, cfg.candidate_topk_blocks)
    assert (want >= 0).sum(1).max() == cfg.index_topk  # (the candidates bind: 24 of ~200)
    scored = []
    score = kernels.index_scores
    monkeypatch.setattr(kernels, "index_scores",
                        lambda *a, **k: scored.append(k.get("entries")) or score(*a, **k))
    monkeypatch.setattr(kernels, "available", lambda t: True)
    monkeypatch.setattr(ranking, "available", lambda t: True)
    got = select(idx, *args, **kwargs)
    assert len(scored) == 1 and scored[0].shape == (200, 8 * cfg.candidate_topk_blocks)
    assert torch.equal(got, want)
