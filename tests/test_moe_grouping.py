"""group_by_expert: every pair lands in exactly one tile of its own expert, in pair order."""
from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first launched (CPU runs)

from strata.kernels.moe_grouping import group_by_expert, max_tiles


@pytest.mark.parametrize("T,k,E,bm,seed", [(1, 6, 384, 16, 0), (5, 6, 16, 4, 1), (37, 2, 5, 8, 2),
                                           (64, 8, 3, 16, 3)])
def test_tiles_cover_each_pair_once(T, k, E, bm, seed):
    idx = torch.randint(0, E, (T, k), generator=torch.Generator().manual_seed(seed))
    g = group_by_expert(idx, E, bm)
    assert g.tile_rows.shape == (max_tiles(T * k, E, bm), bm)
    seen = []
    for j in range(g.tile_rows.shape[0]):
        rows = [int(r) for r in g.tile_rows[j] if r >= 0]
        if int(g.tile_expert[j]) < 0:
            assert rows == []
            continue
        assert rows, "a used tile holds at least one pair"
        assert all(int(idx.view(-1)[r]) == int(g.tile_expert[j]) for r in rows)
        assert rows == sorted(rows)  # stable: pair order within an expert
        seen += rows
    assert sorted(seen) == list(range(T * k))
    # Each expert's pairs fill its tiles densely: only its last tile may be partial.
    for e in idx.unique().tolist():
        tiles = (g.tile_expert == e).nonzero().view(-1).tolist()
        counts = [int((g.tile_rows[j] >= 0).sum()) for j in tiles]
        assert all(c == bm for c in counts[:-1]) and 0 < counts[-1] <= bm


@pytest.mark.parametrize("T,k,E,bm,seed", [(1, 6, 384, 64, 0), (6, 6, 384, 64, 1),
                                           (5, 6, 4, 4, 2), (8, 8, 3, 16, 3), (1, 1, 7, 16, 4),
                                           (3, 5, 2, 2, 5)])
def test_one_program_grouping_equals_the_general_path(T, k, E, bm, seed):
    """The fused kernel a CUDA decode step uses (under the Triton interpreter here) returns
    the general path's tensors exactly: order, tile experts, tile rows."""
    pytest.importorskip("triton")
    from strata.kernels.moe_grouping import group_in_one_program
    idx = torch.randint(0, E, (T, k), generator=torch.Generator().manual_seed(seed))
    want, got = group_by_expert(idx, E, bm), group_in_one_program(idx, E, bm)
    assert torch.equal(got.order, want.order)
    assert torch.equal(got.tile_expert, want.tile_expert)
    assert torch.equal(got.tile_rows, want.tile_rows)


def test_a_routing_groups_once_per_tile_size():
    """Routing: each tile size's grouping made on first use, kept (one step's launches, or a
    fixed routing across steps), equal to group_by_expert's."""
    from strata.kernels.moe_grouping import Routing
    idx = torch.tensor([[3, 1], [1, 0], [3, 2]])
    r = Routing(idx, 5)
    g8, g64 = r.groups(8), r.groups(64)
    assert r.groups(8) is g8 and r.groups(64) is g64 and g8 is not g64
    assert (g8.block_m, g64.block_m) == (8, 64)
    want = group_by_expert(idx, 5, 8)
    assert torch.equal(g8.tile_rows, want.tile_rows)
    assert torch.equal(g8.tile_expert, want.tile_expert)
