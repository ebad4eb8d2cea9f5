"""Can a forward be captured in a CUDA graph? A graph replays exactly the kernels it captured —
the same ops, shapes and scalar arguments — so two decode steps at different positions may
differ only in the *values* held by device tensors. `op_signature(fn)` records every ATen op a
call runs (its tensor shapes and dtypes, its other arguments) with the trace scope it ran in
(strata/trace.py) and its instance ("attention#2": the third attention entered);
`differing_scopes(a, b)` names the scopes whose op sequences differ, with the first difference
in each, by scope or by instance. On CPU the same Python runs as on a GPU, so this is checked
without one (tests/test_graph_check.py); Triton launches are not ATen ops and are not seen.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from strata import trace


def _describe(a):
    if isinstance(a, torch.Tensor):
        return ("tensor", tuple(a.shape), str(a.dtype))
    if isinstance(a, (list, tuple)):
        return tuple(_describe(x) for x in a)
    if isinstance(a, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(a)
    if a is None or isinstance(a, (bool, int, float, str, complex)):
        return a
    return type(a).__name__


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "profiler":  # the scopes' own record_function ops
            return func(*args, **kwargs)
        self.ops.append((trace.current(instance=True) or "other", str(func),
                         (_describe(args), tuple(sorted((k, _describe(v))
                                                        for k, v in kwargs.items())))))
        return func(*args, **kwargs)


def op_signature(fn: Callable[[], object]) -> list[tuple[str, str, tuple]]:
    """(scope instance, op, arguments described) for every ATen op `fn()` runs, in order."""
    was = trace.enabled()
    trace.enable(True)
    rec = _Recorder()
    try:
        with rec:
            fn()
    finally:
        trace.enable(was)
    return rec.ops


def differing_scopes(a: list, b: list, by_instance: bool = False) -> dict[str, str]:
    """Scope (or scope instance) → the first difference between the two signatures' ops in
    it."""
    per_a: dict[str, list] = defaultdict(list)
    per_b: dict[str, list] = defaultdict(list)
    for sig, per in ((a, per_a), (b, per_b)):
        for scope, op, args in sig:
            per[scope if by_instance else scope.split("#", 1)[0]].append((op, args))
    out = {}
    for scope in sorted(set(per_a) | set(per_b)):
        x, y = per_a.get(scope, []), per_b.get(scope, [])
        if x == y:
            continue
        i = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        first = (f"op {i}: {x[i][0]} {x[i][1]!r:.200} vs {y[i][0]} {y[i][1]!r:.200}"
                 if i < min(len(x), len(y)) else f"{len(x)} vs {len(y)} ops")
        out[scope] = first
    return out
