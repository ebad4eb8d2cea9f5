"""Where the host spends a graphed DSpark window's GPU idle time: the synthetic V4.1 (half the
layers, as scripts/device_probes.sh), oracle drafts, CUDA graphs; two windows profiled with
Python stacks, then for every device idle gap of at least MIN_US the Python functions that ran
inside it on the host (their time clipped to the gap), summed over the gaps by function
(innermost strata frames). Prints the table and writes the chrome trace to $OUT (gzip).
One-off diagnostic (GPU): source scripts/device_env.sh && python scripts/probe_window_host.py
[mode: oracle+graphs (default) | plain+graphs]"""
import os
import sys
from collections import defaultdict


from probe_session import probe_session, traced

MIN_US = 20.0
mode = sys.argv[1] if len(sys.argv) > 1 else "oracle+graphs"
out_dir = os.environ.get("OUT", "/tmp")
s, one_step = probe_session(mode, 2)
events = traced(one_step, 2, os.path.join(out_dir, f"trace_{mode.replace('+', '_')}.json"),
                stacks=True, keep=True)

dev = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
             if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
gaps, end = [], dev[0][1]
for a, b in dev[1:]:
    if a - end >= MIN_US:
        gaps.append((end, a))
    end = max(end, b)
py = [e for e in events if e.get("ph") == "X" and e.get("cat") == "python_function"]
ops = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime",
                                                                      "cuda_driver")]
print(f"{mode}: {len(gaps)} idle gaps ≥ {MIN_US} µs, {sum(b - a for a, b in gaps):.0f} µs in "
      f"2 steps; device busy from {dev[0][0]:.0f} to {end:.0f} ({end - dev[0][0]:.0f} µs)")


def inside(evs, a, b):
    """(name, µs clipped to [a, b]) of events overlapping the gap."""
    for e in evs:
        s0, s1 = e["ts"], e["ts"] + e["dur"]
        if s1 > a and s0 < b:
            yield e["name"], min(s1, b) - max(s0, a)


for a, b in gaps:
    print(f"\n gap {b - a:7.1f} µs at {a - dev[0][0]:9.1f}")
    # the strata / torch functions that overlap it, longest first (a caller includes its
    # callees: read it as a call tree flattened)
    by = defaultdict(float)
    for name, us in inside(py, a, b):
        if "strata/" in name or "torch/" in name and "profiler" not in name:
            by[name] += us
    for name, us in sorted(by.items(), key=lambda kv: -kv[1])[:25]:
        print(f"   {us:7.1f}  {name[-90:]}")
    by = defaultdict(float)
    for name, us in inside(ops, a, b):
        by[name] += us
    print("   ops: " + ", ".join(f"{n} {u:.0f}" for n, u in
                                sorted(by.items(), key=lambda kv: -kv[1])[:8]))
