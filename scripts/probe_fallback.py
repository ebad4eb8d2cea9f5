"""What a DSpark session's plain steps cost, and where a random-draft DSpark run's time goes.
The synthetic V4.1 as scripts/probe_session.py (its layers, a 512-token prompt), 96 greedy
tokens a run, 3 runs after a warm-up, each mode's tok/s with capture time subtracted, the
medians of each yield's wall time split by whether a verify window produced it, and the
session's DSpark counters:
  A  a plain session                         B  a DSpark session's plain request (each
  C  B with the draft commits skipped           step's draft windows committed behind it)
     (prices them; its tokens are still        D  DSpark with the synthetic's random head
     plain decoding's)                             (nothing accepted: the fallback's cost)
With PROBE_WINDOWS="2 8": D alone, twice for each SpecConfig.probe_windows value, alternating.
One-off diagnostic (GPU): source scripts/device_env.sh && [PROBE_WINDOWS=…] python
scripts/probe_fallback.py"""
import functools
import os
import statistics
import time

import torch

from strata.bench import decode
from strata.bench.synthetic import build_synthetic, parse_layers
from strata.config import v41_flash_config
from strata.runtime import graphs
from strata.runtime.sampling import SamplingParams
from strata.runtime.speculative import SpecConfig

from probe_session import PROBE_LAYERS

cfg = v41_flash_config()
model, _ = build_synthetic(cfg, "cuda:0", layers=parse_layers(PROBE_LAYERS, cfg.n_layers))
prompt = torch.randint(3, 100_000, (512,), generator=torch.Generator().manual_seed(0)).tolist()
N = 96


def run(mode: str, gen_mode: str, label: str, reps: int = 3) -> None:
    rates = []
    for r in range(reps + 1):
        s = decode.make_session(model, prompt, N, mode, None)
        gen = s.generate(prompt, N, SamplingParams(), stop_ids=frozenset(), mode=gen_mode)
        next(gen)
        captured = s.graphed.capture_s
        torch.cuda.synchronize()
        walls: dict[str, list[float]] = {"window": [], "plain": []}
        t0, n = time.perf_counter(), 0
        while True:
            windows = s.stats.windows if s.stats else 0
            t = time.perf_counter()
            try:
                next(gen)
            except StopIteration:
                break
            n += 1
            kind = "window" if s.stats and s.stats.windows != windows else "plain"
            walls[kind].append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
        if r:  # (the first run warms up)
            rates.append(n / (time.perf_counter() - t0 - (s.graphed.capture_s - captured)))
    st = s.stats
    counters = "" if st is None else (
        f"; windows {st.windows}, plain steps {st.plain_steps}, backoffs {st.backoffs}, "
        f"drafted {st.drafted}, accepted {st.accepted}")
    split = ", ".join(f"{k} {len(v)} yields median {statistics.median(v):.2f} ms"
                      for k, v in walls.items() if v)
    print(f"{label}: {statistics.median(rates):.1f} tok/s (runs "
          f"{', '.join(f'{x:.1f}' for x in rates)}){counters}; {split}", flush=True)


if os.environ.get("PROBE_WINDOWS"):
    make = decode.SpecConfig
    for _ in range(2):
        for pw in map(int, os.environ["PROBE_WINDOWS"].split()):
            decode.SpecConfig = functools.partial(SpecConfig, probe_windows=pw)
            run("dspark+graphs", "dspark", f"D random head, probe_windows {pw}")
    decode.SpecConfig = make
else:
    run("plain+graphs", "plain", "A plain session")
    run("dspark+graphs", "plain", "B DSpark session, plain request")
    commit = graphs.GraphedForward.commit_context
    graphs.GraphedForward.commit_context = lambda self, ctx, rows, start: None
    run("dspark+graphs", "plain", "C B without the commits")
    graphs.GraphedForward.commit_context = commit
    run("dspark+graphs", "dspark", "D random head")
