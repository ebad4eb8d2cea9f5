"""Linears run together: a row-grouped linear (attention's wo_a: group g's own linear applied to
group g's own input slice, outputs side by side), and a set of linears on one input (the shared
expert's w1 and w3, the compressor's wkv and wgate).

V4.1 has 8 groups per layer: called one by one, a decode step pays 8 small launch-bound
linears per layer (in EXL3 two kernels each). When the groups are EXL3 slices of one shape and
codebook, a decode-sized forward runs them as one grouped launch instead — the MoE's grouped
EXL3 linear with group g in the place of expert g, whose every (row, group) output is bit for
bit the group's own linear on that row (strata.kernels.exl3.exl3_moe_linear's contract), so
the choice changes no bit: such groups take the grouped launch's split schedule
(GROUPED_TARGET_PROGRAMS) in every call. Prefill-sized forwards keep one call per group (each
then takes the tensor-core GEMM path). A set of linears on one input is the same launch with
each linear a weight set of one "expert" (gate and up of the routed experts run this way).
"""
from __future__ import annotations

import torch

from strata.model.numerics import Numerics
from strata.model.rope import InverseRope
from strata.quant.linear import Linear


class LinearGroups:
    def __init__(self, linears: list[Linear]) -> None:
        self.linears = list(linears)
        self._stack = None          # the groups' EXL3 tensors stacked (built on first use)
        self._routes: dict = {}     # (T, device) -> Routing of group ids [T, G]
        # EXL3 groups that can run as one launch take that launch's split schedule, in their
        # lone calls (prefill) too: the same bits either way, from the first call on
        self._target = None
        if _one_exl3_shape(self.linears):
            from strata.kernels.exl3 import GROUPED_TARGET_PROGRAMS
            self._target = GROUPED_TARGET_PROGRAMS
            for lin in self.linears:
                lin.target_programs = self._target

    def __len__(self) -> int:
        return len(self.linears)

    def __getitem__(self, g: int) -> Linear:
        return self.linears[g]

    def select(self, groups) -> "LinearGroups":
        """These groups only (tensor parallelism keeps its heads' groups)."""
        return LinearGroups([self.linears[g] for g in groups])

    def __call__(self, x: torch.Tensor, nx: Numerics,
                 rope: InverseRope | None = None) -> torch.Tensor:
        """x [T, G, in] → [T, G·out] in nx's activation dtype, with no fp8 activation point
        (the vendor runs wo_a unquantized). `rope`: x is first rope.apply(x) — in the EXL3
        input rotation where the groups are EXL3 (their one shape), else before them."""
        T = x.shape[0]
        stack = self._grouped_exl3(x)
        if stack is None:
            if rope is not None and self._target is None:  # (not all EXL3)
                x, rope = rope.apply(x), None
            extra = {} if rope is None else {"rope": rope}
            return torch.cat([lin(x[:, g], nx, act_quant=False, **extra)
                              for g, lin in enumerate(self.linears)], dim=1)
        from strata.kernels.exl3 import exl3_moe_linear
        routing = self._route(T, x.device)
        (y,) = exl3_moe_linear(x, routing.idx, [stack.set], stack.codebook,
                               stack.out_features, nx.act_dtype, routing,
                               target_programs=self._target, rope=rope)
        return y.reshape(T, -1)

    def _grouped_exl3(self, x: torch.Tensor):
        """The stacked groups when one grouped EXL3 launch can run this call, else None."""
        from strata.quant import exl3 as qexl3
        if not qexl3._use_kernels(x):
            return None
        from strata.kernels.exl3 import FUSED_MAX_ROWS
        if x.shape[0] > FUSED_MAX_ROWS or self._target is None:  # (None: not one EXL3 shape)
            return None
        if self._stack is None:
            from strata.kernels.moe import stack_exl3
            self._stack = stack_exl3(self.linears)  # (each group's linear then views its slice)
        return self._stack

    def _route(self, T: int, device: torch.device):
        """Row t's group g is "expert" g."""
        return _fixed_routing(self._routes, T, device, len(self.linears))


def _one_exl3_shape(lins: list[Linear]) -> bool:
    """Whether the linears are EXL3 of one trellis shape, codebook, output width and split
    target, with no bias and no column-slice schedule: exl3_moe_linear's weight sets."""
    from strata.quant import exl3 as qexl3
    first = lins[0]
    return (all(isinstance(lin, qexl3.Exl3Linear) for lin in lins)
            and all(lin.codebook == first.codebook and lin.bias is None
                    and lin.sched_cols is None and lin.trellis.shape == first.trellis.shape
                    and lin.out_features == first.out_features
                    and lin.target_programs == first.target_programs for lin in lins))


def _ragged_sets(lins: list[Linear]) -> list[list[int]]:
    """The linears (indices) that run as one ragged set on the CUDA decode kernel: EXL3
    linears without bias, grouped by input width, K and codebook, two or more to a set."""
    from strata.quant import exl3 as qexl3
    groups: dict[tuple, list[int]] = {}
    for i, lin in enumerate(lins):
        if isinstance(lin, qexl3.Exl3Linear) and lin.bias is None:
            key = (lin.trellis.shape[0], lin.trellis.shape[-1], lin.codebook)
            groups.setdefault(key, []).append(i)
    return [g for g in groups.values() if len(g) > 1]


