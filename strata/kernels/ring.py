"""A position ring's write, and the undo of a journaled write, in one launch each on CUDA
(strata.runtime.state.PositionRing.write, RingWrite.undo_from).

In torch a write is the slots (positions mod size), the rows' cast, and two indexed stores
(rows, tags): three or four launches, about 22 of them per layer-wise decode step. Here each
program stores one row's block of values at its slot, the first block also the slot's tag.
Values are cast as torch casts (round to nearest even; 16- and 32-bit floats), so the ring
holds the torch path's bits; the positions of one write are distinct modulo the size (the
caller keeps only the last `size` rows), so no two programs store to one slot.

An undo puts back the journaled rows and tags of the positions ≥ `to` (a DSpark window's
rejected rows): in torch a compare, two gathers, two selects and two indexed stores per
write, ~8 launches for each of a window's ~22 ring writes, run by the host while the GPU
waits for the next draft. Here one launch copies the old values back, bit for bit.
"""
from __future__ import annotations

import torch

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
    def _ring_restore_kernel(old_ptr, old_tags_ptr, slots_ptr, pos_ptr, rows_ptr, tags_ptr,
                             to, W, s_old, s_rows, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        pos = tl.load(pos_ptr + i)
        undo = pos >= to
        slot = tl.load(slots_ptr + i)
        live = (cols < W) & (cols * 0 + pos >= to)  # (the row's test, as a block mask)
        v = tl.load(old_ptr + i * s_old + cols, mask=live)
        tl.store(rows_ptr + slot * s_rows + cols, v, mask=live)
        if tl.program_id(1) == 0:
            if undo:
                tl.store(tags_ptr + slot, tl.load(old_tags_ptr + i))


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


def ring_restore(rows: torch.Tensor, tags: torch.Tensor, slots: torch.Tensor,
                 positions: torch.Tensor, old_rows: torch.Tensor, old_tags: torch.Tensor,
                 to: int) -> None:
    """Where positions ≥ to: rows[slots] = old_rows, tags[slots] = old_tags (a journaled
    write's undo); rows [size, ...] contiguous, old_rows [n, ...] of its dtype and row shape,
    slots / positions / old_tags [n] int64, slots distinct."""
    n = old_rows.shape[0]
    if (old_rows.shape[1:] != rows.shape[1:] or old_rows.dtype != rows.dtype
            or slots.shape != (n,) or positions.shape != (n,) or old_tags.shape != (n,)):
        raise ValueError(f"ring restore: {n} rows of {list(old_rows.shape[1:])} "
                         f"{old_rows.dtype} into {list(rows.shape)} {rows.dtype}")
    if n == 0:
        return
    W = rows[0].numel()
    old = _flat(old_rows)
    _ring_restore_kernel[(n, triton.cdiv(W, BLOCK))](
        old, old_tags.long().contiguous(), slots.long().contiguous(),
        positions.long().contiguous(), rows, tags, to, W, old.stride(0), W, BLOCK=BLOCK,
        num_warps=4)
