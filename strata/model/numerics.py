"""How the forward rounds: reference (fp32, no quantisation points) or vendor (spec §2.9).

`vendor` reproduces every quantisation point of the vendor path: fp8 activations per 32 before
fp8/fp4 GEMMs, fp8 window KV, fp4 compressed KV, fp4 indexer q/k. `reference` keeps fp32
throughout with none of them, to compare with fp32 references such as colibri's.
The activation dtype (fp32 or bf16 between ops) is a separate choice: CPU runs fp32, CUDA bf16.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.errors import ConfigError

MODES = ("reference", "vendor")


@dataclass(frozen=True)
class Numerics:
    mode: str = "reference"
    act_dtype: torch.dtype = torch.float32
    # Vendor quirk (spec §2.6): a ratio-2 index source with no new latent in this forward
    # scores against the previous forward's last published keys. Off by default: it makes
    # decode differ from prefill, and HF transformers implements the intended semantics.
    vendor_stale_index_k: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"numerics mode {self.mode!r}: expected one of {MODES}")
        if self.act_dtype not in (torch.float32, torch.bfloat16):
            raise ConfigError(f"activation dtype {self.act_dtype}: expected float32 or bfloat16")

    @property
    def quantize(self) -> bool:
        return self.mode == "vendor"

    @classmethod
    def for_device(cls, device: torch.device | str, mode: str = "reference",
                   act_dtype: str | None = None, vendor_stale_index_k: bool = False) -> "Numerics":
        """CPU defaults to fp32 activations, CUDA to bf16 (spec: bf16 where the vendor has it)."""
        device = torch.device(device)
        if act_dtype is None:
            dt = torch.bfloat16 if device.type == "cuda" else torch.float32
        else:
            dt = {"float32": torch.float32, "fp32": torch.float32,
                  "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}.get(act_dtype)
            if dt is None:
                raise ConfigError(f"activation dtype {act_dtype!r}: expected float32 or bfloat16")
        return cls(mode=mode, act_dtype=dt, vendor_stale_index_k=vendor_stale_index_k)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """w ⊙ x·rsqrt(mean(x²)+eps), computed in fp32 and cast back to x's dtype (on CUDA one
    fused launch, strata.kernels.norm)."""
    from strata.kernels import norm
    if norm.available(x):
        return norm.rms_norm(x, weight, eps)
    xf = x.float()
    y = xf * torch.rsqrt(row_mean(xf * xf) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def rows_bmm(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, M, K] · w[b]ᵀ for w [B or 1, N, K] → [B, M, N] in out_dtype (default x's dtype,
    the operands computed in it; written into `out`, a contiguous [B, M, N], if given); every
    row computed alike.

    Batch invariance: a row's result must not depend on how many rows share the call (BLAS
    libraries pick kernels from the whole shape and change the rounding), so a prefill chunk,
    a verify window and a single decode step compute bit-identical rows. On CPU a bmm of
    per-batch products is invariant (checked by scripts/batch_invariance.py); on CUDA cuBLAS is
    not, and the fixed-order Triton kernel in strata.kernels.rowwise is used.
    """
    if x.is_cuda:
        from strata.kernels.rowwise import rowwise_bmm
        return rowwise_bmm(x, w, out_dtype=out_dtype, out=out)
    dt = out_dtype or x.dtype
    return torch.bmm(x.to(dt), w.to(dt).expand(x.shape[0], -1, -1).transpose(1, 2), out=out)


def row_matmul(x: torch.Tensor, w: torch.Tensor,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [T, K] · w[N, K]ᵀ → [T, N] in out_dtype (default x's, the operands computed in it),
    each row by the same [1, K]×[K, N] product whatever T."""
    if x.is_cuda:
        from strata.kernels.rowwise import rowwise_rows
        return rowwise_rows(x, w, out_dtype)
    return rows_bmm(x.unsqueeze(1), w.unsqueeze(0), out_dtype).squeeze(1)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Σ over the last dim, keepdim, in a fixed order whatever the leading shape.

    CUDA reductions choose their thread layout from the whole tensor's shape, so a long row
    sums differently alone than among many; a product with a ones vector through the row
    kernel does not. CPU reductions of a contiguous last dim are already row-invariant.
    """
    if not x.is_cuda:
        return x.sum(-1, keepdim=True)
    K = x.shape[-1]
    flat = x.reshape(-1, 1, K)
    return rows_bmm(flat, torch.ones((1, 1, K), dtype=x.dtype, device=x.device)).view(
        *x.shape[:-1], 1)


def row_mean(x: torch.Tensor) -> torch.Tensor:
    return row_sum(x) / x.shape[-1]


def ranked_topk(scores: torch.Tensor, k: int, sorted: bool = True) -> torch.Tensor:
    """Indices [..., k] of the k largest scores along the last dim, ties to the lowest index —
    exactly the first k of a stable descending sort (in that order when `sorted`), without
    sorting the row: one int64 key per entry, the float's bits mapped to an integer of the
    same order (−0 made +0 first, so the zeros tie as floats do) above the reversed index.
    The keys are distinct, so the top k is one set in one order whatever algorithm selects
    it (a radix select instead of a full sort). NaN scores are not expected."""
    from strata.kernels import ranking
    if ranking.available(scores):  # (the keys in one launch, the same bits)
        return torch.topk(ranking.rank_keys(scores), k, dim=-1, sorted=sorted).indices
    n = scores.shape[-1]
    bits = (scores.float() + 0.0).view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    rev = (n - 1) - torch.arange(n, device=scores.device)
    return torch.topk(ordered * (1 << 32) + rev, k, dim=-1, sorted=sorted).indices
