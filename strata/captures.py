"""What a CUDA graph must keep alive beyond the tensors its kernels were handed.

A captured kernel holds raw device addresses. Tensors passed to it live on in the capturing
code's objects (the regions, the state, the weights); but some kernels read a device table
from a cache (kernels/exl3.py's ragged-set plans: the addresses of each weight's pieces), and
a cache may drop an entry while a graph that read it still replays — the freed table's memory,
reused, then sends the replay to arbitrary addresses (seen on the H200: an illegal-address
fault in a later session's DSpark commit graph once the plan cache overflowed).

`hold(obj)` ties such an object to the graph being captured: runtime/graphs.py captures
inside `holding(list)` and keeps the list on the graph, so the object lives as long as the
graph does; outside a capture it does nothing.
"""
from __future__ import annotations

from contextlib import contextmanager

_HOLDING: list[list] = []  # the lists of the captures in progress (innermost last)


@contextmanager
def holding(into: list):
    """Inside the block, `hold` appends to `into`."""
    _HOLDING.append(into)
    try:
        yield into
    finally:
        _HOLDING.pop()


def hold(obj) -> None:
    """Keep `obj` alive with the graph being captured (no-op when none is)."""
    if _HOLDING:
        _HOLDING[-1].append(obj)
