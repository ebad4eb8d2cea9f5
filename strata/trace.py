"""Named scopes around the parts of a forward (attention, MoE, mHC, …) for the decode-step
breakdown (`strata bench synthetic --breakdown`, strata/bench/breakdown.py).

Off by default: `scope(name)` is then one shared no-op context manager, so the model code
pays a function call per scope and nothing else. When on, each scope is a
torch.profiler.record_function range, which a profiler run attributes kernels to.
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


def scope(name: str):
    """A context manager marking `name` (one of SCOPES) while tracing is on."""
    if not _ON:
        return _NULL
    return torch.profiler.record_function("strata." + name)
