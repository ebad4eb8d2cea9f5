"""RMSNorm in one launch on CUDA (the torch definition is strata.model.numerics.rms_norm, ~9
launches there). One program per row: Σx² accumulated over BLOCK-wide column chunks in
ascending order, one final tree sum, then y = (x·rsqrt(Σx²/K + eps))·w rounded once to the
input's dtype. Every row is computed alone (batch-invariant); the sum's order differs from the
torch path's, so results may differ from it in the last bits (tested under the interpreter
against the definition, and bit for bit row-alone vs batched).

`collapse_rms_norm`: the norm of mHC's collapse Σ_i pre[i]·h[i] (a sublayer's input) in the
same launch — each x value computed as kernels/mhc's collapse computes it (fp32 products
added in copy order, rounded once to h's dtype), then this kernel's arithmetic: the bits of
rms_norm(collapse(h, pre)) with one launch fewer.

`rms_norm_rope`: the norm, then RoPE on the row's last channels (strata.kernels.rope's
operations on the rounded norm), in the same launch: an attention's window keys and the
indexer's keys."""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch definition is used
    triton = None

BLOCK = 1024
NUM_WARPS = 4  # (scripts/probe_norm.py varies both)


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


if triton is not None:
    from strata.kernels import pdl
    from strata.kernels.mhc import _round_out
    from strata.kernels.pdl import prefetch_l2, wait_then_release

    @triton.jit
    def _row_values(xrow, pre_row, k, K, s_copy, H: tl.constexpr, DT: tl.constexpr):
        """x[k] in fp32: the stored row (H = 0), or mHC's collapse Σ_i pre[i]·h[i] of the H
        copies s_copy apart, as strata.kernels.mhc's collapse rounds it to DT."""
        if H == 0:
            return tl.load(xrow + k, mask=k < K, other=0.0).to(tl.float32)
        else:
            acc = tl.load(pre_row) * tl.load(xrow + k, mask=k < K, other=0.0).to(tl.float32)
            for i in tl.static_range(1, H):
                acc = acc + tl.load(pre_row + i) * tl.load(xrow + i * s_copy + k, mask=k < K,
                                                           other=0.0).to(tl.float32)
            return _round_out(acc, DT).to(tl.float32)

    @triton.jit
    def _roped(y, cos_ptr, sin_ptr, r, k0, K: tl.constexpr, BK: tl.constexpr,
               RD2: tl.constexpr):
        """A chunk of a normed row (in its stored dtype) with the row's last RD2 channel pairs
        rotated as strata.kernels.rope rotates them (a·c − b·s and a·s + b·c, each product
        rounded, then one rounding); the other channels as they are."""
        dt = y.dtype
        a, b = tl.split(tl.reshape(y.to(tl.float32), [BK // 2, 2]))
        tp = k0 // 2 + tl.arange(0, BK // 2) - (K // 2 - RD2)  # the pair's index in the tail
        tm = (tp >= 0) & (tp < RD2)
        c = tl.load(cos_ptr + r * RD2 + tp, mask=tm, other=1.0)
        s = tl.load(sin_ptr + r * RD2 + tp, mask=tm, other=0.0)
        ra = tl.where(tm, _round_out(a * c - b * s, dt), a.to(dt))
        rb = tl.where(tm, _round_out(a * s + b * c, dt), b.to(dt))
        return tl.reshape(tl.join(ra, rb), [BK])

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, pre_ptr, cos_ptr, sin_ptr, sx_row, so_row,
                         s_copy, eps, K: tl.constexpr, HAS_W: tl.constexpr, BK: tl.constexpr,
                         H: tl.constexpr, RD2: tl.constexpr, WL: tl.constexpr,
                         PDL: tl.constexpr):
        if HAS_W:  # the weight's 128-byte lines (WL ≥ their count), asked for before the wait
            nbytes: tl.constexpr = K * (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
            line = tl.minimum(tl.arange(0, WL), (nbytes - 1) // 128)
            prefetch_l2(w_ptr.to(tl.pointer_type(tl.int8)) + line * 128, PDL)
        wait_then_release(PDL)
        r = tl.program_id(0).to(tl.int64)
        xrow = x_ptr + r * sx_row
        pre_row = pre_ptr + r * H
        acc = tl.zeros([BK], dtype=tl.float32)
        # Both passes unrolled (K is a compile-time width): every chunk's loads are
        # independent of the in-order adds, so they are issued together — a decode row is one
        # program, whose time was the loads' latency chunk after chunk (a collapse of four
        # 5,120-wide copies: 5 chunks × 4 loads, twice).
        for k0 in tl.static_range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            xv = _row_values(xrow, pre_row, k, K, s_copy, H, out_ptr.dtype.element_ty)
            acc = acc + xv * xv
        inv = tl.rsqrt(tl.sum(acc, axis=0) / K + eps)
        for k0 in tl.static_range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            y = _row_values(xrow, pre_row, k, K, s_copy, H, out_ptr.dtype.element_ty) * inv
            if HAS_W:
                y = y * tl.load(w_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            y = _round_out(y, out_ptr.dtype.element_ty)
            if RD2 > 0:  # then RoPE on the last 2·RD2 channels (rms_norm_rope)
                y = _roped(y, cos_ptr, sin_ptr, r, k0, K, BK, RD2)
            tl.store(out_ptr + r * so_row + k, y, mask=k < K)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """w ⊙ x·rsqrt(mean(x²)+eps) over the last dim, in x's dtype (any leading shape)."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _launch(x2, weight, out, None, 0, eps)
    return out.view(x.shape)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """apply_rope(rms_norm(x, weight, eps), cos, sin) in one launch, the two kernels' bits:
    x [T, K], cos/sin [T, rd/2] fp32 (the last rd channels rotated in pairs)."""
    T, K = x.shape
    rd2 = cos.shape[-1]
    if tuple(cos.shape) != (T, rd2) or tuple(sin.shape) != (T, rd2) or 2 * rd2 > K:
        raise ValueError(f"rms_norm_rope: cos {list(cos.shape)} and sin {list(sin.shape)} "
                         f"for x {list(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, weight, out, None, 0, eps, (cos.float().contiguous(), sin.float().contiguous()))
    return out


def collapse_rms_norm(h: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor | None,
                      eps: float) -> torch.Tensor:
    """rms_norm(Σ_i pre[:, i]·h[:, i]) for h [T, H, D], pre [T, H] fp32 → [T, D] in h's
    dtype, in one launch."""
    T, H, D = h.shape
    if tuple(pre.shape) != (T, H):
        raise ValueError(f"collapse_rms_norm: pre {list(pre.shape)} for h {list(h.shape)}")
    if h.stride(2) != 1:
        h = h.contiguous()
    out = torch.empty((T, D), dtype=h.dtype, device=h.device)
    _launch(h, weight, out, pre.float().contiguous(), h.stride(1), eps)
    return out


def _launch(x: torch.Tensor, weight: torch.Tensor | None, out: torch.Tensor,
            pre: torch.Tensor | None, s_copy: int, eps: float,
            rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """One program per row of out; x: its rows (pre None) or the [T, H, D] copies; `rope`:
    (cos, sin) [T, rd/2] to rotate the normed rows' last rd channels with."""
    T, K = out.shape
    if T == 0:
        return
    w = out if weight is None else weight.contiguous()
    cos, sin = rope if rope is not None else (out, out)
    _rms_norm_kernel[(T,)](x, w, out, out if pre is None else pre, cos, sin, x.stride(0),
                           out.stride(0), s_copy, float(eps), K=K, HAS_W=weight is not None,
                           BK=min(BLOCK, triton.next_power_of_2(K)),
                           H=0 if pre is None else pre.shape[1],
                           RD2=0 if rope is None else rope[0].shape[-1],
                           WL=triton.next_power_of_2(triton.cdiv(K * w.element_size(), 128)),
                           num_warps=NUM_WARPS, enable_fp_fusion=False,
                           **pdl.args(out.device))
