"""Launch Triton kernels on the GPU their tensors live on.

Triton launches on the *current* CUDA device and its current stream, whatever device the
arguments are on. A model on cuda:1 in a process whose current device is cuda:0 (a server
started with --device cuda:1, or rank 0 of a group whose first device is cuda:1) would launch
its kernels on cuda:0 — an error at best. Every public entry point of strata.kernels that
launches a kernel is wrapped in `on_tensor_device`.
"""
from __future__ import annotations

import functools

import torch


def on_tensor_device(fn):
    """Run fn with the current CUDA device set to that of its first tensor argument (no-op
    when it already is, or for CPU tensors)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        for a in args:
            if isinstance(a, torch.Tensor):
                if a.is_cuda and a.device.index != torch.cuda.current_device():
                    with torch.cuda.device(a.device):
                        return fn(*args, **kwargs)
                break
        return fn(*args, **kwargs)
    return wrapper
