"""The decode-step breakdown (strata/bench/breakdown.py): the model's trace scopes are off by
default (one shared no-op), and a profiled step's time lands in the right parts."""
from __future__ import annotations

import torch

from strata import trace
from strata.bench.breakdown import _category, step_breakdown


def test_scopes_cost_nothing_when_off():
    assert not trace.enabled()
    assert trace.scope("attention") is trace.scope("moe")  # the shared no-op


def test_time_lands_in_the_enclosing_scope_and_drafting_takes_all_inside_it():
    a = torch.randn(256, 256)

    def run():
        with trace.scope("attention"):
            for _ in range(20):
                a @ a
        with trace.scope("draft"):
            with trace.scope("moe"):  # a draft stage's MoE counts as drafting
                for _ in range(10):
                    a @ a
        with trace.scope("moe"):
            with trace.scope("mhc"):  # the nearest scope wins
                a.sum()
    b = step_breakdown(run, 1, torch.device("cpu"), python_run=run)
    ms = b["ms"]
    assert set(ms) == {"attention", "draft", "mhc"}, ms
    assert ms["attention"] > ms["draft"] > ms["mhc"] > 0
    mm = next(r for r in b["host_top"] if r["name"] == "aten::mm")  # 30 matmuls in the step
    assert mm["calls"] == 30 and mm["self_ms"] > 0
    py = {r["name"]: r for r in b["python_top"]}
    assert py["<method 'sum' of 'torch._C.TensorBase' objects>"]["calls"] == 1
    assert any(name.endswith("(run)") for name in py)  # our own function, by file:line
    assert not trace.enabled()  # restored


def test_nccl_kernels_count_as_communication():
    # No CUDA kernel (NCCL or other) runs on this CPU: stand-in profiler events with the two
    # fields the attribution reads (name, cpu_parent).
    class Evt:
        def __init__(self, name, parent=None):
            self.name, self.cpu_parent = name, parent
    op = Evt("c10d::allreduce_", Evt("strata.attention"))
    assert _category(op, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "communication"
    assert _category(op, "triton_fused_kernel") == "attention"
    assert _category(Evt("aten::mm")) == "other"
