"""Interleaved RoPE on the last `rope_dim` channels, one table per layer type (spec §2.4).

Ratio-0 layers (and DSpark stages) use theta `rope_theta` without YaRN; ratio>0 layers use
`compress_rope_theta` with YaRN whenever original_max_position_embeddings > 0, independent of
the runtime context length (V4.1 vendor behaviour). Frequencies are computed for the exact
positions of a forward, so there is no table sized by a maximum length.
"""
from __future__ import annotations

import math

import torch

from strata.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, ratio: int) -> torch.Tensor:
    """Per-pair angular frequencies f_k, k = 0..rope_dim/2-1 (fp64 for exact tables)."""
    rd = cfg.qk_rope_head_dim
    theta = cfg.compress_rope_theta if ratio > 0 else cfg.rope_theta
    k = torch.arange(0, rd, 2, dtype=torch.float64)
    freqs = theta ** (-k / rd)
    orig = cfg.original_max_position_embeddings
    if ratio > 0 and orig > 0:
        def corr(rot: float) -> float:
            return rd * math.log(orig / (2 * math.pi * rot)) / (2 * math.log(theta))
        lo = max(math.floor(corr(cfg.beta_fast)), 0)
        hi = min(math.ceil(corr(cfg.beta_slow)), rd - 1)
        ramp = ((torch.arange(rd // 2, dtype=torch.float64) - lo) / max(hi - lo, 1e-3)).clamp(0, 1)
        freqs = freqs / cfg.rope_factor * ramp + freqs * (1 - ramp)
    return freqs


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, rope_dim/2] in fp32 for integer positions [T]."""
    ang = positions.to(torch.float64)[:, None] * inv_freq.to(positions.device)[None, :]
    return torch.cos(ang).float(), torch.sin(ang).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               inverse: bool = False) -> torch.Tensor:
    """Rotate pairs (2k, 2k+1) of the last 2·cos.shape[-1] channels of x [T, ..., d].

    cos/sin are [T, rd/2] and broadcast over the middle dims. `inverse` applies the conjugate
    rotation (used on the attention output). Returns a new tensor of x's dtype (on CUDA one
    launch with the same bits, strata.kernels.rope).
    """
    from strata.kernels import rope as kernels
    if kernels.available(x):
        return kernels.apply_rope(x, cos, sin, inverse)
    rd = cos.shape[-1] * 2
    head, tail = x[..., :-rd], x[..., -rd:].float()
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rd // 2,)
    c, s = cos.view(shape), sin.view(shape)
    if inverse:
        s = -s
    a, b = tail[..., 0::2], tail[..., 1::2]
    rot = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    return torch.cat((head, rot.to(x.dtype)), dim=-1)
