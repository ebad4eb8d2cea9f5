"""Mixture of experts: sqrt-softplus gate, bias-steered top-k, SwiGLU experts with clamps,
plus the shared expert (spec §2.8).

Routed experts are held as stored, one Linear each; the reference path stacks them dequantized
([E, out, in]) so a step's selected experts are gathered by index — no Python loop over experts
while decoding. Prefill (many token-expert pairs) instead runs each present expert once over
its tokens. On CUDA, fp4/fp8 and EXL3 experts instead run the grouped kernels of
strata.kernels.moe / strata.kernels.exl3 on the stacked stored tensors (no dense copy), chosen
by format at `ExpertStack._fast_slots`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.checkpoint.weights import WeightReader
from strata.config import ModelConfig
from strata.model.numerics import Numerics, ranked_topk, row_matmul, rows_bmm
from strata.quant.groups import LinearSet
from strata.quant.linear import Linear
from strata.quant.qdq import fp8_act_qdq
from strata.streams import both

# Token-expert pairs up to which a step gathers expert weights instead of grouping tokens.
GATHER_PAIRS = 16


def swiglu(g: torch.Tensor, v: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(g, limit))·clamp(v, ±limit) in fp32."""
    return F.silu(g.float().clamp(max=limit)) * v.float().clamp(-limit, limit)


def swiglu_to(g: torch.Tensor, v: torch.Tensor, limit: float, dtype: torch.dtype,
              weight: torch.Tensor | None = None) -> torch.Tensor:
    """swiglu(g, v, limit), times a per-row weight ([...] over g's rows [..., N]) if given,
    rounded to dtype: what feeds a down projection. One launch on CUDA (kernels.moe_ops)."""
    from strata.kernels import moe_ops
    if moe_ops.available(g):
        return moe_ops.swiglu(g, v, limit, dtype, weight)
    a = swiglu(g, v, limit)
    return (a if weight is None else a * weight.unsqueeze(-1).float()).to(dtype)


