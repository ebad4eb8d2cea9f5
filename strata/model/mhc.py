"""Manifold-constrained hyper-connections: mixing coefficients and the stream update (spec §2.3).

The residual is carried as `hc_mult` copies h [T, H, D]. Each sublayer computes
(pre, post, comb) from the whole stream; `pre` collapses the copies into the sublayer input
(lagged one sublayer in V4.1, see block.py), `post` spreads the output, and `comb` — made
doubly stochastic by Sinkhorn — mixes the residual copies:
h_new[j] = post[j]·y + Σ_i comb[i,j]·h[i].

These torch functions are the definitions (and the CPU path); on CUDA the same steps run as
three fused kernels (strata.kernels.mhc: one launch each instead of ~170 small ones per sublayer).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from strata.kernels import mhc as kernels
from strata.kernels import norm as norm_kernels
from strata.model.numerics import rms_norm, row_matmul, row_mean


@dataclass
class HcWeights:
    fn: torch.Tensor     # [(2+H)·H, H·D] fp32
    base: torch.Tensor   # [(2+H)·H] fp32
    scale: torch.Tensor  # [3] fp32


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax, then alternate column/row normalisation; logits [..., H, H] fp32."""
    c = torch.softmax(logits, dim=-1) + eps
    if c.device.type == "cpu" and not c.requires_grad:
        return torch.from_numpy(_normalise_numpy(c.numpy(), iters, eps))
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def _normalise_numpy(c: np.ndarray, iters: int, eps: float) -> np.ndarray:
    """The normalisation loop of `sinkhorn` in numpy, in place on a copy.

    The same fp32 operations in the same order; with V4.1's four copies the same bits as the
    torch loop (test_model_units checks), with more numpy may order a row sum differently.
    Why: these ~120 tiny ops per sublayer were a third of a CPU decode step's torch calls,
    and a numpy call costs a fraction of a torch one.
    """
    c = c.copy()
    eps32 = np.float32(eps)
    c /= c.sum(-2, keepdims=True) + eps32
    for _ in range(iters - 1):
        c /= c.sum(-1, keepdims=True) + eps32
        c /= c.sum(-2, keepdims=True) + eps32
    return c


def hc_mixes(h: torch.Tensor, w: HcWeights, norm_eps: float, hc_eps: float,
             iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [T,H], post [T,H], comb [T,H,H]) in fp32 for stream h [T, H, D]."""
    T, H, _ = h.shape
    if kernels.available(h):  # (the products and the sum of squares in one pass over h)
        return kernels.hc_mixed_coeffs(h, w.fn, w.scale, w.base, H, norm_eps, hc_eps, iters)
    x = h.float().flatten(1)
    m = row_matmul(x, w.fn) * torch.rsqrt(row_mean(x * x) + norm_eps)
    s, b = w.scale, w.base
    pre = torch.sigmoid(m[:, :H] * s[0] + b[:H]) + hc_eps
    post = 2 * torch.sigmoid(m[:, H:2 * H] * s[1] + b[H:2 * H])
    comb = sinkhorn((m[:, 2 * H:] * s[2] + b[2 * H:]).view(T, H, H), iters, hc_eps)
    return pre, post, comb


def collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Σ_i pre[i]·h[i] → [T, D] (fp32 math, h's dtype out).

    The sums over copies are written out in copy order (not einsum, which may fold the
    token dim into a GEMM) so every row is computed the same way whatever the batch.
    """
    if kernels.available(h):
        return kernels.collapse(h, pre)
    hf = h.float()
    out = pre[:, 0, None] * hf[:, 0]
    for i in range(1, h.shape[1]):
        out = out + pre[:, i, None] * hf[:, i]
    return out.to(h.dtype)


def collapse_norm(h: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """A sublayer's input: rms_norm(collapse(h, pre), weight, eps). On CUDA one launch with
    the bits of the two kernels (strata.kernels.norm.collapse_rms_norm)."""
    if kernels.available(h) and norm_kernels.available(h):
        return norm_kernels.collapse_rms_norm(h, pre, weight, eps)
    return rms_norm(collapse(h, pre), weight, eps)


def hc_update(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
              comb: torch.Tensor) -> torch.Tensor:
    """h_new[j] = post[j]·y + Σ_i comb[i,j]·residual[i]; y [T, D], residual [T, H, D]."""
    if kernels.available(residual):
        return kernels.hc_update(y, residual, post, comb)
    r = residual.float()
    mixed = comb[:, 0, :, None] * r[:, 0, None, :]
    for i in range(1, r.shape[1]):
        mixed = mixed + comb[:, i, :, None] * r[:, i, None, :]
    return (mixed + post[..., None] * y.float()[:, None, :]).to(residual.dtype)
