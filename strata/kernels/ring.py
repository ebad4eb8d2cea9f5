"""A position ring's write, and the undo of a journaled write, in one launch each on CUDA
(strata.runtime.state.PositionRing.write, undo_writes).

In torch a write is the slots (positions mod size), the rows' cast, and two indexed stores
(rows, tags): three or four launches, about 22 of them per layer-wise decode step. Here each
program stores one row's block of values at its slot, the first block also the slot's tag.
Values are cast as torch casts (round to nearest even; 16- and 32-bit floats), so the ring
holds the torch path's bits; the positions of one write are distinct modulo the size (the
caller keeps only the last `size` rows), so no two programs store to one slot.

An undo puts back the journaled rows and tags of the positions ≥ `to` (a DSpark window's
rejected rows): in torch a compare, two gathers, two selects and two indexed stores per
write, ~8 launches for each of a window's ~22 ring writes, run by the host while the GPU
waits for the next draft. Here one launch copies the old values back, bit for bit, for all
of a rollback's writes into distinct rings of one dtype (a table of their addresses; one
launch each cost the host ~45 µs, 0.9 ms a window on the H200: bench/results/performance.md,
session 18).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from strata.current_device import upload

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch code is used
    triton = None

BLOCK = 512
_CASTS = (torch.float32, torch.bfloat16, torch.float16)


def available(rows: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether a write of src into ring rows runs here (CUDA, float types _round_out casts,
    contiguous ring rows)."""
    return (triton is not None and rows.is_cuda and rows.dtype in _CASTS
            and src.dtype in _CASTS and rows.is_contiguous())


