"""Where a decode step's time goes: `step_breakdown(run, steps, device)` profiles `run()` (which
makes `steps` decode steps) with the model's trace scopes on (strata/trace.py) and sorts the
time into attention, MoE, mHC/norms, Engram, embed, head, DSpark drafting, sampling,
communication (NCCL kernels) and other — then, on CUDA, the launch gaps: wall time minus the
GPU's busy time (Python, launches and host waits the GPU sat idle for).

On CUDA each kernel's GPU time counts for the nearest enclosing scope of the host call that
launched it — the runtime or driver launch (`cudaLaunchKernel` under a torch op,
`cuLaunchKernelEx` for a Triton kernel) carries the kernel's correlation id as its own event
id, and its parent chain holds the scopes (a DSpark stage's attention counts as drafting).
A CUDA graph's kernels are "unattributed" (one `cudaGraphLaunch` for all of them) but for
NCCL's, which are communication by name wherever they run: profile an eager step for the parts,
a graphed one for the gaps and its communication (an NCCL kernel's time includes its wait for
the other rank; eager, that wait takes in the other rank's host launches too). Every kernel is
also listed by name, and the device's idle gaps by what launched the work around them
(`gpu_idle`). On CPU each op's own CPU time counts."""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.autograd import DeviceType

from strata import trace

CATEGORIES = trace.SCOPES + ("communication", "other")


def _category(evt) -> str:
    nearest = None
    e = evt
    while e is not None:
        if e.name.startswith("strata."):
            name = e.name[len("strata."):]
            if name == "draft":
                return "draft"  # whatever runs inside a draft is drafting
            nearest = nearest or name
        e = e.cpu_parent
    return nearest if nearest in trace.SCOPES else "other"


def gpu_parts(events, us: dict[str, float], counts: dict[str, int]) -> dict[str, list[float]]:
    """Add each GPU activity's time (µs) and count to its part in `us` / `counts`, from the
    host call that launched it (see the module doc); return {kernel name: [launches, µs]}.
    The device's timeline also shows annotation spans (our scopes, NCCL's `nccl:recv …`):
    those are not kernels."""
    launches = {e.id: e for e in events
                if e.device_type == DeviceType.CPU and e.name.startswith("cu")}
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for evt in events:
        if evt.device_type != DeviceType.CUDA or evt.is_user_annotation \
                or evt.name.startswith("strata."):
            continue
        launch = launches.get(evt.id)
        if "nccl" in evt.name.lower():
            part = "communication"
        elif launch is None or launch.name == "cudaGraphLaunch":
            part = "unattributed"
        else:
            part = _category(launch)
        t = evt.time_range.elapsed_us()
        us[part] += t
        counts[part] += 1
        row = per_kernel[evt.name]
        row[0] += 1
        row[1] += t
    return per_kernel


def _launcher(launch) -> str:
    """What launched a kernel, for an idle gap's label: the nearest scope and the nearest op
    that is not a runtime or driver call ("graph replay" for a graph's kernels)."""
    if launch is None:
        return "?"
    if launch.name == "cudaGraphLaunch":
        return "graph replay"
    op, scope, e = None, None, launch.cpu_parent
    while e is not None and (op is None or scope is None):
        if e.name.startswith("strata."):
            scope = scope or e.name[len("strata."):]
        elif op is None and not e.name.startswith("cu"):
            op = e.name
        e = e.cpu_parent
    return f"{scope or '-'} / {op or launch.name}"


def gpu_idle(events, n: int, min_us: float = 2.0, top: int = 15) -> list[dict]:
    """The device's idle time (no kernel or copy running, gaps of at least `min_us`), summed by
    what launched the activity after each gap and the one before it (`_launcher`, "next ←
    previous"; within one graph replay: "inside a graph replay"): where the GPU waited for
    the host — a launch, a graph replay after host work, a synchronisation — per step."""
    launches = {e.id: e for e in events
                if e.device_type == DeviceType.CPU and e.name.startswith("cu")}
    acts = sorted((e for e in events if e.device_type == DeviceType.CUDA
                   and not e.is_user_annotation and not e.name.startswith("strata.")),
                  key=lambda e: e.time_range.start)
    idle: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    end, prev = None, None
    for e in acts:
        if end is not None and e.time_range.start - end >= min_us:
            after, before = _launcher(launches.get(e.id)), _launcher(launches.get(prev.id))
            where = ("inside a graph replay" if after == "graph replay" and e.id == prev.id
                     else f"{after} ← {before}")
            row = idle[where]
            row[0] += 1
            row[1] += e.time_range.start - end
        if end is None or e.time_range.end >= end:
            end, prev = e.time_range.end, e
    return [{"where": k, "gaps": c / n, "ms": t / 1e3 / n}
            for k, (c, t) in sorted(idle.items(), key=lambda kv: -kv[1][1])[:top]]


