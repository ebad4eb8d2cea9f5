"""Exact decoders for the checkpoint's quantised encodings, and the quantisers that write fixtures (spec §3.3).

Why hand-written lookup tables: decoding must be bit-exact and independent of how a given torch
build converts float8, so tests can check our tables against torch's own conversion instead of
trusting one to verify itself. All decoders are vectorised (no Python loops over tiles).

Stored forms:
- fp8 dense weights: e4m3fn bytes [out, in] + ue8m0 scale bytes [ceil(out/32), ceil(in/32)],
  value = q[r, c] * 2^(S[r//32, c//32] - 127).
- fp4 experts: int8 [out, in/2], column 2k in the LOW nibble of byte k and 2k+1 in the HIGH
  nibble; nibble = sign (bit 3) + magnitude index into {0, .5, 1, 1.5, 2, 3, 4, 6};
  value * 2^(S[r, c//32] - 127), S [out, in/32].
- Engram rows: e4m3 [n, d] + ue8m0 scale [n, d/32] (per-row groups of 32, not tiles).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from strata.errors import CheckpointError

FP8_MAX = 448.0
FP4_MAX = 6.0
E2M1_GRID: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _build_e4m3_lut() -> torch.Tensor:
    """All 256 e4m3fn byte values as float32: bias 7, subnormals at exponent field 0, S.1111.111 = NaN."""
    vals = []
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        exp = (b >> 3) & 0xF
        man = b & 0x7
        if exp == 0xF and man == 0x7:
            vals.append(float("nan"))
        elif exp == 0:
            vals.append(sign * man / 8.0 * 2.0**-6)
        else:
            vals.append(sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7))
    return torch.tensor(vals, dtype=torch.float32)


def _build_e8m0_lut() -> torch.Tensor:
    """All 256 ue8m0 bytes: 2^(b-127), 255 = NaN. Powers of two are exact in float32 (2^-127 is subnormal)."""
    vals = [2.0 ** (b - 127) for b in range(255)] + [float("nan")]
    return torch.tensor(vals, dtype=torch.float32)


def _build_e2m1_lut() -> torch.Tensor:
    """The 16 e2m1 nibble codes: bit 3 is the sign, bits 0-2 index E2M1_GRID (code 8 is -0.0)."""
    return torch.tensor(list(E2M1_GRID) + [-v for v in E2M1_GRID], dtype=torch.float32)


E4M3_LUT = _build_e4m3_lut()
E8M0_LUT = _build_e8m0_lut()
E2M1_LUT = _build_e2m1_lut()
_E2M1_GRID_T = torch.tensor(E2M1_GRID, dtype=torch.float32)


def _as_bytes(t: torch.Tensor, what: str) -> torch.Tensor:
    """Reinterpret 1-byte storage (uint8 / int8 / float8 / packed fp4) as uint8 without copying."""
    if t.element_size() != 1 or t.dtype == torch.bool:
        raise ValueError(f"{what}: expected a 1-byte dtype (uint8/int8/float8), got {t.dtype}")
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


_LUTS = {"e4m3": E4M3_LUT, "e8m0": E8M0_LUT, "e2m1": E2M1_LUT}


@lru_cache(maxsize=None)
def _lut_on(name: str, device: torch.device) -> torch.Tensor:
    """One copy of a decode table per device: a per-call upload would be a pageable host copy
    inside every forward (a stream wait, and refused inside a CUDA graph capture)."""
    return _LUTS[name].to(device)


def _lut_lookup(name: str, b: torch.Tensor) -> torch.Tensor:
    return _lut_on(name, b.device)[b.to(torch.int64)]


def e4m3_to_float(x: torch.Tensor) -> torch.Tensor:
    """Decode e4m3fn (given as float8_e4m3fn or raw uint8/int8 bytes) to float32, exactly; 0x7F/0xFF -> NaN."""
    return _lut_lookup("e4m3", _as_bytes(x, "e4m3_to_float"))


def e8m0_to_float(x: torch.Tensor) -> torch.Tensor:
    """Decode ue8m0 scale bytes (uint8 or float8_e8m0fnu) to float32 2^(b-127); byte 255 -> NaN."""
    return _lut_lookup("e8m0", _as_bytes(x, "e8m0_to_float"))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def dequant_fp8_block(
    w: torch.Tensor, scale: torch.Tensor, block: int = 32, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dense fp8 weight [out, in] with one ue8m0 exponent per block x block tile -> `dtype`.

    The product q * 2^k is exact in float32, so the result is exact in any dtype wide enough.
    Ragged edges (out or in not a multiple of `block`) are handled by zero-padding q.
    """
    if w.dim() != 2:
        raise ValueError(f"dequant_fp8_block: weight must be 2-D, got shape {tuple(w.shape)}")
    out_dim, in_dim = w.shape
    rows, cols = _ceil_div(out_dim, block), _ceil_div(in_dim, block)
    if tuple(scale.shape) != (rows, cols):
        raise CheckpointError(
            f"dequant_fp8_block: weight {tuple(w.shape)} with block {block} needs scale shape "
            f"{(rows, cols)}, got {tuple(scale.shape)}"
        )
    q = e4m3_to_float(w)
    s = e8m0_to_float(scale)
    q = F.pad(q, (0, cols * block - in_dim, 0, rows * block - out_dim))
    full = (q.view(rows, block, cols, block) * s.view(rows, 1, cols, 1)).view(rows * block, cols * block)
    return full[:out_dim, :in_dim].to(dtype)