def _fixed_routing(cache: dict, T: int, device: torch.device, n: int):
    """The Routing of ids [T, n] = 0 … n − 1 in every row (row t's j-th pair is "expert" j),
    over n experts: fixed for a given T, so built once per T (on a graph's warm-up, before
    the capture) and kept in `cache`."""
    key = (T, device)
    if key not in cache:
        from strata.kernels.moe_grouping import Routing
        ids = torch.arange(n, device=device).expand(T, n).contiguous()
        cache[key] = Routing(ids, n)
    return cache[key]


class LinearSet:
    """Linears applied to the same input — the shared expert's w1 and w3, the compressor's
    wkv and wgate, the attention's projections of its input. Called one by one, a decode
    step pays a launch-bound linear each (in EXL3 two kernels). On the CUDA decode kernel,
    EXL3 linears of one input width, K and codebook run a decode-sized call as one ragged
    set — any output widths and dtypes, two launches for all (kernels.exl3.exl3_linear_set);
    elsewhere, linears of one shape run as one grouped launch (exl3_moe_linear with each
    linear a weight set of a single expert). Either way each output is bit for bit the
    linear's own, so the choice changes no bit. Everything else (other formats, the rest of
    a mixed set, prefill-sized calls) runs linear by linear."""

    def __init__(self, linears: list[Linear]) -> None:
        self.linears = list(linears)
        self._one_launch: bool | None = None  # whether they are one shape (checked once)
        self._routes: dict = {}               # (T, device) -> Routing of ids [T, 1] = 0
        # A ragged set's launch aims at TARGET_PROGRAMS programs in all, not a lone linear's
        # count for each weight: its W weights take TARGET_PROGRAMS // W each, in their lone
        # calls too (a weight's split schedule fixes its bits), the smaller share where a
        # weight is in several sets. At TARGET_PROGRAMS each, the attention's wkv ran as 40
        # splits of one k-step whose partials the finish adds (bench/results/performance.md,
        # session 59: the set wq_a + wkv 12.5 → 9.0 µs at 256).
        from strata.kernels.exl3 import TARGET_PROGRAMS
        self._sets = _ragged_sets(self.linears)  # (fixed with the linears: found once)
        for members in self._sets:
            share = max(1, TARGET_PROGRAMS // len(members))
            for i in members:
                lin = self.linears[i]
                lin.target_programs = min(lin.target_programs or share, share)

    def __call__(self, x: torch.Tensor, nx: Numerics,
                 out_dtype=None) -> list[torch.Tensor]:
        """[lin(x, nx, dtype) for each linear]; x [..., in]; out_dtype: one dtype (None:
        nx.act_dtype) or one per linear."""
        dtypes = (list(out_dtype) if isinstance(out_dtype, (list, tuple))
                  else [out_dtype] * len(self.linears))
        dtypes = [d or nx.act_dtype for d in dtypes]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        out: list = [None] * len(self.linears)
        for members in self._ragged_groups(x2):
            from strata.kernels.exl3 import SetWeight, exl3_linear_set
            lins = [self.linears[i] for i in members]
            ys = exl3_linear_set(x2, [
                SetWeight(lin.trellis, lin.suh, lin.svh, lin.out_features, dtypes[i],
                          lin.sched_cols, lin.target_programs)
                for i, lin in zip(members, lins)], lins[0].codebook)
            if ys is None:
                continue
            for i, y in zip(members, ys):
                out[i] = y.reshape(*lead, y.shape[-1])
        if all(y is None for y in out) and len(set(dtypes)) == 1 and self._grouped_exl3(x2):
            return self._grouped(x2, lead, nx, dtypes[0])
        return [y if y is not None else lin(x, nx, dt)
                for y, lin, dt in zip(out, self.linears, dtypes)]

    def _ragged_groups(self, x: torch.Tensor) -> list[list[int]]:
        """The linears (indices) of each ragged set this call can run (_ragged_sets)."""
        from strata.quant import exl3 as qexl3
        if not qexl3._use_kernels(x) or not x.is_cuda:
            return []
        from strata.kernels.exl3_mma import MAX_ROWS
        if x.shape[0] > MAX_ROWS:
            return []
        return self._sets

    def _grouped(self, x2: torch.Tensor, lead, nx: Numerics,
                 out_dtype: torch.dtype) -> list[torch.Tensor]:
        """The linears of one shape as one grouped launch (exl3_moe_linear)."""
        from strata.kernels.exl3 import exl3_moe_linear
        first = self.linears[0]
        routing = self._route(x2.shape[0], x2.device)
        # (views of each linear's tensors as a one-expert stack: nothing copied, and a linear
        # rebound later, e.g. by a pack loader, is read as it is then)
        sets = [(lin.trellis.unsqueeze(0), lin.suh.unsqueeze(0), lin.svh.unsqueeze(0))
                for lin in self.linears]
        ys = exl3_moe_linear(x2, routing.idx, sets, first.codebook, first.out_features,
                             out_dtype, routing,
                             target_programs=first.target_programs)  # (each linear's schedule)
        return [y.reshape(*lead, first.out_features) for y in ys]

    def _grouped_exl3(self, x: torch.Tensor) -> bool:
        """Whether one grouped EXL3 launch of the linears of one shape runs this call."""
        from strata.quant import exl3 as qexl3
        if not qexl3._use_kernels(x):
            return False
        from strata.kernels.exl3 import FUSED_MAX_ROWS
        if x.shape[0] > FUSED_MAX_ROWS:
            return False
        if self._one_launch is None:
            self._one_launch = len(self.linears) > 1 and _one_exl3_shape(self.linears)
        return self._one_launch

    def _route(self, T: int, device: torch.device):
        """Every row's one pair is expert 0."""
        return _fixed_routing(self._routes, T, device, 1)
