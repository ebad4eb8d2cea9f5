"""Two independent pieces of a forward at once on a GPU: `both(first, second, device)`.

A decode step is a chain of small kernels, most of them latency-bound on a few SMs; where two
pieces of a layer do not depend on each other (a MoE's shared expert and its routed experts),
running the shorter on a side stream lets the GPU work on both at once. The same kernels
run on the same inputs, so every bit is as in order; only the time changes. It works the
same inside a CUDA-graph capture (the side stream forks from the capturing stream and joins
it again: two branches of the graph) and eagerly.

Memory: the side stream waits for the current stream before its piece starts, and the
current stream waits for the side stream before anything after `both` runs, so a tensor made
on one and used on the other is never reused while still in use (the side stream runs
nothing outside `both`). A kernel with scratch shared between calls keeps one per stream
(`on_side`: strata.kernels.exl3's arrival counters).

One side stream per device. On other devices, or with ENABLED False (environment
STRATA_STREAMS=0, for A/B measurements), `both` runs first then second on the current
stream.
"""
from __future__ import annotations

import os
from typing import Callable, TypeVar

import torch

ENABLED = os.environ.get("STRATA_STREAMS", "1") != "0"

A = TypeVar("A")
B = TypeVar("B")

_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's side stream (made once: graphs captured on it keep their branch)."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    s = _SIDE.get(device)
    if s is None:
        s = _SIDE[device] = torch.cuda.Stream(device)
    return s


def on_side(device: torch.device) -> bool:
    """Whether kernels launched now on `device` go to its side stream."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    s = _SIDE.get(device if device.index is not None
                  else torch.device("cuda", torch.cuda.current_device()))
    return s is not None and torch.cuda.current_stream(device) == s


def both(first: Callable[[], A], second: Callable[[], B],
         device: torch.device) -> tuple[A, B]:
    """(first(), second()); on a CUDA device first's kernels run on the side stream while
    second's run on the current one, and the current stream continues once both are done.
    Neither may read what the other writes."""
    if not ENABLED or device.type != "cuda" or on_side(device):
        return first(), second()
    main = torch.cuda.current_stream(device)
    side = side_stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        a = first()
    b = second()
    main.wait_stream(side)
    return a, b
