"""Grouped MoE forward over stacked fp4/fp8 experts (the CUDA path of model.moe.ExpertStack).

One step: group the (token, slot) pairs by expert (kernels.moe_grouping: static-shape tiles of
≤ BLOCK_M pairs sharing an expert), then
  1. gate-up kernel, one program per (tile, BLOCK_N columns of I): the tile's x rows times the
     expert's w1 AND w3 tiles (decoded in registers from the stored bytes), then the SwiGLU
     epilogue — w1/w3 products rounded to the activation dtype, silu(min(g, L))·clamp(v, ±L),
     × the pair's routing weight, vendor fp8 qdq per 32 — stored per pair: h [P, I];
  2. down kernel: h[pair]·W2ᵀ per pair → ys [P, D] in the activation dtype, the slots
     (`moe_grouped_slots`); the MoE then sums them in slot order (fp32), as the reference
     does, with the shared expert's output (model.moe.slot_sum: one launch).
Each selected expert's weights are read once per step for all the pairs routed to it (several
times only when more than BLOCK_M pairs share it, one read per tile). Every pair row is reduced
by the same fixed-order kernel whatever its tile, lane, the step's T or the grid (see
kernels.fp8fp4), so a token's output does not depend on the batch.

`stack_stored` builds the stacked device tensors once at load from the per-expert stored
tensors (stored bytes, not dequantized) and rebinds each expert's Linear to a view of the
stack, so the bytes are held once. A pack loader that hands stacks in directly replaces it.

Versus the reference path (dense gather + row products): the same math up to the summation
order of each product and silu's exp (Triton's vs torch's). In fp32 reference numerics that
keeps outputs within ~1e-6 of the largest (tests allow 2e-5); with bf16 activations or the
vendor fp8 points, an fp32 difference that straddles a rounding boundary of an intermediate
(w1/w3 products or outputs in bf16, an activation in fp8) moves it by one step — rare, local
(tests: ≤ 2% of outputs off by more than one bf16 ulp, none by more than 3e-2 of the largest).

EXL3 experts: `stack_exl3` + `exl3_moe_slots`, the same steps around the grouped
`strata.kernels.exl3.exl3_moe_linear`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.kernels.moe_grouping import Routing, group_by_expert


@dataclass
class StoredExperts:
    """One expert projection of all experts, as stored: fp4 weight [E, out, in/2] + scale
    [E, out, in/32], or fp8 weight [E, out, in] + scale [E, ceil(out/32), ceil(in/32)]."""
    fmt: str
    weight: torch.Tensor
    scale: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.weight.shape[1]

    @property
    def in_features(self) -> int:
        return self.weight.shape[2] * (2 if self.fmt == "fp4" else 1)


def expert_format(linears: list) -> str:
    """'fp4' | 'fp8' | 'exl3' | 'dense' when all experts share it, else 'mixed'."""
    from strata.quant.linear import DenseLinear, Fp4Group32Linear, Fp8Block32Linear
    kinds = set()
    for lin in linears:
        if isinstance(lin, Fp4Group32Linear):
            kinds.add("fp4")
        elif isinstance(lin, Fp8Block32Linear):
            kinds.add("fp8")
        elif isinstance(lin, DenseLinear):
            kinds.add("dense")
        elif type(lin).__name__ == "Exl3Linear":
            kinds.add("exl3")
        else:
            kinds.add("other")
    return kinds.pop() if len(kinds) == 1 else "mixed"


def stack_stored(linears: list, rebind: bool = True) -> StoredExperts:
    """Stack the experts' stored tensors ([E, ...], the stored bytes) and rebind each Linear
    to its slice, so the weights are not held twice (rebind=False: a transient stack, e.g.
    of the cached draft experts one step uses, leaves the Linears alone)."""
    fmt = expert_format(linears)
    if fmt not in ("fp4", "fp8"):
        raise ValueError(f"stack_stored: experts are {fmt}, expected fp4 or fp8")
    weight = torch.stack([lin.weight for lin in linears])
    scale = torch.stack([lin.scale for lin in linears])
    for e, lin in enumerate(linears if rebind else []):
        lin.weight, lin.scale = weight[e], scale[e]
    return StoredExperts(fmt, weight, scale)


@dataclass
class Exl3Experts:
    """One expert projection of all experts in EXL3: trellis [E, kt, nt, L] int16, suh [E, k_p],
    svh [E, n_p] (fp16), one codebook; the set form strata.kernels.exl3.exl3_moe_linear takes."""
    codebook: str
    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    out_features: int

    @property
    def set(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.trellis, self.suh, self.svh


def stack_exl3(linears: list, rebind: bool = True) -> Exl3Experts:
    """Stack EXL3 experts' tensors (one codebook, no bias) and rebind each Linear to its slice
    (rebind=False: a transient stack, see stack_stored)."""
    if expert_format(linears) != "exl3":
        raise ValueError("stack_exl3: expected EXL3 experts")
    cbs = {lin.codebook for lin in linears}
    if len(cbs) != 1 or any(lin.bias is not None for lin in linears):
        raise ValueError(f"stack_exl3: experts must share one codebook and have no bias "
                         f"(codebooks {sorted(cbs)})")
    st = {n: torch.stack([getattr(lin, n) for lin in linears]) for n in ("trellis", "suh", "svh")}
    for e, lin in enumerate(linears if rebind else []):
        lin.trellis, lin.suh, lin.svh = st["trellis"][e], st["suh"][e], st["svh"][e]
    return Exl3Experts(cbs.pop(), st["trellis"], st["suh"], st["svh"], linears[0].out_features)


def exl3_moe_slots(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor,
                   w1: Exl3Experts, w3: Exl3Experts, w2: Exl3Experts, limit: float,
                   nx) -> torch.Tensor:
    """ExpertStack.slots for EXL3 experts through strata.kernels.exl3.exl3_moe_linear (gate
    and up in one grouped launch when they share shape and codebook), the SwiGLU with clamps
    and routing weight (elementwise: batch-invariant; made in the down projection's rotation,
    exl3.SwiGLU) and the grouped down projection: [T, k, D] in the activation dtype. Per
    pair the numerics of Exl3Linear's kernel forward (no fp8 point: EXL3 linears take
    unquantized activations) under the experts' own split schedule
    (exl3.GROUPED_TARGET_PROGRAMS: another summation order than a lone linear's)."""
    from strata.kernels.exl3 import GROUPED_TARGET_PROGRAMS, SwiGLU, exl3_moe_linear
    T, k = idx.shape
    dt = nx.act_dtype
    D = w2.out_features
    if T == 0:
        return torch.zeros((0, k, D), dtype=dt, device=x.device)
    routing = Routing(idx, w1.trellis.shape[0])  # (each grouping made once for the 3 launches)
    sched = {"target_programs": GROUPED_TARGET_PROGRAMS}  # (every call: fixed bits per expert)
    xin = x.to(dt)
    if w1.codebook == w3.codebook and w1.trellis.shape == w3.trellis.shape:
        g, v = exl3_moe_linear(xin, idx, [w1.set, w3.set], w1.codebook, w1.out_features, dt,
                               routing, **sched)
    else:
        (g,) = exl3_moe_linear(xin, idx, [w1.set], w1.codebook, w1.out_features, dt, routing,
                               **sched)
        (v,) = exl3_moe_linear(xin, idx, [w3.set], w3.codebook, w3.out_features, dt, routing,
                               **sched)
    # (the SwiGLU with the routing weight made as the down projection's rotation reads it)
    (y,) = exl3_moe_linear(g, idx, [w2.set], w2.codebook, D, dt, routing, **sched,
                           swiglu=SwiGLU(v, weight, limit))
    return y


def moe_grouped_slots(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor,
                      w1: StoredExperts, w3: StoredExperts, w2: StoredExperts, limit: float,
                      nx) -> torch.Tensor:
    """Each pair's expert_{idx[t,k]}(x_t)·weight[t,k] → [T, k, D] in the activation dtype; same
    numerics as ExpertStack.slots's reference path (up to summation order and the exp of
    silu)."""
    from strata.kernels import fp8fp4  # (imported here: model loading stays free of triton)
    from strata.quant.qdq import fp8_act_qdq
    if (w1.fmt != w3.fmt or w1.weight.shape != w3.weight.shape
            or w1.weight.stride() != w3.weight.stride() or w1.scale.stride() != w3.scale.stride()):
        raise ValueError("moe_grouped_slots: w1 and w3 must share format, shape and strides")
    T, k = idx.shape
    E, I, D = w1.weight.shape[0], w1.out_features, w2.out_features
    dt = nx.act_dtype
    quant = bool(nx.quantize)
    if T == 0:
        return torch.zeros((0, k, D), dtype=dt, device=x.device)
    # Operands are bf16 whenever the values are exact in bf16 (then identical products).
    op = torch.bfloat16 if (dt == torch.bfloat16 or quant) else torch.float32
    xq = (fp8_act_qdq(x) if quant else x).to(dt).to(op)
    groups = group_by_expert(idx, E, fp8fp4.BLOCK_M)
    n_tiles = groups.tile_expert.numel()
    rw = weight.reshape(-1).float().contiguous()
    P = T * k
    h = torch.empty((P, I), dtype=op, device=x.device)
    ys = torch.empty((P, D), dtype=dt, device=x.device)
    on_gpu = x.is_cuda
    for (src, a, b, dst, n_out, k_in, gated, x_div) in (
            (xq, w1, w3, h, I, D, True, k), (h, w2, w2, ys, D, I, False, 1)):
        f = fp8fp4.FORMATS[a.fmt]
        wt, st = fp8fp4._as_bytes(a.weight), fp8fp4._as_bytes(a.scale)
        w3t, s3t = fp8fp4._as_bytes(b.weight), fp8fp4._as_bytes(b.scale)
        cfg = fp8fp4.config_for(f, n_out, k_in)
        grid = (n_tiles, -(-n_out // cfg.block_n))
        fp8fp4._moe_kernel[grid](
            src, wt, st, w3t, s3t, dst, rw, groups.tile_expert, groups.tile_rows,
            n_out, k_in, x_div, float(limit),
            src.stride(0), src.stride(1), wt.stride(0), wt.stride(1), wt.stride(2),
            st.stride(0), st.stride(1), st.stride(2), dst.stride(0), dst.stride(1),
            FMT=f, OP=fp8fp4._TL_OP[op], IP=fp8fp4._ip(op), ON_GPU=on_gpu, GATED=gated,
            QUANT=quant, ROUND_BF16=dt == torch.bfloat16, BLOCK_M=fp8fp4.BLOCK_M,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, enable_fp_fusion=False)
    return ys.view(T, k, D)
