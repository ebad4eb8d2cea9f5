"""EXL3 (exllamav3) linears: exact trellis decoding and the rotated-activation forward
(spec exl3.md §1).

A linear is `trellis` (int16 [k_p/16, n_p/16, 16·K]) + `suh` (fp16 [k_p]) + `svh` (fp16 [n_p])
+ an optional codebook marker (`mcg` or `mul1`, int32 scalar; neither ⇒ 3INST). K, the bits per
weight, comes from the trellis shape (half-integer K has a last dim of 16·KA + 8, MUL1 only).
The stored weight, in (in, out) orientation, is W = diag(suh)·H·Ŵ·H·diag(svh) with H the
normalised 128-block Sylvester Hadamard on each side and Ŵ decoded tile by tile:
each 16×16 tile is a tail-biting ring of 256·K bits read MSB-first from little-endian u32
pairs of int16; weight p (in mma fragment "ring" order) is CB(16-bit window ending at bit E(p)).
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

from strata.errors import CheckpointError
from strata.model.numerics import Numerics, row_matmul
from strata.model.rope import InverseRope
from strata.quant.linear import Linear

MCG_MULT = 0xCBAC1FED
MUL1_MULT = 0x83DCD12D
CODEBOOKS = ("3inst", "mcg", "mul1")


def _as_int32(v: int) -> int:
    return v - (1 << 32) if v >= 1 << 31 else v


MARKERS = {"mcg": _as_int32(MCG_MULT), "mul1": _as_int32(MUL1_MULT)}

# Which forward Exl3Linear runs: "auto" = the Triton kernels (strata.kernels.exl3) when x is on
# CUDA, the torch reference below on CPU; "always" = the kernels everywhere (CPU tests under
# TRITON_INTERPRET=1); "never" = the reference everywhere.
KERNELS = "auto"


def _use_kernels(x: torch.Tensor) -> bool:
    if KERNELS not in ("auto", "always", "never"):
        raise ValueError(f"strata.quant.exl3.KERNELS = {KERNELS!r}: expected auto, always, never")
    return KERNELS == "always" or (KERNELS == "auto" and x.is_cuda)


def _f16_halves_sum(x: np.ndarray) -> np.ndarray:
    """fp16(low half) + fp16(high half), one fp16 rounding (the sum is exact in fp32)."""
    lo = (x & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32)
    hi = (x >> 16).astype(np.uint16).view(np.float16).astype(np.float32)
    return (lo + hi).astype(np.float16)


@lru_cache(maxsize=None)
def codebook_lut(codebook: str) -> torch.Tensor:
    """The 65,536 fp16 values CB(s) of a codebook, for every 16-bit state s (exl3.md §1.4)."""
    s = np.arange(1 << 16, dtype=np.uint64)
    m32 = np.uint64(0xFFFFFFFF)
    if codebook == "3inst":
        x = (s * np.uint64(89226354) + np.uint64(64248484)) & m32
    elif codebook in ("mcg", "mul1"):
        x = (s * np.uint64(MCG_MULT if codebook == "mcg" else MUL1_MULT)) & m32
    else:
        raise ValueError(f"unknown EXL3 codebook {codebook!r}; expected one of {CODEBOOKS}")
    if codebook == "mul1":
        b = sum(((x >> np.uint64(8 * i)) & np.uint64(0xFF)) for i in range(4)).astype(np.float32)
        k1 = np.array([0x1EEE], dtype=np.uint16).view(np.float16).astype(np.float32)[0]
        k0 = np.array([0xC931], dtype=np.uint16).view(np.float16).astype(np.float32)[0]
        vals = ((1024.0 + b) * k1 + k0).astype(np.float16)  # exact in fp32, one fp16 rounding
    else:
        x = (x & np.uint64(0x8FFF8FFF)) ^ np.uint64(0x3B603B60)
        vals = _f16_halves_sum(x)
    return torch.from_numpy(vals.copy())


@lru_cache(maxsize=None)
def ring_order() -> torch.Tensor:
    """perm[p] = r·16 + c: the tile element that ring position p decodes to (exl3.md §1.2)."""
    perm = torch.empty(256, dtype=torch.long)
    for r in range(16):
        for c in range(16):
            t = 4 * (c & 7) + ((r & 7) >> 1)
            j = (r & 1) | (((r >> 3) & 1) << 1) | ((c >> 3) << 2)
            perm[8 * t + j] = r * 16 + c
    return perm


def bits_per_weight(trellis_last_dim: int) -> float:
    if trellis_last_dim % 16 == 0 and 16 <= trellis_last_dim <= 128:
        return trellis_last_dim / 16
    if trellis_last_dim % 16 == 8 and 24 <= trellis_last_dim <= 120:
        return (trellis_last_dim - 8) / 16 + 0.5
    raise ValueError(f"trellis last dim {trellis_last_dim} is not 16·K (K = 1..8) or 16·K+8")


@lru_cache(maxsize=None)
def _window_index(K: float) -> torch.Tensor:
    """idx[p, b] = stream bit b (MSB first) of weight p's 16-bit state, [256, 16]."""
    R = int(256 * K)
    p = torch.arange(256)
    if K == int(K):
        end = (p + 1) * int(K)
    else:  # half-integer: position p takes KA + (p odd) bits
        KA = int(K - 0.5)
        m = p // 2
        end = torch.where(p % 2 == 0, m * (2 * KA + 1) + KA, (m + 1) * (2 * KA + 1))
    return (end[:, None] - 16 + torch.arange(16)[None, :]) % R