def _unpack_fp4(w: torch.Tensor) -> torch.Tensor:
    """[..., k] packed bytes -> [..., 2k] float32 e2m1 values (low nibble first)."""
    b = _as_bytes(w, "fp4 weight")
    lo = _lut_lookup("e2m1", b & 0x0F)
    hi = _lut_lookup("e2m1", b >> 4)
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def _scale_groups(values: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype,
                  what: str) -> torch.Tensor:
    """values [n, d] fp32 × 2^(scale[n, d/group] − 127) per `group` along each row."""
    n, d = values.shape
    if d % group:
        raise CheckpointError(f"{what}: width {d} is not a multiple of group {group}")
    if tuple(scale.shape) != (n, d // group):
        raise CheckpointError(f"{what}: values [{n}, {d}] need scale shape {(n, d // group)}, "
                              f"got {tuple(scale.shape)}")
    q = values.view(n, d // group, group)
    return (q * e8m0_to_float(scale).unsqueeze(-1)).view(n, d).to(dtype)


def dequant_fp4_group(
    w: torch.Tensor, scale: torch.Tensor, group: int = 32, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Packed fp4 expert weight int8 [out, in/2] + ue8m0 scale [out, in/group] -> `dtype` [out, in]."""
    if w.dim() != 2:
        raise ValueError(f"dequant_fp4_group: weight must be 2-D, got shape {tuple(w.shape)}")
    return _scale_groups(_unpack_fp4(w).view(w.shape[0], -1), scale, group, dtype,
                         f"dequant_fp4_group (packed weight {tuple(w.shape)})")


def dequant_engram_rows(
    rows: torch.Tensor, scale: torch.Tensor, group: int = 32, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Engram table rows e4m3 [n, d] + ue8m0 scale [n, d/group] (per-row groups) -> `dtype` [n, d]."""
    if rows.dim() != 2:
        raise ValueError(f"dequant_engram_rows: rows must be 2-D, got shape {tuple(rows.shape)}")
    return _scale_groups(e4m3_to_float(rows), scale, group, dtype, "dequant_engram_rows")


# ------------------------------------------------------------------------------------ quantisers


def ceil_log2(r: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(r)) for positive finite r (float32, or float64 kept as is), as int32.

    frexp gives r = m * 2^e with m in [0.5, 1); r is a power of two exactly when m == 0.5, so
    there is no log2 rounding to worry about at the power-of-two boundaries.
    """
    m, e = torch.frexp(r if r.dtype == torch.float64 else r.to(torch.float32))
    return (e - (m == 0.5).to(e.dtype)).to(torch.int32)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as float32 for int exponents in [-127, 127], exact (via the e8m0 table)."""
    return _lut_lookup("e8m0", (e + 127).to(torch.int64))


def _group_exponent(amax: torch.Tensor, maxval: float) -> torch.Tensor:
    """ceil(log2(amax / maxval)) per group, amax = 0 -> 0, clamped to the ue8m0 range [-127, 127].

    The ratio is taken in float64 so that a tiny (even subnormal) amax cannot underflow to 0.
    """
    amax = amax.to(torch.float64)
    pos = amax > 0
    ratio = torch.where(pos, amax / maxval, torch.ones_like(amax))
    e = torch.where(pos, ceil_log2(ratio), torch.zeros_like(amax, dtype=torch.int32))
    return e.clamp(-127, 127)


def _check_quant_input(w: torch.Tensor, what: str) -> torch.Tensor:
    if w.dim() != 2:
        raise ValueError(f"{what}: expected a 2-D tensor, got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise ValueError(f"{what}: expected a floating tensor, got {w.dtype}")
    w = w.to(torch.float32)
    if not torch.isfinite(w).all():
        raise ValueError(f"{what}: input has NaN or inf")
    return w


def quant_fp8_block(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (float8_e4m3fn [out, in], uint8 scale [out/32, in/32]); per-tile
    exponent ceil(log2(amax/448)), values w/2^e clamped to ±448 and RNE-cast by torch."""
    w = _check_quant_input(w, "quant_fp8_block")
    out_dim, in_dim = w.shape
    if out_dim % block or in_dim % block:
        raise ValueError(f"quant_fp8_block: shape {tuple(w.shape)} must be multiples of {block} in both dims")
    rows, cols = out_dim // block, in_dim // block
    tiles = w.view(rows, block, cols, block)
    amax = tiles.abs().amax(dim=(1, 3))
    e = _group_exponent(amax, FP8_MAX)
    q = (tiles / _pow2(e).view(rows, 1, cols, 1)).clamp(-FP8_MAX, FP8_MAX)
    q8 = q.view(out_dim, in_dim).to(torch.float8_e4m3fn)
    return q8, (e + 127).to(torch.uint8)


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Round to the e2m1 grid {0,.5,1,1.5,2,3,4,6} (with sign) nearest-even, saturating at ±6.

    On each binade the grid is evenly spaced (0.5 below 2, 1 in [2,4), 2 in [4,6]), so scaling
    by a power of two and torch.round (half to even) gives ties to the even code:
    0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4. Sign is kept (-0.0 stays negative).
    """
    a = x.abs().clamp(max=FP4_MAX)
    r = torch.where(a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2))
    return torch.copysign(r, x)


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Values already on the signed e2m1 grid -> 4-bit codes (uint8), sign in bit 3."""
    idx = torch.searchsorted(_E2M1_GRID_T.to(v.device), v.abs().contiguous())
    return (idx.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)).to(torch.uint8)


def quant_fp4_group(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (int8 packed [out, in/2], uint8 scale [out, in/32]); per-group exponent
    ceil(log2(amax/6)), e2m1 round-to-nearest-even of w/2^e clamped to ±6."""
    w = _check_quant_input(w, "quant_fp4_group")
    out_dim, in_dim = w.shape
    if in_dim % group:
        raise ValueError(f"quant_fp4_group: in dim {in_dim} must be a multiple of {group}")
    g = w.view(out_dim, in_dim // group, group)
    e = _group_exponent(g.abs().amax(dim=-1), FP4_MAX)
    v = e2m1_round(g / _pow2(e).unsqueeze(-1)).view(out_dim, in_dim)
    codes = _e2m1_codes(v).view(out_dim, in_dim // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed.view(torch.int8), (e + 127).to(torch.uint8)


def quant_engram_rows(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """float [n, d] -> (float8_e4m3fn [n, d], uint8 scale [n, d/32]); per-row groups of 32 with
    exponent ceil(log2(amax/448))."""
    w = _check_quant_input(w, "quant_engram_rows")
    n, d = w.shape
    if d % group:
        raise ValueError(f"quant_engram_rows: row width {d} must be a multiple of {group}")
    g = w.view(n, d // group, group)
    e = _group_exponent(g.abs().amax(dim=-1), FP8_MAX)
    q = (g / _pow2(e).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    return q.view(n, d).to(torch.float8_e4m3fn), (e + 127).to(torch.uint8)
