"""Batch-invariant batched products: out[b, m, :] = x[b, m, :] · w[b]ᵀ, one row at a time.

cuBLAS picks its kernel (tiling, split-K) from the whole problem's shape, so the same row can
round differently in a decode step, a verify window and a prefill chunk. This kernel computes
every output row with the same fixed-order reduction over K (blocks of BLOCK_K, fp32
accumulation) whatever B, M or the grid, which makes forwards bit-identical across batch
shapes on the GPU. It is the exactness path, not the fast one (no tensor cores); the fast
quantized kernels (issue 5) must keep the same property.

`rowwise_bmm_reference` is the torch definition it is tested against (under TRITON_INTERPRET=1
on CPU).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path is used
    triton = None


def rowwise_bmm_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [B, M, K], w [B or 1, N, K] → [B, M, N] (in x's dtype)."""
    return torch.bmm(x, w.expand(x.shape[0], -1, -1).transpose(1, 2))


if triton is not None:
    @triton.jit
    def _rowwise_kernel(x_ptr, w_ptr, o_ptr, M, N, K,
                        sxb, sxm, sxk, swb, swn, swk, sob, som, son,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        row = tl.program_id(0)  # b·M + m
        b = row // M
        m = row % M
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + b * sxb + m * sxm + offs_k * sxk, mask=offs_k < K, other=0.0)
            wt = tl.load(w_ptr + b * swb + offs_n[:, None] * swn + offs_k[None, :] * swk,
                         mask=(offs_n[:, None] < N) & (offs_k[None, :] < K), other=0.0)
            acc += tl.sum(wt.to(tl.float32) * xk.to(tl.float32)[None, :], axis=1)
        tl.store(o_ptr + b * sob + m * som + offs_n * son, acc.to(o_ptr.dtype.element_ty),
                 mask=offs_n < N)


BLOCK_N = 32
BLOCK_K = 64


def rowwise_bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [B, M, K], w [B or 1, N, K] (any strides) → [B, M, N] in x's dtype, batch-invariant."""
    if triton is None:
        raise RuntimeError("rowwise_bmm needs triton")
    B, M, K = x.shape
    Bw, N, Kw = w.shape
    if Kw != K or Bw not in (1, B):
        raise ValueError(f"rowwise_bmm: x {list(x.shape)} and w {list(w.shape)} do not match")
    out = torch.empty((B, M, N), dtype=x.dtype, device=x.device)
    if B * M == 0 or N == 0:
        return out
    swb = 0 if Bw == 1 else w.stride(0)
    grid = (B * M, triton.cdiv(N, BLOCK_N))
    _rowwise_kernel[grid](x, w, out, M, N, K, x.stride(0), x.stride(1), x.stride(2),
                          swb, w.stride(1), w.stride(2), out.stride(0), out.stride(1),
                          out.stride(2), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out
