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


def max_tiles(pairs: int, n_experts: int, block_m: int) -> int:
    """Σ_e ceil(c_e / block_m) ≤ pairs / block_m + (number of experts present)."""
    return -(-pairs // block_m) + min(pairs, n_experts)


@dataclass
class ExpertGroups:
    order: torch.Tensor        # [P] pair ids sorted by expert (int64)
    tile_expert: torch.Tensor  # [n_tiles] expert of each tile, -1 when unused (int32)
    tile_rows: torch.Tensor    # [n_tiles, block_m] pair ids, -1 for padding (int32)
    block_m: int


def group_by_expert(idx: torch.Tensor, n_experts: int, block_m: int) -> ExpertGroups:
    """idx [T, k] expert ids → tiles of ≤ block_m pairs with one expert each."""
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