def decode_trellis(trellis: torch.Tensor, codebook: str) -> torch.Tensor:
    """Ŵ [16·kt, 16·nt] fp16 from a trellis [kt, nt, 16·K] int16, bit-exact."""
    kt, nt, L = trellis.shape
    K = bits_per_weight(L)
    if K != int(K) and codebook != "mul1":
        raise ValueError(f"half-integer K = {K} exists only with the mul1 codebook")
    words = trellis.to(torch.int32).reshape(kt * nt, L // 2, 2) & 0xFFFF
    u32 = words[..., 0] | (words[..., 1] << 16)                    # little-endian pairs
    shifts = torch.arange(31, -1, -1, dtype=torch.int32)
    bits = ((u32[..., None] >> shifts) & 1).reshape(kt * nt, -1)   # MSB-first stream [tiles, R]
    idx = _window_index(K)
    weights = (1 << torch.arange(15, -1, -1, dtype=torch.int32))
    states = (bits[:, idx] * weights).sum(-1).long()              # [tiles, 256]
    vals = codebook_lut(codebook)[states]
    tiles = torch.empty_like(vals)
    tiles[:, ring_order()] = vals
    return tiles.view(kt, nt, 16, 16).permute(0, 2, 1, 3).reshape(16 * kt, 16 * nt)


@lru_cache(maxsize=None)
def hadamard128() -> torch.Tensor:
    """Natural-order Sylvester Hadamard of size 128, normalised (symmetric, orthogonal)."""
    i = torch.arange(128)
    parity = torch.zeros(128, 128, dtype=torch.long)
    x = i[:, None] & i[None, :]
    while bool(x.any()):
        parity ^= x & 1
        x = x >> 1
    return (1 - 2 * parity).float() / math.sqrt(128)


@lru_cache(maxsize=None)
def _hadamard128_on(device: torch.device) -> torch.Tensor:
    """One copy per device (an upload per call would be a host copy inside every forward)."""
    return hadamard128().to(device)


def _rotate(x: torch.Tensor) -> torch.Tensor:
    """Apply H to each contiguous 128-block of the last dim (fp32)."""
    shape = x.shape
    xb = x.reshape(-1, 128).float()
    return row_matmul(xb, _hadamard128_on(x.device)).reshape(shape)  # H is symmetric


def codebook_from_marker(marker_name: str | None, value: int | None, where: str) -> str:
    if marker_name is None:
        return "3inst"
    if marker_name not in MARKERS:
        raise CheckpointError(f"{where}: unknown codebook marker .{marker_name}")
    if value != MARKERS[marker_name]:
        raise CheckpointError(f"{where}: .{marker_name} marker holds {value}, expected "
                              f"{MARKERS[marker_name]} (locked multiplier)")
    return marker_name


class Exl3Linear(Linear):
    """y = x·W with W = diag(suh)·H·Ŵ·H·diag(svh), run as rotations of the activation:
    x' = fp16(x·suh) → H per 128-block → y' = x'·Ŵ (fp32 accumulate) → H → ·svh (+ bias)."""

    def __init__(self, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                 codebook: str, out_features: int, in_features: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__(out_features, in_features)
        kt, nt, L = trellis.shape
        self.K = bits_per_weight(L)
        if suh.shape != (16 * kt,) or svh.shape != (16 * nt,):
            raise ValueError(f"suh {list(suh.shape)} / svh {list(svh.shape)} do not match a "
                             f"trellis of {16 * kt}×{16 * nt}")
        if (16 * kt) % 128 or (16 * nt) % 128 or in_features > 16 * kt or out_features > 16 * nt:
            raise ValueError(f"trellis {16 * kt}×{16 * nt} is not the 128-padded form of "
                             f"{in_features}×{out_features}")
        self.trellis, self.suh, self.svh, self.codebook, self.bias = trellis, suh, svh, codebook, bias
        # The weight's split schedule (kernels.exl3.split_schedule), which fixes every output's
        # summation order: a column slice of a bigger weight (tensor parallelism) keeps the
        # whole weight's columns; a weight that also runs in a grouped launch (wo_a's groups,
        # quant.groups) aims at that launch's target, alone as well.
        self.sched_cols: int | None = None
        self.target_programs: int | None = None
        self._w_hat_t: torch.Tensor | None = None

    def w_hat(self) -> torch.Tensor:
        """Ŵ (k_p, n_p) fp16, decoded from the trellis (bit-exact)."""
        return decode_trellis(self.trellis.cpu(), self.codebook).to(self.trellis.device)

    def w_hat_t(self) -> torch.Tensor:
        """Ŵᵀ (n_p, k_p) fp32, decoded once: the reference path's product operand (the fast
        kernels of issue 5 decode tiles on the fly instead)."""
        if self._w_hat_t is None:
            self._w_hat_t = self.w_hat().float().T.contiguous()
        return self._w_hat_t

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W in torch's [out, in] orientation (trimmed to the true dims)."""
        w = self.w_hat().float()
        w = self.suh.float()[:, None] * _rotate(_rotate(w.T).T)  # H·Ŵ·H with row scale
        w = w * self.svh.float()[None, :]
        return w[:self.in_features, :self.out_features].T.contiguous().to(dtype)

    def forward(self, x: torch.Tensor, nx: Numerics, out_dtype: torch.dtype | None = None,
                act_quant: bool = True, rope: InverseRope | None = None) -> torch.Tensor:
        """`rope`: x is first rope.apply(x) — on the kernels inside the input rotation."""
        if _use_kernels(x):  # fixed-order kernels: batch-invariant, fused == reconstruct+GEMM
            from strata.kernels.exl3 import exl3_linear
            return exl3_linear(x, self.trellis, self.suh, self.svh, self.codebook,
                               self.out_features, self.bias, out_dtype or nx.act_dtype,
                               sched_cols=self.sched_cols,
                               target_programs=self.target_programs, rope=rope)
        if rope is not None:
            x = rope.apply(x)
        kp = self.suh.numel()  # (EXL3 takes fp16 activations: no fp8 point to skip)
        xf = x.float()
        if xf.shape[-1] < kp:  # zero-extend to the padded input width
            xf = torch.nn.functional.pad(xf, (0, kp - xf.shape[-1]))
        xr = (xf * self.suh.float()).half().float()
        xr = _rotate(xr).half()
        y = row_matmul(xr.float(), self.w_hat_t())
        y = _rotate(y) * self.svh.float()
        y = y[..., :self.out_features]
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(out_dtype or nx.act_dtype)

    def nbytes(self) -> int:
        return (self.trellis.numel() * 2 + self.suh.numel() * 2 + self.svh.numel() * 2
                + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0))