def slot_sum(ys: torch.Tensor, plus: torch.Tensor | None = None,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Σ_s ys[:, s] in slot order, fp32: [T, k, D] → [T, D]; with `plus` [T, D] (the shared
    expert's output) that sum + plus in fp32 (the layer's output: routed + shared) — then
    rounded to dtype. One launch on CUDA."""
    from strata.kernels import moe_ops
    if moe_ops.available(ys):
        return moe_ops.slot_sum(ys, plus, dtype)
    ys = ys.float()
    out = ys[:, 0]
    for s in range(1, ys.shape[1]):
        out = out + ys[:, s]
    return (out if plus is None else out + plus.float()).to(dtype)


def expert_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each routed expert projection."""
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    return {"w1": (I, D), "w3": (I, D), "w2": (D, I)}


class ExpertStack:
    """The routed experts of one layer, each w1/w3 [I, D] and w2 [D, I], stacked."""

    def __init__(self, cfg: ModelConfig, w: WeightReader, prefix: str, n_experts: int) -> None:
        # Each expert as stored (fp4, fp8, EXL3 or dense), behind the Linear interface.
        self._init({name: [w.linear(f"{prefix}.{e}.{name}", *shape) for e in range(n_experts)]
                    for name, shape in expert_shapes(cfg).items()}, cfg.swiglu_limit)
        first = self.linears["w1"][0]
        if (self.format in ("fp4", "fp8") and first.weight.is_cuda) or \
                (self.format == "exl3" and first.trellis.is_cuda):
            self.stored()  # stacked once at load

    @classmethod
    def of_linears(cls, linears: dict[str, list[Linear]], limit: float) -> "ExpertStack":
        """A transient stack over given experts (e.g. the cached draft experts of one step):
        the same forward, bit for bit, as the full stack restricted to them; its stacks are
        copies (the Linears stay as they are)."""
        stack = cls.__new__(cls)
        stack._init(linears, limit, rebind=False)
        return stack

    def _init(self, linears: dict[str, list[Linear]], limit: float, rebind: bool = True) -> None:
        self.linears, self.limit = linears, limit
        self.n_experts = len(linears["w1"])
        self._dense: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        from strata.kernels.moe import expert_format
        # 'fp4' | 'fp8' | 'exl3' | 'dense' | 'mixed': picks the fast path (_fast_slots).
        self.format = expert_format([l for ls in self.linears.values() for l in ls])
        self._stored: dict | None = None
        self._rebind = rebind

    def stored(self) -> dict:
        """Per projection the stacked stored tensors, built once — the single place that
        stacks (a pack loader handing in stacks would replace it): fp4/fp8 bytes + scales
        (kernels.moe.StoredExperts) or EXL3 trellis/suh/svh (kernels.moe.Exl3Experts), never
        dequantized; each expert's Linear then views its slice, so nothing is held twice."""
        if self._stored is None:
            from strata.kernels.moe import stack_exl3, stack_stored
            stack = stack_exl3 if self.format == "exl3" else stack_stored
            self._stored = {n: stack(self.linears[n], self._rebind) for n in ("w1", "w3", "w2")}
        return self._stored

    def _fast_slots(self, x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor,
                    nx: Numerics) -> torch.Tensor | None:
        """The one dispatch point of the kernel paths, by expert format (CUDA, or forced on
        CPU for tests); None means the reference path below (dense/mixed experts)."""
        if self.format in ("fp4", "fp8"):
            from strata.kernels import fp8fp4
            if not fp8fp4.kernels_enabled(x):
                return None
            from strata.kernels.moe import moe_grouped_slots
            s = self.stored()
            return moe_grouped_slots(x, idx, weight, s["w1"], s["w3"], s["w2"], self.limit, nx)
        if self.format == "exl3":
            from strata.quant import exl3 as qexl3
            if not qexl3._use_kernels(x):  # the EXL3 kernels' own switch (KERNELS)
                return None
            from strata.kernels.moe import exl3_moe_slots
            s = self.stored()
            return exl3_moe_slots(x, idx, weight, s["w1"], s["w3"], s["w2"], self.limit, nx)
        return None

    def dense(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """All experts' `name` weights dequantized and stacked, [E, out, in] (reference path:
        the selected experts are gathered from it by index)."""
        key = (name, dtype)
        if key not in self._dense:
            self._dense[key] = torch.stack([l.dequantize(dtype) for l in self.linears[name]])
        return self._dense[key]

    @property
    def quantized(self) -> bool:
        """Whether vendor numerics put the fp8 activation point before these GEMMs."""
        return self.linears["w1"][0].quantized_activations

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor,
                nx: Numerics) -> torch.Tensor:
        """Σ_k expert_{idx[t,k]}(x_t)·weight[t,k]; x [T, D], idx/weight [T, k] → [T, D] fp32:
        the slots summed in slot order, so a token's output does not depend on the batch."""
        return slot_sum(self.slots(x, idx, weight, nx))

    def slots(self, x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor,
              nx: Numerics) -> torch.Tensor:
        """Each (token, slot) pair's expert_{idx[t,k]}(x_t)·weight[t,k] → [T, k, D] (fp32, or
        the kernel paths' activation dtype): the same per-row products in every path."""
        fast = self._fast_slots(x, idx, weight, nx)
        if fast is not None:
            return fast
        T, k = idx.shape
        dt = nx.act_dtype
        quant = nx.quantize and self.quantized
        xq = (fp8_act_qdq(x) if quant else x).to(dt)
        w1, w3, w2 = self.dense("w1", dt), self.dense("w3", dt), self.dense("w2", dt)
        if T * k <= GATHER_PAIRS:
            flat = idx.reshape(-1)
            xs = xq.repeat_interleave(k, dim=0).unsqueeze(1)  # [T·k, 1, D]
            g = rows_bmm(xs, w1[flat]).squeeze(1)
            v = rows_bmm(xs, w3[flat]).squeeze(1)
            a = swiglu(g, v, self.limit) * weight.reshape(-1, 1).float()
            a = (fp8_act_qdq(a) if quant else a).to(dt).unsqueeze(1)
            ys = rows_bmm(a, w2[flat]).squeeze(1).float().view(T, k, -1)
        else:
            ys = torch.empty((T, k, x.shape[1]), dtype=torch.float32, device=x.device)
            for e in torch.unique(idx).tolist():
                t, slot = (idx == e).nonzero(as_tuple=True)
                g, v = row_matmul(xq[t], w1[e]), row_matmul(xq[t], w3[e])
                a = swiglu(g, v, self.limit) * weight[t, slot, None].float()
                a = (fp8_act_qdq(a) if quant else a).to(dt)
                ys[t, slot] = row_matmul(a, w2[e]).float()
        return ys


class SharedExpert:
    def __init__(self, cfg: ModelConfig, w: WeightReader, prefix: str) -> None:
        D, I = cfg.hidden_size, cfg.moe_intermediate_size
        self.w1 = w.linear(f"{prefix}.w1", I, D)
        self.w3 = w.linear(f"{prefix}.w3", I, D)
        self.w2 = w.linear(f"{prefix}.w2", D, I)
        self.w13 = LinearSet([self.w1, self.w3])  # (gate and up: one launch where they can)
        self.limit = cfg.swiglu_limit

    def forward(self, x: torch.Tensor, nx: Numerics) -> torch.Tensor:
        return self.down(*self.w13(x, nx), nx)

    def down(self, g: torch.Tensor, v: torch.Tensor, nx: Numerics) -> torch.Tensor:
        """The output from w1's and w3's (gate, up): w2 of their SwiGLU, fp32."""
        a = swiglu_to(g, v, self.limit, nx.act_dtype)
        return self.w2(a, nx, torch.float32)


class MoE:
    def __init__(self, cfg: ModelConfig, w: WeightReader, prefix: str, n_experts: int,
                 top_k: int) -> None:
        D = cfg.hidden_size
        self.cfg, self.top_k = cfg, top_k
        self.gate = w.linear(f"{prefix}.gate", n_experts, D)
        self.bias = w.float_tensor(f"{prefix}.gate.bias", (n_experts,))
        self.bias_vl = (w.float_tensor(f"{prefix}.gate.bias_vl", (n_experts,))
                        if w.has(f"{prefix}.gate.bias_vl") else None)
        # A reader may keep some experts off the device behind a cache (the DSpark stages',
        # runtime.expert_cache); the backbone's are always an ExpertStack.
        cached = getattr(w, "cached_experts", None)
        self.experts = (cached and cached(cfg, f"{prefix}.experts", n_experts)) or \
            ExpertStack(cfg, w, f"{prefix}.experts", n_experts)
        self.shared = SharedExpert(cfg, w, f"{prefix}.shared_experts") \
            if cfg.n_shared_experts else None

    def route(self, u: torch.Tensor, nx: Numerics) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], weights [T, k]) for u: its gate's logits, routed."""
        return self.route_logits(self.gate(u, nx, torch.float32))

    def route_logits(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], weights [T, k]) from the gate's logits [T, E] fp32; the bias
        picks experts but never weights them. One launch on CUDA (kernels.moe_ops.route: the
        same picks)."""
        from strata.kernels import moe_ops
        if moe_ops.available(logits):
            return moe_ops.route(logits, self.bias, self.cfg.gate_temp, self.top_k,
                                 self.cfg.routed_scaling_factor)
        s = torch.sqrt(F.softplus(logits / self.cfg.gate_temp))
        biased = s + self.bias
        idx = ranked_topk(biased, self.top_k)  # (a stable descending sort's first k)
        w = s.gather(1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * self.cfg.routed_scaling_factor
        return idx, w

    def forward(self, u: torch.Tensor, nx: Numerics) -> torch.Tensor:
        def routed() -> torch.Tensor:
            return self.experts.slots(u, *self.route(u, nx), nx)

        if self.shared is None:
            return slot_sum(routed(), None, nx.act_dtype)
        # The shared expert does not wait for the routing: on a GPU it runs beside it.
        shared, ys = both(lambda: self.shared.forward(u, nx), routed, u.device)
        return slot_sum(ys, shared, nx.act_dtype)  # (with the join: one launch on CUDA)
