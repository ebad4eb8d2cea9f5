"""Engram on CUDA: the n-gram row ids of a forward's tokens (`ngram_ids`), and the module's
per-copy gate and its update of the stream (`gate_update`), each in one launch.

`ngram_ids` hashes on the device what strata.model.ngram_hash.NgramHasher.ids hashes on the
host — the same integer steps, so the same ids — from the forward's token ids and the
max_ngram − 1 ids before them, both already in the forward's one input upload: inside a
graphed step it replaces ~150–200 µs of host numpy that ran, between reading the previous
token and launching the step, while the GPU sat idle (scripts/probe_host.py). Program
(block, layer) takes BT tokens of one Engram layer: per shift 0..max_ngram−1 the token's
class (the pad class from the first shift that reaches a dead id — negative — or the
history's start onwards), times the layer's multiplier for that shift, XORed into the running
mix; after shift n the mix modulo each head's prime plus its offset is the order-n ids.

The gate: (the
torch definition is strata.model.engram.Engram.forward after the projection, ~30 launches
there: three row sums through the row kernel — a decode step's took ~19 µs each — and the
elementwise steps around them).

Program (t, i) takes copy i of token t: over the row in BLOCK-wide column chunks, in
ascending order, Σ (h·w)·key, Σ h² and Σ key² (each product rounded as torch rounds it, no
fused multiply-add), one final tree sum each; then the torch code's scalar steps — the dot
times rsqrt(mean h² + eps) times rsqrt(mean key² + eps), divided by √D, the gate
sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot)) — and h + gate·value rounded once to h's dtype.
Every row is computed alone (batch-invariant); the sums' order differs from the row
kernel's, so the gate may differ from the torch path's in the last bits (tested under the
interpreter against the definition)."""
from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch definition is used
    triton = None

BLOCK = 1024


def available(t: torch.Tensor) -> bool:
    return available_on(t.device)


def available_on(device: torch.device) -> bool:
    return triton is not None and torch.device(device).type == "cuda"


