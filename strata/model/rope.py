"""Interleaved RoPE on the last `rope_dim` channels, one table per layer type (spec §2.4).

Ratio-0 layers (and DSpark stages) use theta `rope_theta` without YaRN; ratio>0 layers use
`compress_rope_theta` with YaRN whenever original_max_position_embeddings > 0, independent of
the runtime context length (V4.1 vendor behaviour). Frequencies are computed for the exact
positions of a forward, so there is no table sized by a maximum length.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from strata.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, ratio: int,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """Per-pair angular frequencies f_k, k = 0..rope_dim/2-1 (fp64 for exact tables), on
    `device` — made once per table and device (an upload per forward would wait for the GPU
    stream)."""
    yarn = ratio > 0 and cfg.original_max_position_embeddings > 0
    theta = cfg.compress_rope_theta if ratio > 0 else cfg.rope_theta
    return _inv_freq(cfg.qk_rope_head_dim, theta, yarn, cfg.original_max_position_embeddings,
                     cfg.beta_fast, cfg.beta_slow, cfg.rope_factor, torch.device(device))


@lru_cache(maxsize=None)  # (never dropped: captured graphs read the tables; a few per model)
def _inv_freq(rd: int, theta: float, yarn: bool, orig: int, beta_fast: float,
              beta_slow: float, factor: float, device: torch.device) -> torch.Tensor:
    k = torch.arange(0, rd, 2, dtype=torch.float64)
    freqs = theta ** (-k / rd)
    if yarn:
        def corr(rot: float) -> float:
            return rd * math.log(orig / (2 * math.pi * rot)) / (2 * math.log(theta))
        lo = max(math.floor(corr(beta_fast)), 0)
        hi = min(math.ceil(corr(beta_slow)), rd - 1)
        ramp = ((torch.arange(rd // 2, dtype=torch.float64) - lo) / max(hi - lo, 1e-3)).clamp(0, 1)
        freqs = freqs / factor * ramp + freqs * (1 - ramp)
    return freqs.to(device)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, rope_dim/2] in fp32 for integer positions [T] (on CUDA one launch with the
    same operations, strata.kernels.rope.cos_sin)."""
    from strata.kernels import rope as kernels
    if kernels.available(positions):
        return kernels.cos_sin(inv_freq, positions)
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return torch.cos(ang).float(), torch.sin(ang).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               inverse: bool = False, out_dtype: torch.dtype | None = None,
               in_place: bool = False) -> torch.Tensor:
    """Rotate pairs (2k, 2k+1) of the last 2·cos.shape[-1] channels of x [T, ..., d].

    cos/sin are [T, rd/2] and broadcast over the middle dims. `inverse` applies the conjugate
    rotation (used on the attention output). Returns a new tensor of x's dtype, then cast to
    `out_dtype` if given (on CUDA one launch with the same bits, strata.kernels.rope) — or,
    `in_place`, x itself with its tail rotated (the same bits; only the tail is read and
    written: a prefill chunk's queries are 8× the bytes of their tails).
    """
    if in_place and out_dtype not in (None, x.dtype):
        raise ValueError(f"apply_rope: in place keeps x's dtype {x.dtype}, not {out_dtype}")
    from strata.kernels import rope as kernels
    if kernels.available(x):
        return kernels.apply_rope(x, cos, sin, inverse, out_dtype, in_place)
    rd = cos.shape[-1] * 2
    head, tail = x[..., :-rd], x[..., -rd:].float()
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rd // 2,)
    c, s = cos.view(shape), sin.view(shape)
    if inverse:
        s = -s
    a, b = tail[..., 0::2], tail[..., 1::2]
    rot = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    if in_place:
        x[..., -rd:] = rot.to(x.dtype)
        return x
    out = torch.cat((head, rot.to(x.dtype)), dim=-1)
    return out if out_dtype is None else out.to(out_dtype)


@dataclass(frozen=True)
class InverseRope:
    """Rows x [T, ..., heads·head_dim] still to be rotated back — attention's output, whose
    heads' last 2·cos.shape[-1] channels carry RoPE — as apply_rope(x, cos, sin,
    inverse=True, out_dtype=dtype) would: a consumer that reads x anyway does it in that
    read (wo_a's EXL3 rotation, strata.kernels.exl3), any other calls `apply` first."""
    cos: torch.Tensor
    sin: torch.Tensor
    head_dim: int
    dtype: torch.dtype

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        heads = x.reshape(x.shape[0], -1, self.head_dim)
        return apply_rope(heads, self.cos, self.sin, inverse=True,
                          out_dtype=self.dtype).reshape(x.shape)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """apply_rope(rms_norm(x, weight, eps), cos, sin) for rows x [T, K]: a window key or an
    index key from its projection. One launch on CUDA (strata.kernels.norm.rms_norm_rope, the
    two kernels' bits)."""
    from strata.kernels import norm as norm_kernels
    from strata.model.numerics import rms_norm
    if norm_kernels.available(x):
        return norm_kernels.rms_norm_rope(x, weight, eps, cos, sin)
    return apply_rope(rms_norm(x, weight, eps), cos, sin)
