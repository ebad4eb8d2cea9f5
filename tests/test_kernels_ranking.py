"""ranked_topk's one-launch keys (strata.kernels.ranking) against the torch definition in
strata.model.numerics.ranked_topk, under TRITON_INTERPRET=1 on CPU
(tests/gpu/test_kernels_fused_ops_gpu.py runs it compiled)."""
from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is first launched

from strata.kernels.ranking import rank_keys  # noqa: E402


def torch_keys(scores):
    n = scores.shape[-1]
    bits = (scores.float() + 0.0).view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return ordered * (1 << 32) + ((n - 1) - torch.arange(n))


def test_keys_are_the_definitions_bits_and_rank_like_a_stable_sort():
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(5, 1100, generator=g)  # a row past one block
    scores[0, :6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-45, -1e-45])
    scores[1, 100:200] = 0.25  # ties: the lower index first
    keys = rank_keys(scores)
    assert keys.dtype == torch.int64 and torch.equal(keys, torch_keys(scores))
    top = torch.topk(keys, 50, dim=-1).indices
    stable = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :50]
    assert torch.equal(top, stable)
    wide = torch.randn(5, 1200, generator=g)
    assert torch.equal(rank_keys(wide[:, :1100]), torch_keys(wide[:, :1100]))  # strided rows
    assert torch.equal(rank_keys(scores[None]), torch_keys(scores)[None])  # leading dims


def test_no_entries_or_no_rows_give_empty_keys():
    """A selection before the first compressed entry exists scores [T, 0] (the model's first
    chunk); and a call may have no rows."""
    for shape in [(3, 0), (0, 7), (2, 0, 5)]:
        keys = rank_keys(torch.zeros(shape))
        assert keys.shape == shape and keys.dtype == torch.int64


@pytest.mark.parametrize("split", [False, True])
def test_top_picks_are_the_indexers_torch_ops(monkeypatch, split):
    """The indexer's selection (strata.kernels.ranking.top_picks) against topk_lowest_index's
    torch ops (the CPU path): finite picks ascending, then −1 — with fewer finite scores than
    picks, ties across blocks and parts (the lowest indices), rounded rows, −0 against +0
    (equal), +inf, a selection wider than the entries and non-power-of-2 widths, the picks
    given as ids; no rows and no entries. Blocks of 64 here so a pass spans several; each row in one program, or
    (`split`) in parts of ≥ 128 entries, a program each, their counts added per pass, a part's
    picks placed after the earlier parts' counts read 4 at a time; rows
    shorter than a block read by a block of their own width."""
    from strata.kernels import ranking
    from strata.model.indexer import topk_lowest_index
    monkeypatch.setattr(ranking, "PICKS_BLOCK", 64)
    monkeypatch.setattr(ranking, "PICKS_PART", 128)
    monkeypatch.setattr(ranking, "PICKS_PROGRAMS", 48 if split else 1)
    monkeypatch.setattr(ranking, "PICKS_COUNTS", 4)  # (8 parts: the earlier counts in rounds)
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(6, 1000, generator=g)
    scores[0, 40:] = float("-inf")  # 40 finite entries
    scores[1, 100:700] = 0.5        # ties
    scores[2, ::3] = float("-inf")
    scores[3] = scores[3].round()
    scores[4, :500] = -0.0
    scores[4, 500:] = 0.0
    scores[5, 7] = float("inf")
    for k in (1, 300, 999, 1500):
        got = ranking.top_picks(scores, k)
        want = topk_lowest_index(scores, k)
        assert got.dtype == torch.int64 and got.shape == (6, k) and torch.equal(got, want), k
    strided = scores[:, ::2]
    assert torch.equal(ranking.top_picks(strided, 64), topk_lowest_index(strided, 64))
    # the picks as ids (a reindex layer's candidates: entry ids, −1 none)
    ids = torch.randint(0, 1 << 40, (6, 1000), generator=g)
    for k in (100, 999):
        want = topk_lowest_index(scores, k)
        want = torch.where(want >= 0, ids.gather(1, want.clamp(min=0)), want)
        assert torch.equal(ranking.top_picks(scores, k, ids), want)
        assert torch.equal(topk_lowest_index(scores, k, ids), want)  # (the torch path's)
    assert ranking.top_picks(torch.zeros(0, 9), 4).shape == (0, 4)
    assert torch.equal(ranking.top_picks(torch.zeros(3, 0), 4), torch.full((3, 4), -1))
    # short rows, read by a block of their own width (16, 32, 64 here)
    monkeypatch.setattr(ranking, "PICKS_MIN_BLOCK", 16)
    for n in (5, 17, 40):
        rows = scores[:, :n]
        for k in (1, 4, n):
            assert torch.equal(ranking.top_picks(rows, k), topk_lowest_index(rows, k)), (n, k)


@pytest.mark.parametrize("n", [1, 5, 64, 65, 300])
def test_argmax_rows_gives_torchs_ids(monkeypatch, n):
    """Greedy sampling's argmax (strata.kernels.ranking.argmax_rows, blocks of 64 here so
    rows span several): torch.argmax's ids on random rows, a row of values below −1e30, a
    row of −inf, rounded rows full of ties (the lowest index), −0 and +0 (equal), NaNs (the
    first NaN, as torch), and each row alone as in the batch."""
    from strata.kernels import ranking
    monkeypatch.setattr(ranking, "ARGMAX_BLOCK", 64)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(7, n, generator=g)
    x[1] = -1e30 - torch.rand(n, generator=g) * 1e30
    x[2] = float("-inf")
    x[3] = x[3].round()
    x[4, : n // 2] = -0.0
    x[4, n // 2:] = 0.0
    if n > 3:
        x[5, 3] = x[5, 1] = float("nan")
    x[6] = -x[6].abs().round()
    got = ranking.argmax_rows(x)
    assert torch.equal(got, x.argmax(-1))
    assert all(torch.equal(ranking.argmax_rows(x[i:i + 1])[0], got[i]) for i in range(7))
