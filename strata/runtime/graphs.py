"""Decode forwards replayed from CUDA graphs: one capture per (rows, logits, entry buckets).

A decode step launches a few thousand small kernels; eagerly, the host's Python and launch
cost is most of the step (bench/results/performance.md). A graph replays the whole region
(runtime/static_step.StaticStep: embedding → layers → head) in one launch. Its ops depend on
the number of rows, the logits mode and, through the indexer's scored-entry count, on the
entry bucket of each indexer ratio at the forward's end (Model.graph_key) — never on the
position within a bucket (strata/graph_check.py) — so one capture serves every step of a
bucket, and a step crossing into a new bucket captures once more.

What a graph cannot replay runs eagerly instead (`Model.forward`): a forward inside a
journal (verify windows: their ring writes must be undoable), a CPU model, and Engram tables
read from disk (the store's host-side cache runs inside the forward).

All of one model's graphs share one memory pool: they replay one at a time on one stream, so
a later capture may reuse what an earlier one freed; what a step returns is copied out of
the pool before the next replay.
"""
from __future__ import annotations

import torch

from strata.current_device import made_current
from strata.errors import StrataError
from strata.model.context import ForwardContext
from strata.runtime.state import State
from strata.runtime.static_step import StaticStep


class GraphedForward:
    def __init__(self, model, state: State) -> None:
        if not hasattr(model, "graph_key"):
            raise StrataError("CUDA graphs run a model on one device for now (not a "
                              f"{type(model).__name__})")
        self.model, self.state = model, state
        self.steps: dict[tuple, tuple[StaticStep, torch.cuda.CUDAGraph]] = {}
        self.pool = None
        self.captures = self.replays = 0  # (counts, for tests and benchmarks)

    def usable(self) -> bool:
        m = self.model
        return (m.device.type == "cuda" and not m.engram_stores
                and not m.numerics.vendor_stale_index_k and self.state.journal is None)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, logits: str = "last") -> tuple[torch.Tensor,
                                                                          ForwardContext]:
        """Model.forward(tokens, state, logits), from a graph where one can run: the same
        logits bit for bit, and the state advanced the same way. Returns (logits, the step's
        context — its DSpark taps valid until the next call)."""
        model, state = self.model, self.state
        if not self.usable():
            return model.forward(tokens, state, logits=logits)
        T = tokens.numel()
        key = (T, logits) + model.graph_key(state.position, T)
        with made_current(model.device):
            if key not in self.steps:
                step, graph, ctx = self._capture(tokens, logits)  # (checks the arguments)
                self.steps[key] = step, graph
            else:
                step, graph = self.steps[key]
                ctx = step.prepare(tokens)  # (checks the arguments)
                graph.replay()
                self.replays += 1
            out = step.logits.clone()
            step.finish(ctx)
        return out, step.ctx

    def _capture(self, tokens: torch.Tensor, logits: str):
        """Warm up on a side stream (Triton compiles, lazily built tables are made outside
        the graph's pool), capture, and replay once: the step's results are computed by the
        replay (a capture records kernels without running them). The warm-up's writes to the
        state are those of the same step, which the replay makes again."""
        step = StaticStep(self.model, self.state, tokens.numel(), logits)
        ctx = step.prepare(tokens)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step.run()
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            step.run()
        graph.replay()
        self.captures += 1
        return step, graph, ctx
