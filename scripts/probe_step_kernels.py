"""A graphed step's kernels in the order the GPU ran them: the synthetic V4.1 (its layers as
scripts/probe_session.py sets them), one plain step (or, with `oracle`, one verify window and
its draft) profiled without Python stacks. Writes every kernel — start offset, duration, the gap
before it, its real time (µs) and its stream — to $OUT/step_kernels_<mode>.txt, and prints a
summary: kernels by name with their count, summed real time (a kernel launched early waits
inside its duration for its predecessor: its real time starts when that one ends) and summed
gap before them (a kernel that cannot launch early after its predecessor shows a larger gap).
One-off diagnostic (GPU): source scripts/device_env.sh && python
scripts/probe_step_kernels.py [plain|oracle]"""
import os
import sys
from collections import defaultdict


from probe_session import probe_session, traced

mode = sys.argv[1] if len(sys.argv) > 1 else "plain"
out_dir = os.environ.get("OUT", "/tmp")
s, one_step = probe_session(mode + "+graphs", 1)
events = traced(one_step, 1, os.path.join(out_dir, f"trace_{mode}.json"))
dev = sorted((e["ts"], e.get("dur", 0), e["name"], e.get("args", {}).get("stream", "?"))
             for e in events
             if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
# A kernel launched early starts before its predecessor ends and waits for it: its own time
# ("real") runs from the later of its start and the end of everything before it to its own
# end — with a side stream (strata.streams), time two kernels share counts once, for the one
# that ends later; the reals sum to the time the GPU was busy.
t0, end = dev[0][0], dev[0][0]
by = defaultdict(lambda: [0, 0.0, 0.0, 0.0])  # count, duration, gap before, real
with open(os.path.join(out_dir, f"step_kernels_{mode}.txt"), "w") as f:
    f.write(f"{'start µs':>10s} {'gap µs':>8s} {'dur µs':>8s} {'real µs':>8s} {'stream':>6s}"
            f"  kernel\n")
    for ts, dur, name, stream in dev:
        gap = max(0.0, ts - end)
        real = max(0.0, ts + dur - max(ts, end))
        short = name[:90]
        f.write(f"{ts - t0:10.1f} {gap:8.2f} {dur:8.2f} {real:8.2f} {stream!s:>6s}  {short}\n")
        b = by[short[:60]]
        b[0] += 1
        b[1] += dur
        b[2] += gap
        b[3] += real
        end = max(end, ts + dur)
total_gap = sum(b[2] for b in by.values())
print(f"{mode}: {len(dev)} kernels, span {end - t0:.1f} µs, real time "
      f"{sum(b[3] for b in by.values()):.1f} µs, gaps {total_gap:.1f} µs")
print(f"{'kernel':60s} {'count':>6s} {'real µs':>9s} {'gap µs':>9s} {'real/launch':>11s}")
for name, (c, d, gp, real) in sorted(by.items(), key=lambda kv: -(kv[1][3] + kv[1][2]))[:45]:
    print(f"{name:60s} {c:6d} {real:9.1f} {gp:9.1f} {real / c:11.2f}")
