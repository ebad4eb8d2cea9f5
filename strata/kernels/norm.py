"""RMSNorm in one launch on CUDA (the torch definition is strata.model.numerics.rms_norm, ~9
launches there). One program per row: Σx² accumulated over BLOCK-wide column chunks in
ascending order, one final tree sum, then y = (x·rsqrt(Σx²/K + eps))·w rounded once to the
input's dtype. Every row is computed alone (batch-invariant); the sum's order differs from the
torch path's, so results may differ from it in the last bits (tested under the interpreter
against the definition, and bit for bit row-alone vs batched)."""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch definition is used
    triton = None

BLOCK = 1024


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


if triton is not None:
    from strata.kernels.mhc import _round_out

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, K, sx_row, so_row, eps,
                         HAS_W: tl.constexpr, BK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        xrow = x_ptr + r * sx_row
        acc = tl.zeros([BK], dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            xv = tl.load(xrow + k, mask=k < K, other=0.0).to(tl.float32)
            acc = acc + xv * xv
        inv = tl.rsqrt(tl.sum(acc, axis=0) / K + eps)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            y = tl.load(xrow + k, mask=k < K, other=0.0).to(tl.float32) * inv
            if HAS_W:
                y = y * tl.load(w_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            tl.store(out_ptr + r * so_row + k, _round_out(y, out_ptr.dtype.element_ty),
                     mask=k < K)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """w ⊙ x·rsqrt(mean(x²)+eps) over the last dim, in x's dtype (any leading shape)."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        w = x2 if weight is None else weight.contiguous()
        _rms_norm_kernel[(x2.shape[0],)](x2, w, out, K, x2.stride(0), out.stride(0), float(eps),
                                         HAS_W=weight is not None,
                                         BK=min(BLOCK, triton.next_power_of_2(K)),
                                         num_warps=4, enable_fp_fusion=False)
    return out.view(x.shape)
