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

# Every scope name the model and runtime use, in report order (the breakdown's categories).
SCOPES = ("embed", "engram", "mhc", "attention", "moe", "head", "draft", "sampling")


def enable(on: bool) -> None:
    global _ON
    _ON = on


def enabled() -> bool:
    return _ON


_STACK: list[str] = []


class _Scope:
    def __init__(self, name: str) -> None:
        self.name = name
        self.range = torch.profiler.record_function("strata." + name)

    def __enter__(self) -> "_Scope":
        _STACK.append(self.name)
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


def current() -> str | None:
    """The innermost open scope (tracing on), else None."""
    return _STACK[-1] if _STACK else None
