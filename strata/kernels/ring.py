"""A position ring's write in one launch on CUDA (strata.runtime.state.PositionRing.write).

In torch a write is the slots (positions mod size), the rows' cast, and two indexed stores
(rows, tags): three or four launches, about 22 of them per layer-wise decode step. Here each
program stores one row's block of values at its slot, the first block also the slot's tag.
Values are cast as torch casts (round to nearest even; 16- and 32-bit floats), so the ring
holds the torch path's bits; the positions of one write are distinct modulo the size (the
caller keeps only the last `size` rows), so no two programs store to one slot.
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
    from strata.kernels.mhc import _round_out

    @triton.jit
    def _ring_write_kernel(src_ptr, pos_ptr, rows_ptr, tags_ptr, W, size, s_src, s_rows,
                           BLOCK: tl.constexpr):
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
    s2 = src.reshape(n, W)
    if s2.stride(1) != 1:
        s2 = s2.contiguous()
    pos = positions if positions.dtype == torch.int64 else positions.long()
    _ring_write_kernel[(n, triton.cdiv(W, BLOCK))](
        s2, pos.contiguous(), rows, tags, W, size, s2.stride(0), W, BLOCK=BLOCK, num_warps=4)
