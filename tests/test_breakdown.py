"""The decode-step breakdown (strata/bench/breakdown.py): the model's trace scopes are off by
default (one shared no-op), and a profiled step's time lands in the right parts."""
from __future__ import annotations

import torch

from strata import trace
from strata.bench.breakdown import (_category, format_breakdown, format_by_part, gpu_idle,
                                    gpu_parts, graphed_by_part, step_breakdown)


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


def test_the_nearest_scope_names_a_host_events_part():
    # Stand-in profiler events with the two fields the attribution reads (name, cpu_parent).
    class Evt:
        def __init__(self, name, parent=None):
            self.name, self.cpu_parent = name, parent
    assert _category(Evt("aten::mul", Evt("strata.mhc", Evt("strata.attention")))) == "mhc"
    assert _category(Evt("aten::mm")) == "other"


def test_gpu_kernels_count_for_the_scope_around_their_launch():
    """No CUDA event exists on this CPU: stand-in profiler events with the structure torch's
    profiler gave on an H200 (scripts/probe_profiler_links.py): a GPU kernel's event id is
    its launch's correlation id, and the launch — `cudaLaunchKernel` under a torch op, or
    `cuLaunchKernelEx` straight under a scope for a Triton kernel — has the scopes above it;
    the device timeline's scope spans are not kernels; a graph replay's kernels share one
    `cudaGraphLaunch` outside the model's scopes; NCCL's kernels are communication wherever
    they run (in a graph too), its `nccl:recv …` device spans are annotations."""
    from collections import defaultdict
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def evt(name, id, device=DeviceType.CPU, parent=None, us=0.0, note=False):
        return SimpleNamespace(name=name, id=id, device_type=device, cpu_parent=parent,
                               is_user_annotation=note,
                               time_range=SimpleNamespace(elapsed_us=lambda: us))
    attention, moe, draft = evt("strata.attention", 1), evt("strata.moe", 3), evt("strata.draft", 4)
    mul = evt("aten::mul", 2, parent=attention)
    cpu = [attention, mul, evt("cudaLaunchKernel", 10, parent=mul),
           evt("cuLaunchKernelEx", 17, parent=attention), moe,
           evt("cuLaunchKernelEx", 21, parent=moe), draft,
           evt("cuLaunchKernelEx", 25, parent=evt("strata.moe", 5, parent=draft)),
           evt("cudaLaunchKernelExC", 8, parent=evt("c10d::allreduce_", 7, parent=moe)),
           evt("cudaLaunchKernel", 30, parent=evt("aten::add", 29)),
           evt("cudaGraphLaunch", 40)]
    gpu = [evt("vectorized_elementwise_kernel", 10, DeviceType.CUDA, us=1.0),
           evt("strata.attention", 1, DeviceType.CUDA, us=200.0),  # a span, not a kernel
           evt("_add_one", 17, DeviceType.CUDA, us=2.0),
           evt("_add_one", 21, DeviceType.CUDA, us=4.0),
           evt("_fused_kernel", 25, DeviceType.CUDA, us=8.0),
           evt("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 8, DeviceType.CUDA, us=16.0),
           evt("nccl:all_reduce", 8, DeviceType.CUDA, us=16.0, note=True),
           evt("ncclDevKernel_SendRecv", 40, DeviceType.CUDA, us=512.0),  # in the graph
           evt("elementwise_kernel", 30, DeviceType.CUDA, us=32.0),
           evt("_fused_kernel", 40, DeviceType.CUDA, us=64.0),
           evt("_rms_norm_kernel", 40, DeviceType.CUDA, us=128.0),
           evt("orphan_kernel", 99, DeviceType.CUDA, us=256.0)]
    us, counts = defaultdict(float), defaultdict(int)
    per_kernel = gpu_parts(cpu + gpu, us, counts)
    assert dict(us) == {"attention": 3.0, "moe": 4.0, "draft": 8.0, "communication": 528.0,
                        "other": 32.0, "unattributed": 64.0 + 128.0 + 256.0}
    assert counts["attention"] == 2 and counts["unattributed"] == 3
    assert per_kernel["_add_one"] == [2, 6.0] and per_kernel["_fused_kernel"] == [2, 72.0]
    assert "strata.attention" not in per_kernel and "nccl:all_reduce" not in per_kernel


def test_a_graphed_step_takes_its_parts_from_the_eager_profile():
    """The graphed step's kernels carry no part; the eager step's profile of the same kernels
    does: parts from it, launch gaps = the graphed step's unprofiled wall time minus them."""
    eager = {"steps": 2, "device": "cuda:0", "wall_ms": 100.0, "unprofiled_ms": 70.0,
             "busy_ms": 11.8, "ms": {"moe": 6.0, "attention": 4.0, "mhc": 1.5, "other": 0.3}}
    graphed = {"steps": 2, "device": "cuda:0", "wall_ms": 14.8, "unprofiled_ms": 13.9,
               "busy_ms": 11.7, "ms": {"unattributed": 11.6, "other": 0.1}}
    b = graphed_by_part(eager, graphed)
    assert b["ms"] == eager["ms"] and b["wall_ms"] == 13.9
    assert abs(b["launch_gaps_ms"] - (13.9 - 11.8)) < 1e-9
    text = format_by_part(b)
    assert text.startswith("13.90 ms per graphed step (unprofiled) by part")
    assert "11.80 ms eager, 11.70 graphed" in text
    rows = [line.split()[0] for line in text.splitlines()[1:]]
    assert rows == ["moe", "attention", "mhc", "other", "launch"]  # (largest first, gaps last)


def test_a_graphed_steps_communication_is_its_own():
    """Eager, a collective waits out the other rank's host launches too: the graphed step's
    own NCCL time stands for communication, the other parts still come from the eager one."""
    eager = {"steps": 2, "device": "cuda:0", "wall_ms": 300.0, "busy_ms": 80.0,
             "ms": {"moe": 7.4, "attention": 7.6, "communication": 30.8}}
    graphed = {"steps": 2, "device": "cuda:0", "wall_ms": 24.9, "unprofiled_ms": 24.4,
               "busy_ms": 20.6, "ms": {"unattributed": 19.0, "communication": 1.6}}
    b = graphed_by_part(eager, graphed)
    assert b["ms"] == {"moe": 7.4, "attention": 7.6, "communication": 1.6}
    assert abs(b["launch_gaps_ms"] - (24.4 - 16.6)) < 1e-9


def test_idle_gaps_are_summed_by_what_launched_the_work_around_them():
    """No CUDA event exists on this CPU: stand-in events as in the test above, with start and
    end times (µs). Gaps under 2 µs are launch latency, not counted; overlapping activities
    (early launch) leave no gap; a gap between two kernels of one replay is the graph's own."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def evt(name, id, device=DeviceType.CPU, parent=None, t=(0.0, 0.0)):
        return SimpleNamespace(name=name, id=id, device_type=device, cpu_parent=parent,
                               is_user_annotation=False,
                               time_range=SimpleNamespace(start=t[0], end=t[1]))
    attention, sampling = evt("strata.attention", 1), evt("strata.sampling", 2)
    argmax = evt("aten::argmax", 3, parent=sampling)
    cpu = [attention, sampling, argmax, evt("cuLaunchKernelEx", 10, parent=attention),
           evt("cudaLaunchKernel", 11, parent=argmax), evt("cudaGraphLaunch", 12),
           evt("cudaGraphLaunch", 13)]
    gpu = [evt("_rope_kernel", 10, DeviceType.CUDA, t=(0.0, 5.0)),
           evt("argmax_kernel", 11, DeviceType.CUDA, t=(6.0, 9.0)),      # 1 µs: latency
           evt("exl3_mma_linear", 12, DeviceType.CUDA, t=(109.0, 150.0)),  # 100 µs: host
           evt("_rms_norm_kernel", 12, DeviceType.CUDA, t=(140.0, 160.0)),  # overlaps
           evt("_rotate_in_kernel", 12, DeviceType.CUDA, t=(165.0, 170.0)),  # 5 µs in replay
           evt("exl3_mma_linear", 13, DeviceType.CUDA, t=(270.0, 300.0))]  # 100 µs
    rows = [(r["where"], r["gaps"], round(r["ms"], 6)) for r in gpu_idle(cpu + gpu, 2)]
    assert rows == [("graph replay ← sampling / aten::argmax", 0.5, 0.05),
                    ("graph replay ← graph replay", 0.5, 0.05),
                    ("inside a graph replay", 0.5, 0.0025)]
    b = {"steps": 2, "device": "cuda:0", "wall_ms": 1.0, "ms": {}, "host_top": [],
         "idle_top": gpu_idle(cpu + gpu, 2)}
    assert "graph replay ← sampling / aten::argmax" in format_breakdown(b)
