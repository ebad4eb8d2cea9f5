"""A layer's independent chains of kernels on side streams, joined before their results are used.

A decode step's kernels are small and latency-bound: issued one after another on one stream,
most of the GPU idles through each. Where a layer has independent chains — attention's query
projection beside its key/value projection and the compressor's update; the MoE's shared expert
beside the routing and the routed experts — `parallel` issues all but the first on side streams
(lanes 1, 2, …) after a fork from the current stream and joins them back before returning, so
their kernels run side by side. Captured in a CUDA graph, the fork and the join are edges: the
replay runs the chains as parallel branches.

Bits: each kernel computes what it computed on one stream, in the same order within its chain;
only independent work overlaps. Kernels that keep device-wide scratch between launches (the
EXL3 arrival counters) keep one per lane (`lane()`).

Memory: strictly fork–join. A block a side stream allocated and Python freed goes back to that
stream's pool, and the stream's next work starts after a later fork, behind everything the main
stream did with the block; the main stream's own blocks outlive the join. What the chains share
must exist before the fork (a lazily built table made inside one chain and read by another
would race): callers build those first.

`ENABLED` (environment STRATA_BRANCHES=1): an A/B switch until measured on the device.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Callable

import torch

ENABLED = os.environ.get("STRATA_BRANCHES", "0") == "1"
LANES = 3  # the current stream's chain and up to two side chains

_LANE = contextvars.ContextVar("strata_branch_lane", default=0)
_STREAMS: dict = {}  # (device index, lane) → side stream, made on first use (an eager warm-up)


def lane() -> int:
    """The chain the code runs in: 0 on the current stream, i on side lane i."""
    return _LANE.get()


def active(device: torch.device) -> bool:
    return ENABLED and device.type == "cuda" and lane() == 0


def _stream(device: torch.device, i: int) -> torch.cuda.Stream:
    key = (device.index, i)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device=device)
    return _STREAMS[key]


@contextlib.contextmanager
def _on_lane(i: int, stream: torch.cuda.Stream):
    token = _LANE.set(i)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        _LANE.reset(token)


def parallel(device: torch.device, *chains: Callable[[], object]) -> list:
    """[chain() for chain in chains], the first on the current stream, the others on side
    lanes 1, 2, … of `device` (where active: else all in order on the current stream), all
    joined into the current stream before this returns."""
    if len(chains) > LANES:
        raise ValueError(f"branches.parallel: {len(chains)} chains, at most {LANES}")
    if not active(device) or len(chains) == 1:
        return [chain() for chain in chains]
    main = torch.cuda.current_stream(device)
    sides = [_stream(device, i) for i in range(1, len(chains))]
    for s in sides:
        s.wait_stream(main)  # the fork: each side chain starts after what main issued so far
    out: list = [None] * len(chains)
    for i, (chain, s) in enumerate(zip(chains[1:], sides), start=1):
        with _on_lane(i, s):
            out[i] = chain()
    out[0] = chains[0]()
    for s in sides:
        main.wait_stream(s)  # the join
    return out