if triton is not None:
    from strata.kernels import pdl
    from strata.kernels.mhc import _round_out
    from strata.kernels.pdl import wait_then_release

    @triton.jit
    def _ring_write_kernel(src_ptr, pos_ptr, rows_ptr, tags_ptr, W, size, s_src, s_rows,
                           BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_then_release(PDL)
        i = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        pos = tl.load(pos_ptr + i)
        slot = pos % size  # (positions are ≥ 0: torch's remainder)
        live = cols < W
        v = tl.load(src_ptr + i * s_src + cols, mask=live, other=0.0).to(tl.float32)
        tl.store(rows_ptr + slot * s_rows + cols, _round_out(v, rows_ptr.dtype.element_ty),
                 mask=live)
        if tl.program_id(1) == 0:
            tl.store(tags_ptr + slot, pos)

    @triton.jit
    def _ring_restore_kernel(table_ptr, like_ptr, to, TABLE: tl.constexpr, BLOCK: tl.constexpr):
        """Row i = program_id(1) of write program_id(0), whose table entry holds the
        addresses of its old rows, old tags, slots, positions, ring rows and ring tags, then
        its row count and row width (`like_ptr`: a pointer of the rows' type)."""
        e = table_ptr + tl.program_id(0) * TABLE
        i = tl.program_id(1).to(tl.int64)
        if i < tl.load(e + 6):
            W = tl.load(e + 7)
            old = tl.load(e + 0).to(like_ptr.dtype)
            rows = tl.load(e + 4).to(like_ptr.dtype)
            i64 = tl.pointer_type(tl.int64)
            pos = tl.load(tl.load(e + 3).to(i64) + i)
            if pos >= to:
                slot = tl.load(tl.load(e + 2).to(i64) + i)
                for c in range(0, W, BLOCK):
                    cols = c + tl.arange(0, BLOCK)
                    live = cols < W
                    v = tl.load(old + i * W + cols, mask=live)
                    tl.store(rows + slot * W + cols, v, mask=live)
                tl.store(tl.load(e + 5).to(i64) + slot, tl.load(tl.load(e + 1).to(i64) + i))


def _flat(t: torch.Tensor) -> torch.Tensor:
    """[n, ...] as [n, W] with unit stride along W (a copy only where needed)."""
    t = t.reshape(t.shape[0], -1)
    return t if t.stride(1) == 1 else t.contiguous()


def ring_write(rows: torch.Tensor, tags: torch.Tensor, positions: torch.Tensor,
               src: torch.Tensor) -> None:
    """rows[positions % size] = src (cast to rows' dtype), tags[...] = positions; rows
    [size, ...] contiguous, tags [size] int64, positions [n] int64 distinct modulo size,
    src [n, ...] of rows' row shape."""
    n, size = src.shape[0], rows.shape[0]
    if src.shape[1:] != rows.shape[1:] or positions.shape != (n,) or n > size:
        raise ValueError(f"ring write: {n} rows of {list(src.shape[1:])} at "
                         f"{list(positions.shape)} positions into {list(rows.shape)}")
    if n == 0:
        return
    W = rows[0].numel()
    s2 = _flat(src)
    _ring_write_kernel[(n, triton.cdiv(W, BLOCK))](
        s2, positions.long().contiguous(), rows, tags, W, size, s2.stride(0), W, BLOCK=BLOCK,
        num_warps=4, **pdl.args(rows.device))


TABLE = 8  # int64 entries a write takes in the restore's table
# Restore tables by content (device, entries): a graph's journaled writes are the same tensors
# at every replay, so a window's rollback finds its table here instead of building and
# uploading it (the host's ~25 µs a write was on the critical path: the GPU waits for it).
TABLES_KEPT = 64
_TABLES: dict[tuple, torch.Tensor] = {}


@dataclass(frozen=True)
class RestoreEntry:
    """One journaled write's row of the restore's address table, checked once (a RingWrite
    keeps it, and a graph's replays share it): the addresses of its old rows, old tags,
    slots, positions, ring rows and ring tags, then its row count and row width."""
    values: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    tensors: tuple  # what the addresses point to (kept alive with the entry)


def restore_entry(rows: torch.Tensor, tags: torch.Tensor, slots: torch.Tensor,
                  positions: torch.Tensor, old_rows: torch.Tensor,
                  old_tags: torch.Tensor) -> RestoreEntry | None:
    """The table row of an undo of a journaled write (rows[slots] = old_rows, tags[slots] =
    old_tags where positions ≥ to): rows [size, ...] contiguous, old_rows [n, ...] of its
    dtype and row shape, slots / positions / old_tags [n], slots distinct. None for n = 0."""
    n = old_rows.shape[0]
    if (old_rows.shape[1:] != rows.shape[1:] or old_rows.dtype != rows.dtype
            or slots.shape != (n,) or positions.shape != (n,) or old_tags.shape != (n,)):
        raise ValueError(f"ring restore: {n} rows of {list(old_rows.shape[1:])} "
                         f"{old_rows.dtype} into {list(rows.shape)} {rows.dtype}")
    # (no copies: the entry is kept, and a graph's replays write new values into these very
    # tensors)
    parts = (old_rows, old_tags, slots, positions, rows, tags)
    if any(not t.is_contiguous() for t in parts) or any(
            t.dtype != torch.int64 for t in (old_tags, slots, positions, tags)):
        raise ValueError("ring restore: the ring's rows, the old rows and the int64 tags, "
                         "slots and positions must be contiguous")
    if n == 0:
        return None
    return RestoreEntry(tuple(t.data_ptr() for t in parts) + (n, rows[0].numel()),
                        rows.dtype, rows.device, parts)


def ring_restore(entries: Sequence[RestoreEntry | None], to: int) -> None:
    """Undo the entries' writes (restore_entry) for their positions ≥ to, in one launch: the
    entries' rings are distinct (their order is not kept) and of one dtype, on one device
    (None entries, empty writes, are skipped)."""
    entries = [e for e in entries if e is not None]
    if not entries:
        return
    first = entries[0]
    if any(e.dtype != first.dtype or e.device != first.device for e in entries):
        raise ValueError(f"ring restore: rings of several dtypes or devices ({first.dtype} on "
                         f"{first.device} among them) in one launch")
    if len({e.values[4] for e in entries}) < len(entries):
        raise ValueError("ring restore: two undos into one ring in one launch")
    key = (first.device, tuple(e.values for e in entries))
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) >= TABLES_KEPT:
            _TABLES.clear()
        table = _TABLES[key] = upload(torch.tensor([e.values for e in entries],
                                                   dtype=torch.int64), first.device)
    _ring_restore_kernel[(len(entries), max(e.values[6] for e in entries))](
        table, first.tensors[4], to, TABLE=TABLE, BLOCK=BLOCK, num_warps=4)
