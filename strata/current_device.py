"""Compute on a tensor's own GPU: make it the *current* CUDA device around the work.

Two things launch on the current device whatever device the data is on: Triton kernels (the
launcher takes the current device and its stream), and — torch 2.11 on the H200 machine — some
torch ops mixing a GPU tensor with a wrapped Python scalar (`torch.ldexp(x, e)` on cuda:1 with
cuda:0 current faulted with an illegal memory access). A model on cuda:1 in a process whose
current device is cuda:0 (a server started with --device cuda:1, a test holding a reference
model on the second GPU) would run such work on the wrong GPU. So the model's entry points
(Model.forward, Model.prefetch_engram, the DSpark head's draft/commit, sampling) and
State.rollback run with their device current — once per call, not per op or kernel launch (the
hot path pays nothing more); code that calls strata.kernels directly on a non-current GPU
must do the same.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

_NULL = contextlib.nullcontext()


def made_current(device: torch.device):
    """A context making `device` the current CUDA device for its body (no-op when it already
    is, or for a non-CUDA device)."""
    if device.type == "cuda" and device.index is not None \
            and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return _NULL


def upload(t: torch.Tensor, device: torch.device,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """A host tensor on `device` (into `out` if given, of its shape), the copy queued behind
    the stream's work: a copy from pageable memory would wait for that work first (a prefill
    chunk's host, for the chunk before it) — so through pinned memory on CUDA."""
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
        return t.to(device, non_blocking=True) if out is None else out.copy_(t, non_blocking=True)
    return t.to(device) if out is None else out.copy_(t)


def download(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A tensor's copy to the host, queued now behind the work its value waits for; returns
    a call that waits for that copy alone (not for work queued after it) and gives the host
    tensor — so the GPU goes on with the next launches while the host waits to read it. A
    host tensor is given as it is."""
    if t.device.type != "cuda":
        return lambda: t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(t.device))

    def wait() -> torch.Tensor:
        copied.synchronize()
        return host
    return wait
