"""How long the GPU idles between the phases of a graphed DSpark window, unprofiled: the
synthetic V4.1 (probe_session.PROBE_LAYERS or LAYERS), oracle drafts, CUDA graphs.
CUDA events are recorded on the stream before and after each phase (the draft, the verify
forward, the picks' sampling, the rollback, the draft context's commit), so the time from
one phase's end event to the next phase's start event is the device's idle while the host
turned around (a start event is recorded when the host gets there; the stream is empty by
then when the host had to read a result first). Host times (perf_counter) of each phase's
call are printed beside them. Nothing else is changed: the probe wraps the calls.
One-off diagnostic (GPU): source scripts/device_env.sh && python scripts/probe_window_events.py
[mode: oracle+graphs (default) | oracle:2.9+graphs | plain+graphs] [windows: 16]"""
import statistics
import sys
import time
from collections import defaultdict

import torch

import strata.runtime.speculative as speculative
from probe_session import probe_session
from strata.runtime.graphs import GraphedForward
from strata.runtime.state import State

mode = sys.argv[1] if len(sys.argv) > 1 else "oracle+graphs"
n_windows = int(sys.argv[2]) if len(sys.argv) > 2 else 16
window = not mode.removesuffix("+graphs").startswith("plain")
s, one_step = probe_session(mode, n_windows)

marks: list[tuple[str, torch.cuda.Event, float]] = []  # (label, event, host seconds)
recording = False


def mark(label: str) -> None:
    if recording:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        marks.append((label, e, time.perf_counter()))


def wrapped(owner, name: str, label: str) -> None:
    inner = getattr(owner, name)

    def call(*args, **kwargs):
        mark(label + "<")
        out = inner(*args, **kwargs)
        mark(label + ">")
        return out
    setattr(owner, name, call)


wrapped(GraphedForward, "draft", "draft")
wrapped(GraphedForward, "run", "verify" if window else "step")
wrapped(GraphedForward, "commit_context", "commit")
wrapped(State, "rollback", "rollback")
wrapped(speculative, "sample", "sample")

recording = True
t0 = time.perf_counter()
for _ in range(n_windows):
    one_step()
mark("end")
torch.cuda.synchronize()
wall = time.perf_counter() - t0
recording = False

# Per transition between consecutive marks: device ms (event to event) and host ms.
dev, host = defaultdict(list), defaultdict(list)
for (a, ea, ha), (b, eb, hb) in zip(marks, marks[1:]):
    dev[(a, b)].append(ea.elapsed_time(eb))
    host[(a, b)].append((hb - ha) * 1e3)
print(f"{mode}: {n_windows} {'windows' if window else 'steps'} in {wall * 1e3:.2f} ms "
      f"({wall * 1e3 / n_windows:.3f} ms each); "
      f"{'committed ' + str(s.stats.mean_committed) + ' per window' if window else ''}")
print(f"{'from → to':32s} {'count':>5s} {'device ms (median, sum/step)':>30s} "
      f"{'host ms median':>15s}")
for key in dev:
    d, h = dev[key], host[key]
    print(f"{key[0] + ' → ' + key[1]:32s} {len(d):5d} {statistics.median(d):14.3f} "
          f"{sum(d) / n_windows:14.3f} {statistics.median(h):15.3f}")