if triton is not None:
    from strata.kernels import pdl
    from strata.kernels.mhc import _round_out
    from strata.kernels.pdl import wait_then_release

    @triton.jit
    def _gate_kernel(h_ptr, w_ptr, key_ptr, value_ptr, out_ptr, sh_row, sh_copy, sk_row,
                     sv_row, so_row, so_copy, eps, sqrt_d, D: tl.constexpr, BK: tl.constexpr,
                     PDL: tl.constexpr):
        wait_then_release(PDL)
        t = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1)
        hrow = h_ptr + t * sh_row + i * sh_copy
        krow = key_ptr + t * sk_row + i * D
        wrow = w_ptr + i * D
        dot = tl.zeros([BK], dtype=tl.float32)
        hh = tl.zeros([BK], dtype=tl.float32)
        kk = tl.zeros([BK], dtype=tl.float32)
        for k0 in tl.static_range(0, D, BK):  # (unrolled: every chunk's loads issue together)
            k = k0 + tl.arange(0, BK)
            m = k < D
            hv = tl.load(hrow + k, mask=m, other=0.0).to(tl.float32)
            kv = tl.load(krow + k, mask=m, other=0.0)
            dot = dot + (hv * tl.load(wrow + k, mask=m, other=0.0)) * kv
            hh = hh + hv * hv
            kk = kk + kv * kv
        # (div_rn: IEEE division as torch's; Triton's `/` on fp32 is the approximate one)
        d = tl.sum(dot, axis=0)
        d = d * tl.rsqrt(tl.math.div_rn(tl.sum(hh, axis=0), D * 1.0) + eps) \
            * tl.rsqrt(tl.math.div_rn(tl.sum(kk, axis=0), D * 1.0) + eps)
        d = tl.math.div_rn(d, sqrt_d)
        s = tl.sqrt_rn(tl.maximum(tl.abs(d), 1e-6))
        negative = d.to(tl.int32, bitcast=True) < 0  # (the sign bit: −0 too, as copysign)
        gate = tl.sigmoid(tl.where(negative, -s, s))
        for k0 in tl.static_range(0, D, BK):
            k = k0 + tl.arange(0, BK)
            m = k < D
            hv = tl.load(hrow + k, mask=m, other=0.0).to(tl.float32)
            y = hv + gate * tl.load(value_ptr + t * sv_row + k, mask=m, other=0.0)
            tl.store(out_ptr + t * so_row + i * so_copy + k,
                     _round_out(y, out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _ngram_ids_kernel(hist_ptr, tok_ptr, map_ptr, mult_ptr, primes_ptr, offsets_ptr,
                          out_ptr, T, S, pad_class, N: tl.constexpr, H: tl.constexpr,
                          HP: tl.constexpr, BT: tl.constexpr, PDL: tl.constexpr):
        wait_then_release(PDL)
        layer = tl.program_id(1)
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        live = t < T
        heads = tl.arange(0, HP)
        blocked = t < 0
        mixed = tl.zeros([BT], dtype=tl.int64)
        out = out_ptr + layer.to(tl.int64) * T * ((N - 1) * H) + t.to(tl.int64)[:, None] * \
            ((N - 1) * H) + heads[None, :]
        for shift in tl.static_range(N):
            src = S + t - shift  # in history ++ tokens
            in_tokens = src >= S
            raw = tl.where(in_tokens,
                           tl.load(tok_ptr + (src - S), mask=live & in_tokens, other=0),
                           tl.load(hist_ptr + src, mask=live & ~in_tokens & (src >= 0),
                                   other=-1))
            blocked = blocked | (raw < 0)  # (cumulative: older shifts stay blocked)
            cls = tl.load(map_ptr + tl.maximum(raw, 0), mask=live, other=0)
            cls = tl.where(blocked, pad_class, cls)
            mixed = mixed ^ (cls * tl.load(mult_ptr + layer * N + shift))
            if shift > 0:
                at = (layer * (N - 1) + shift - 1) * H + heads
                prime = tl.load(primes_ptr + at, mask=heads < H, other=1)
                offset = tl.load(offsets_ptr + at, mask=heads < H, other=0)
                tl.store(out + (shift - 1) * H, mixed[:, None] % prime[None, :] + offset[None, :],
                         mask=live[:, None] & (heads[None, :] < H))


def ngram_ids(history: torch.Tensor, tokens: torch.Tensor, token_map: torch.Tensor,
              multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor,
              pad_class: int) -> torch.Tensor:
    """Row ids [L, T, (N−1)·H] int64 of tokens [T] (int64) after history [S] (the S ids right
    before tokens[0], oldest first; −1 where the sequence had not started or the id is dead),
    for L Engram layers: token_map [vocab] (class per id), multipliers [L, N], primes and
    offsets [L, N−1, H] (int64, NgramHasher's tables, on tokens' device)."""
    L, N = multipliers.shape
    H = primes.shape[2]
    T, S = tokens.numel(), history.numel()
    if tuple(primes.shape) != (L, N - 1, H) or tuple(offsets.shape) != (L, N - 1, H):
        raise ValueError(f"ngram ids: multipliers {list(multipliers.shape)}, primes "
                         f"{list(primes.shape)} and offsets {list(offsets.shape)} do not match")
    out = torch.empty((L, T, (N - 1) * H), dtype=torch.int64, device=tokens.device)
    if T and L:
        BT = 128 if T > 32 else 32
        _ngram_ids_kernel[(triton.cdiv(T, BT), L)](
            history, tokens, token_map, multipliers, primes, offsets, out, T, S,
            int(pad_class), N=N, H=H, HP=triton.next_power_of_2(H), BT=BT, num_warps=4,
            **pdl.args(tokens.device))
    return out


def gate_update(h: torch.Tensor, qk_weight: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, eps: float) -> torch.Tensor:
    """h + gate·value for h [T, H, D] (any float dtype), qk_weight [H, D] fp32, key [T, H, D]
    fp32 (rows may be strided: a view of the projection), value [T, D] fp32 → [T, H, D] in
    h's dtype, each copy's gate from its own row (see the module docstring)."""
    T, H, D = h.shape
    if (tuple(qk_weight.shape) != (H, D) or tuple(key.shape) != (T, H, D)
            or tuple(value.shape) != (T, D)):
        raise ValueError(f"engram gate: h {list(h.shape)}, qk_weight {list(qk_weight.shape)}, "
                         f"key {list(key.shape)} and value {list(value.shape)} do not match")
    if h.stride(2) != 1:
        h = h.contiguous()
    if key.stride(2) != 1 or key.stride(1) != D:
        key = key.contiguous()
    if value.stride(1) != 1:
        value = value.contiguous()
    w = qk_weight.float().contiguous()
    key, value = key.float(), value.float()
    out = torch.empty((T, H, D), dtype=h.dtype, device=h.device)
    if T:
        _gate_kernel[(T, H)](h, w, key, value, out, h.stride(0), h.stride(1), key.stride(0),
                             value.stride(0), out.stride(0), out.stride(1), float(eps),
                             math.sqrt(D), D=D, BK=min(BLOCK, triton.next_power_of_2(D)),
                             num_warps=4, enable_fp_fusion=False, **pdl.args(h.device))
    return out
