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
