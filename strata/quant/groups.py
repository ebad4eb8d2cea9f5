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

    def __call__(self, x: torch.Tensor, nx: Numerics) -> torch.Tensor:
        """x [T, G, in] → [T, G·out] in nx's activation dtype, with no fp8 activation point
        (the vendor runs wo_a unquantized)."""
        T = x.shape[0]
        stack = self._grouped_exl3(x)
        if stack is None:
            return torch.cat([lin(x[:, g], nx, act_quant=False)
                              for g, lin in enumerate(self.linears)], dim=1)
        from strata.kernels.exl3 import exl3_moe_linear
        routing = self._route(T, x.device)
        (y,) = exl3_moe_linear(x, routing.idx, [stack.set], stack.codebook,
                               stack.out_features, nx.act_dtype, routing,
                               target_programs=self._target)
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
    """Linears of one shape applied to the same input, e.g. the shared expert's w1 and w3.
    Called one by one a decode step pays two launch-bound linears (in EXL3 two kernels each);
    EXL3 linears of one shape and codebook run a decode-sized call as one grouped launch —
    exl3_moe_linear with each linear a weight set of a single expert, one rotate_in for all
    of them — whose outputs are bit for bit each linear's own (its contract), so the choice
    changes no bit. Anything else, and prefill-sized calls, run each linear."""

    def __init__(self, linears: list[Linear]) -> None:
        self.linears = list(linears)
        self._one_launch: bool | None = None  # whether the linears qualify (checked once)
        self._routes: dict = {}               # (T, device) -> Routing of ids [T, 1] = 0

    def __call__(self, x: torch.Tensor, nx: Numerics,
                 out_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """[lin(x, nx, out_dtype) for each linear]; x [..., in]."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if not self._grouped_exl3(x2):
            return [lin(x, nx, out_dtype) for lin in self.linears]
        from strata.kernels.exl3 import exl3_moe_linear
        first = self.linears[0]
        routing = self._route(x2.shape[0], x.device)
        # (views of each linear's tensors as a one-expert stack: nothing copied, and a linear
        # rebound later, e.g. by a pack loader, is read as it is then)
        sets = [(lin.trellis.unsqueeze(0), lin.suh.unsqueeze(0), lin.svh.unsqueeze(0))
                for lin in self.linears]
        ys = exl3_moe_linear(x2, routing.idx, sets, first.codebook, first.out_features,
                             out_dtype or nx.act_dtype, routing,
                             target_programs=first.target_programs)  # (each linear's schedule)
        return [y.reshape(*lead, first.out_features) for y in ys]

    def _grouped_exl3(self, x: torch.Tensor) -> bool:
        """Whether one grouped EXL3 launch runs this call."""
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
