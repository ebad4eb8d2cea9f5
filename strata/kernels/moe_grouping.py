"""Group a step's (token, slot) pairs by expert, so each selected expert's weights are read
(and, for EXL3, decoded) once per step for all the rows routed to it.

Everything is computed on the device with static shapes (no host synchronisation, so a decode
step that uses it can be captured in a CUDA graph): the number of row tiles is bounded by
`max_tiles(pairs, n_experts, block_m)` and unused tiles are marked with expert -1.

Layout: pairs are the flattened idx [T, k] (pair p = t·k + slot). `order` lists the pairs
sorted by expert (stable, so ties keep pair order). Tile j covers `block_m` consecutive entries
of `order` that share one expert: rows `tile_rows[j]` (pair ids, -1 for padding) and expert
`tile_expert[j]`. A pair's result never depends on which other pairs share its tile when the
kernel reduces each row in a fixed order, which the kernels that consume this guarantee.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path is used
    triton = None

# Up to this many pairs (decode steps and verify windows) a CUDA call runs one fused kernel
# (group_in_one_program) instead of the ~20 small torch kernels of the general path.
FUSED_PAIRS = 64


def max_tiles(pairs: int, n_experts: int, block_m: int) -> int:
    """Σ_e ceil(c_e / block_m) ≤ pairs / block_m + (number of experts present)."""
    return -(-pairs // block_m) + min(pairs, n_experts)


@dataclass
class ExpertGroups:
    order: torch.Tensor        # [P] pair ids sorted by expert (int64)
    tile_expert: torch.Tensor  # [n_tiles] expert of each tile, -1 when unused (int32)
    tile_rows: torch.Tensor    # [n_tiles, block_m] pair ids, -1 for padding (int32)
    block_m: int


class Routing:
    """A step's expert ids [T, k] with their groupings, each made on first use for the tile
    size a kernel asks for (the EXL3 CUDA kernel's tiles are smaller than the Triton
    kernel's; exl3_moe_linear picks): several launches of one step share one object, so each
    grouping is computed once, and one kept across steps (fixed ids) keeps its groupings."""

    def __init__(self, idx: torch.Tensor, n_experts: int) -> None:
        self.idx, self.n_experts = idx, n_experts
        self._by_block: dict[int, ExpertGroups] = {}

    def groups(self, block_m: int) -> ExpertGroups:
        g = self._by_block.get(block_m)
        if g is None:
            g = self._by_block[block_m] = group_by_expert(self.idx, self.n_experts, block_m)
        return g


def group_by_expert(idx: torch.Tensor, n_experts: int, block_m: int) -> ExpertGroups:
    """idx [T, k] expert ids → tiles of ≤ block_m pairs with one expert each."""
    if idx.is_cuda and triton is not None and idx.numel() <= FUSED_PAIRS:
        return group_in_one_program(idx, n_experts, block_m)
    flat = idx.reshape(-1).long()
    P = flat.numel()
    dev = flat.device
    n_tiles = max_tiles(P, n_experts, block_m)
    order = torch.sort(flat, stable=True).indices
    # scatter_add, not bincount: bincount reads its size on the host, which would stop
    # a CUDA graph capture of the step.
    counts = torch.zeros(n_experts, dtype=torch.long, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))                               # [E]
    tiles_per = (counts + block_m - 1) // block_m                     # [E]
    tile_start = torch.cumsum(tiles_per, 0) - tiles_per               # first tile of expert e
    pair_start = torch.cumsum(counts, 0) - counts                     # first slot in `order`
    # Position of each sorted entry within its expert's run → (tile, lane).
    sorted_e = flat[order]
    rank = torch.arange(P, device=dev) - pair_start[sorted_e]
    tile = tile_start[sorted_e] + rank // block_m
    lane = rank % block_m
    tile_rows = torch.full((n_tiles, block_m), -1, dtype=torch.int32, device=dev)
    tile_rows[tile, lane] = order.to(torch.int32)
    tile_expert = torch.full((n_tiles,), -1, dtype=torch.int32, device=dev)
    tile_expert[tile] = sorted_e.to(torch.int32)
    return ExpertGroups(order, tile_expert, tile_rows, block_m)


if triton is not None:
    from strata.kernels import pdl
    from strata.kernels.pdl import wait_then_release

    @triton.jit
    def _group_kernel(ids_ptr, order_ptr, tile_expert_ptr, tile_rows_ptr, P, n_tiles,
                      BLOCK_M: tl.constexpr, PB: tl.constexpr, TB: tl.constexpr,
                      PDL: tl.constexpr):
        # One program over all P pairs: every quantity of the general path from pairwise
        # comparisons (P ≤ PB ≤ 64, so the [PB, PB] tables live in registers).
        wait_then_release(PDL)
        i = tl.arange(0, PB)
        live = i < P
        e = tl.load(ids_ptr + i, mask=live, other=0).to(tl.int64)
        ei, ej = e[:, None], e[None, :]
        pair = live[:, None] & live[None, :]
        before = i[None, :] < i[:, None]
        less = tl.sum((pair & (ej < ei)).to(tl.int32), axis=1)              # experts below
        same_before = tl.sum((pair & (ej == ei) & before).to(tl.int32), axis=1)
        count = tl.sum((pair & (ej == ei)).to(tl.int32), axis=1)
        tiles = (count + BLOCK_M - 1) // BLOCK_M
        first = same_before == 0
        # An expert's first tile: the tiles of every present expert below it.
        tile_start = tl.sum(tl.where(pair & (ej < ei) & first[None, :], tiles[None, :], 0),
                            axis=1)
        tile = tile_start + same_before // BLOCK_M
        lane = same_before % BLOCK_M
        # Unused tiles and lanes read -1; the barrier orders those stores before the pairs'.
        t = tl.arange(0, TB)
        lanes = tl.arange(0, BLOCK_M)
        tl.store(tile_expert_ptr + t, tl.full([TB], -1, tl.int32), mask=t < n_tiles)
        tl.store(tile_rows_ptr + t[:, None] * BLOCK_M + lanes[None, :],
                 tl.full([TB, BLOCK_M], -1, tl.int32), mask=(t < n_tiles)[:, None])
        tl.debug_barrier()
        tl.store(order_ptr + less + same_before, i.to(tl.int64), mask=live)
        tl.store(tile_rows_ptr + tile * BLOCK_M + lane, i.to(tl.int32), mask=live)
        tl.store(tile_expert_ptr + tile, e.to(tl.int32), mask=live)


def group_in_one_program(idx: torch.Tensor, n_experts: int, block_m: int) -> ExpertGroups:
    """group_by_expert's result from one kernel launch, for at most FUSED_PAIRS pairs (the
    same tensors exactly: tests/test_moe_grouping.py)."""
    if triton is None:
        raise RuntimeError("group_in_one_program needs triton")
    flat = idx.reshape(-1).contiguous()
    P = flat.numel()
    if P > FUSED_PAIRS:
        raise ValueError(f"group_in_one_program: {P} pairs, at most {FUSED_PAIRS}")
    n_tiles = max_tiles(P, n_experts, block_m)
    dev = flat.device
    order = torch.empty(P, dtype=torch.long, device=dev)
    tile_expert = torch.empty(n_tiles, dtype=torch.int32, device=dev)
    tile_rows = torch.empty((n_tiles, block_m), dtype=torch.int32, device=dev)
    if P:
        _group_kernel[(1,)](flat, order, tile_expert, tile_rows, P, n_tiles, BLOCK_M=block_m,
                            PB=max(16, triton.next_power_of_2(P)),
                            TB=max(16, triton.next_power_of_2(n_tiles)),
                            **pdl.args(dev))
    else:
        tile_expert.fill_(-1)
        tile_rows.fill_(-1)
    return ExpertGroups(order, tile_expert, tile_rows, block_m)