def _timed(run: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _python_top(run: Callable[[], None], n: int, top: int = 20) -> list[dict]:
    """Python functions by own time under cProfile (Triton's launcher, torch's Python layers
    and ours alike), per step."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.runcall(run)
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in pstats.Stats(prof).stats.items():
        where = fn if file == "~" else f"{'/'.join(file.split('/')[-2:])}:{line}({fn})"
        rows.append({"name": where, "calls": nc / n, "self_ms": 1e3 * tt / n,
                     "cum_ms": 1e3 * ct / n})
    return sorted(rows, key=lambda r: -r["self_ms"])[:top]


def step_breakdown(run: Callable[[], None], steps: int, device: torch.device,
                   plain_run: Callable[[], None] | None = None,
                   python_run: Callable[[], None] | None = None) -> dict:
    """Per-step milliseconds by category (see module doc), the wall time per step and, on
    CUDA, the GPU busy time and the launch gaps. `plain_run` / `python_run`: two more runs of
    `steps` steps, timed without any profiler (`unprofiled_ms`) and under cProfile
    (`python_top`: where the host's Python time goes)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    n = max(1, steps)
    extra = {}
    if plain_run is not None:
        extra["unprofiled_ms"] = 1e3 * _timed(plain_run, device) / n
    if python_run is not None:
        extra["python_top"] = _python_top(python_run, n)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    was = trace.enabled()
    trace.enable(True)
    try:
        with profile(activities=activities) as prof:
            wall = _timed(run, device)
    finally:
        trace.enable(was)
    us: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)  # kernels per part (CUDA)
    events = prof.events()
    per_kernel: dict[str, list[float]] = {}
    if cuda:
        per_kernel = gpu_parts(events, us, counts)
    else:
        for evt in events:
            if evt.device_type == DeviceType.CPU and not evt.name.startswith("strata."):
                us[_category(evt)] += evt.self_cpu_time_total
    out = {"steps": steps, "device": str(device), "wall_ms": 1e3 * wall / n,
           "host_top": _host_top(prof, n), **extra}
    if cuda:
        busy = sum(t for _, t in per_kernel.values()) / 1e3 / n
        out.update(busy_ms=busy, launch_gaps_ms=max(0.0, out["wall_ms"] - busy),
                   kernels_per_step=sum(c for c, _ in per_kernel.values()) / n,
                   kernels_per_part={c: counts[c] / n for c in CATEGORIES + ("unattributed",)
                                     if counts.get(c)},
                   kernel_top=[{"name": k, "calls": c / n, "ms": t / 1e3 / n}
                               for k, (c, t) in sorted(per_kernel.items(),
                                                       key=lambda kv: -kv[1][1])[:20]],
                   # by launches: what a graph's node count (its launch cost) is made of
                   kernel_most_launched=[{"name": k, "calls": c / n, "ms": t / 1e3 / n}
                                         for k, (c, t) in sorted(per_kernel.items(),
                                                                 key=lambda kv: -kv[1][0])[:40]],
                   idle_top=gpu_idle(events, n))
    out["ms"] = {c: us[c] / 1e3 / n for c in CATEGORIES + ("unattributed",) if us.get(c)}
    return out


def graphed_by_part(eager: dict, graphed: dict) -> dict:
    """A graphed step's time by part: its kernels are the eager step's (a graph replays the
    same launches), whose profile names each kernel's part, so the parts take the eager
    profile's GPU times — but communication, the graphed profile's own NCCL time (eager, a
    collective also waits out the other rank's host launches); what the graphed step's
    unprofiled wall time leaves over is launch gaps and host waits. Both breakdowns from CUDA
    (step_breakdown with plain_run)."""
    wall = graphed.get("unprofiled_ms", graphed["wall_ms"])
    parts = {k: v for k, v in eager["ms"].items() if k != "communication"}
    if graphed["ms"].get("communication"):
        parts["communication"] = graphed["ms"]["communication"]
    return {"steps": graphed["steps"], "device": graphed["device"],
            "unit": graphed.get("unit", "steps"), "wall_ms": wall, "ms": parts,
            "launch_gaps_ms": max(0.0, wall - sum(parts.values())),
            "busy_ms": {"eager": eager["busy_ms"], "graphed": graphed["busy_ms"]}}


def format_by_part(b: dict) -> str:
    unit = b["unit"].split()[-1].removesuffix("s")
    lines = [f"{b['wall_ms']:.2f} ms per graphed {unit} (unprofiled) by part: each part's GPU "
             f"time from the eager {unit}'s profile (the same kernels: GPU busy "
             f"{b['busy_ms']['eager']:.2f} ms eager, {b['busy_ms']['graphed']:.2f} graphed), "
             f"the rest launch gaps and host waits"]
    parts = sorted(b["ms"].items(), key=lambda kv: -kv[1]) + [("launch gaps",
                                                                b["launch_gaps_ms"])]
    for name, ms in parts:
        lines.append(f"  {name:<14}{ms:>9.3f} ms  {100 * ms / b['wall_ms']:5.1f} %")
    return "\n".join(lines)


def _host_top(prof, n: int, top: int = 15) -> list[dict]:
    """Where the host's time goes: the events with the most own CPU time per step (torch ops,
    CUDA runtime/driver calls such as launches and synchronisations, Python-side scopes)."""
    rows = [{"name": e.key, "calls": e.count / n, "self_ms": e.self_cpu_time_total / 1e3 / n}
            for e in prof.key_averages()]
    return sorted(rows, key=lambda r: -r["self_ms"])[:top]


def format_breakdown(b: dict) -> str:
    total = b["wall_ms"]
    unit = b.get("unit", "steps")  # (or DSpark's verify windows)
    head = (f"decode step breakdown ({b['steps']} {unit} on {b['device']}): {total:.2f} ms per "
            f"{unit.split()[-1].removesuffix('s')}")
    if "busy_ms" in b:
        head += f", {b['kernels_per_step']:.0f} kernels, GPU busy {b['busy_ms']:.2f} ms"
    if "unprofiled_ms" in b:
        head += f" (unprofiled: {b['unprofiled_ms']:.2f} ms)"
    lines = [head]
    parts = sorted(b["ms"].items(), key=lambda kv: -kv[1])
    if "launch_gaps_ms" in b:
        parts.append(("launch gaps", b["launch_gaps_ms"]))
    counts = b.get("kernels_per_part", {})
    for name, ms in parts:
        n = f"  {counts[name]:>7.0f} kernels" if name in counts else ""
        lines.append(f"  {name:<14}{ms:>9.3f} ms  {100 * ms / total:5.1f} %{n}")
    if b.get("kernel_top"):
        lines.append("GPU: kernels by time per step (calls per step), largest first:")
        for r in b["kernel_top"]:
            lines.append(f"  {r['name'][:60]:<60}{r['ms']:>9.3f} ms {r['calls']:>8.1f}")
        lines.append("GPU: kernels by launches per step (time per step), most first:")
        for r in b["kernel_most_launched"]:
            lines.append(f"  {r['name'][:60]:<60}{r['calls']:>8.1f} {r['ms']:>9.3f} ms")
    if b.get("idle_top"):
        lines.append("GPU idle per step by what launched the work after and before each gap "
                     "(scope / op; gaps per step):")
        for r in b["idle_top"]:
            lines.append(f"  {r['where'][:60]:<60}{r['ms']:>9.3f} ms {r['gaps']:>8.1f}")
    lines.append("host: own CPU time per step (calls per step), largest first:")
    for r in b["host_top"]:
        lines.append(f"  {r['name'][:48]:<48}{r['self_ms']:>9.3f} ms {r['calls']:>8.1f}")
    if b.get("python_top"):
        lines.append("host: Python functions by own time per step under cProfile (calls):")
        for r in b["python_top"]:
            lines.append(f"  {r['name'][-60:]:<60}{r['self_ms']:>9.3f} ms {r['calls']:>8.1f}")
    return "\n".join(lines)
