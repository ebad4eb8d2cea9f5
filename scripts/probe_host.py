"""Where a graphed plain step's wall time goes on the host, without a profiler (whose hooks
slow every launch): the synthetic V4.1 as scripts/probe_session.py, STEPS plain steps, each
timed with perf_counter around the whole step, its pieces (the forward's host time — in
the loop that runs a step ahead, GraphedForward.launch and the sampler instead of the
forward and the pick —, StaticStep.prepare: inputs assembled and uploaded, each graph part's
replay(): its launch, sampling with the token's read, Engram prefetch), and with
CUDA events from just before the first part's launch to just after the last's (the GPU's
span, including any wait for a launch). Prints the medians (µs) and the GPU idle the step's
host work leaves: wall − GPU span, and a hash of the session's tokens (variants must agree).
ENGRAM=disk (probe_session): the tables on disk, the host's hash and reads timed too.
MODE=oracle+graphs (any DSpark mode of probe_session): a step is a verify window with its
draft and commit — three graph chains and eager work between them; its GPU span is then the
sum of the chains' spans (the eager kernels between them — sampling, rollback — count as
idle, so the idle is an upper bound), and the GPU's gap before each chain (from the end of
the one before), by the pair (draft, picks, window, commit); and the host's own path through
a window — the medians from each of these points to the next: the picks read, the rollback
done, the window's tokens returned, the next window's length chosen (its draft handed over),
its inputs' preparation begun, its first part launched.
With PROFILE=1, then cProfile's table of STEPS more steps (the host's time by function).
One-off diagnostic (GPU): source scripts/device_env.sh && [MODE=…] python scripts/probe_host.py
[STEPS]"""
import cProfile
import hashlib
import os
import pstats
import statistics
import sys
import time

import torch

from probe_session import probe_session
from strata.runtime import graphs, speculative
from strata.runtime.session import Session
from strata.runtime.static_step import StaticStep

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 40
s, one_step = probe_session(os.environ.get("MODE", "plain+graphs"), 2 * steps)
rec: dict[str, list[float]] = {}


def timed(name, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            rec.setdefault(name, []).append((time.perf_counter() - t) * 1e6)
    return wrapper


StaticStep.prepare = timed("prepare", StaticStep.prepare)
Session._pick = timed("sample + read", Session._pick)
graphs.GraphedForward.forward = timed("forward (host)", graphs.GraphedForward.forward)
graphs.GraphedForward.launch = timed("launch (host)", graphs.GraphedForward.launch)
Session._sample_at = timed("sample (ahead)", Session._sample_at)
type(s.model).prefetch_engram = timed("prefetch_engram", type(s.model).prefetch_engram)
if s.model.engram_stores:  # (ENGRAM=disk: the host's hash and the rows' reads)
    from strata.engram_store import EngramStore
    EngramStore.records = timed("engram records", EngramStore.records)
    s.model.hasher.ids = timed("engram hash", s.model.hasher.ids)
events = []
marks: list[tuple[str, float]] = []  # (point, perf_counter) along a DSpark loop's host path


def marked(name, fn, at_end=True):
    def wrapper(*args, **kwargs):
        if not at_end:
            marks.append((name, time.perf_counter()))
        out = fn(*args, **kwargs)
        if at_end:
            marks.append((name, time.perf_counter()))
        return out
    return wrapper


def download_marked(t):
    wait = real_download(t)
    return marked("picks read", wait)


real_download = speculative.download
speculative.download = download_marked
type(s.state).rollback = marked("rollback done", type(s.state).rollback)
speculative.DSparkDecoder._step = marked("tokens returned", speculative.DSparkDecoder._step)
speculative.DSparkDecoder._length = marked("length chosen", speculative.DSparkDecoder._length)
StaticStep.prepare = marked("prepare begun", StaticStep.prepare, at_end=False)


def chain_replay(self, parts=slice(None)):  # (disk tables: a step in ranges, one per Engram layer)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    first = parts.start or 0
    for i, g in enumerate(self.graphs[parts], start=first):
        t = time.perf_counter()
        if i == 0 and any(self is c.graph for c in s.graphed.captured.values()):
            marks.append(("first part launched", t))  # (a step's chain: not the draft's)
        g.replay()
        rec.setdefault(f"launch part {i}", []).append((time.perf_counter() - t) * 1e6)
    end.record()
    events.append((len(walls), start, end, self))  # (the step it belongs to)


graphs.Chain.replay = chain_replay
walls: list[float] = []
for _ in range(steps):
    t = time.perf_counter()
    one_step()
    walls.append((time.perf_counter() - t) * 1e6)
torch.cuda.synchronize()
per_step = [0.0] * steps
for i, a, b, _ in events:
    if i < steps:
        per_step[i] += a.elapsed_time(b) * 1e3
spans = per_step
med = statistics.median
tokens = s.state.tokens[:s.state.position].numpy().tobytes()
print(f"steps {steps}: wall {med(walls):.1f} µs, GPU span (first launch → last kernel) "
      f"{med(spans):.1f} µs, GPU idle per step {med(walls) - med(spans):.1f} µs; tokens' "
      f"sha256 {hashlib.sha256(tokens).hexdigest()[:12]}")
for name, v in rec.items():
    print(f"  {name:16s} {med(v):8.1f} µs host (n={len(v)})")
if s.speculative is not None:  # a window's chains: the GPU's gap before each, by what ran before
    def kind(chain) -> str:
        g = s.graphed
        if g._draft is not None and chain is g._draft[1]:
            return "draft"
        if any(chain is p.graph for p in g._markov.values()):
            return "picks"
        if any(chain is r.graph for r in g._commits.values()):
            return "commit"
        return "window"
    gaps: dict[str, list[float]] = {}
    for (i, _, b, c0), (_, a, _, c1) in zip(events, events[1:]):
        if i < steps:
            gaps.setdefault(f"{kind(c0)} → {kind(c1)}", []).append(b.elapsed_time(a) * 1e3)
    for name, v in gaps.items():
        print(f"  gap {name:18s} {med(v):8.1f} µs GPU (n={len(v)})")
    path: dict[str, list[float]] = {}
    for (a, ta), (b, tb) in zip(marks, marks[1:]):
        path.setdefault(f"{a} → {b}", []).append((tb - ta) * 1e6)
    for name, v in path.items():
        if len(v) >= steps // 2:  # (the window's own path; rare orders left out)
            print(f"  host {name:45s} {med(v):8.1f} µs (n={len(v)})")
if os.environ.get("PROFILE"):  # the host's own time by function, over more steps
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        one_step()
    prof.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats(45)
launch = sum(med(v) for k, v in rec.items() if k.startswith("launch"))
print(f"  all launches     {launch:8.1f} µs host; host outside prepare and launches "
      f"{med(walls) - launch - med(rec['prepare']):.1f} µs (incl. waiting for the GPU)")
