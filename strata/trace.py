"""Named scopes around the parts of a forward (attention, MoE, mHC, …) for the decode-step
breakdown (`strata bench synthetic --breakdown`, strata/bench/breakdown.py) and the graph
check (strata/graph_check.py).

Off by default: `scope(name)` is then one shared no-op context manager, so the model code
pays a function call per scope and nothing else. When on, each scope is a
torch.profiler.record_function range, which a profiler run attributes kernels to, and
`current()` names the innermost open scope.
"""
from __future__ import annotations

import contextlib

import torch

_ON = False
_NULL = contextlib.nullcontext()
_STACK: list[str] = []         # open scopes, innermost last ("attention#3")
_ENTERED: dict[str, int] = {}  # times each scope was entered since enable(True)

# Every scope name the model and runtime use, in report order (the breakdown's categories).
SCOPES = ("embed", "engram", "mhc", "attention", "moe", "head", "draft", "sampling")


def enable(on: bool) -> None:
    global _ON
    if on and not _ON:
        _ENTERED.clear()
    _ON = on


def enabled() -> bool:
    return _ON


class _Scope:
    def __init__(self, name: str) -> None:
        self.name = name
        self.range = torch.profiler.record_function("strata." + name)

    def __enter__(self) -> "_Scope":
        n = _ENTERED.get(self.name, 0)
        _ENTERED[self.name] = n + 1
        _STACK.append(f"{self.name}#{n}")
        self.range.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.range.__exit__(*exc)
        _STACK.pop()


def scope(name: str):
    """A context manager marking `name` (one of SCOPES) while tracing is on."""
    if not _ON:
        return _NULL
    return _Scope(name)


def current(instance: bool = False) -> str | None:
    """The innermost open scope (tracing on), else None; `instance`: with the number of times
    that scope had been entered before since tracing started ("attention#0" is the first
    layer's attention in a forward)."""
    if not _STACK:
        return None
    return _STACK[-1] if instance else _STACK[-1].split("#", 1)[0]
