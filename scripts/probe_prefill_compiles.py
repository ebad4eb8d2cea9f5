"""Which Triton kernels compile during a long prefill after the benchmark's warm-up.

    TRITON_CACHE_DIR=/tmp/fresh python scripts/probe_prefill_compiles.py [N] [CHUNK] [LAYERS]

On the synthetic V4.1's LAYERS (default probe_session.PROBE_LAYERS): the warm-up
strata.bench.synthetic.bench_prefill runs (ranking.compile_split, then a prefill of the same
chunk forms), then two timed decoder-skipping prefills of N tokens (default 131,072) in
chunks of CHUNK (4,096); every 8 chunks, the kernels that entered Triton's cache directory
since the last look (a fresh directory: every compile lands there) and the time so far. Run 0
slower than run 1 by more than the spread means compiles in the timed run.
"""
from __future__ import annotations

import glob
import json
import os
import sys
import time

import torch

from strata.bench.synthetic import build_synthetic, parse_layers, prefill_warmup_length
from strata.config import v41_flash_config
from strata.kernels import ranking
from strata.runtime.session import Session

from probe_session import PROBE_LAYERS


def compiled(cache: str) -> dict[str, str]:
    out = {}
    for f in glob.glob(f"{cache}/*/*.json"):
        if "__grp__" not in f:
            with open(f) as fh:
                out[os.path.dirname(f)] = json.load(fh).get("name", "?")
    return out


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 131072
    chunk = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    cache = os.environ.get("TRITON_CACHE_DIR")
    if not cache:
        sys.exit("set TRITON_CACHE_DIR to a fresh directory")
    cfg = v41_flash_config()
    layers = sys.argv[3] if len(sys.argv) > 3 else PROBE_LAYERS
    model, _ = build_synthetic(cfg, "cuda:0", layers=parse_layers(layers, 40),
                               fmt="exl3", seed=0)
    prompt = torch.randint(3, 100_000, (n,), generator=torch.Generator().manual_seed(n))
    warm = prefill_warmup_length(n, chunk, model.prefill_reach)
    ranking.compile_split(torch.device("cuda:0"))
    Session(model, warm + 8, prefill_chunk=chunk, decoder_skip=True).prefill(prompt[:warm])
    torch.cuda.synchronize()
    seen = compiled(cache)
    print(f"warm-up: {warm} tokens, {len(seen)} kernels compiled", flush=True)
    for run in range(2):
        s = Session(model, n + 8, prefill_chunk=chunk, decoder_skip=True)
        t0 = time.perf_counter()
        for c, i in enumerate(range(0, n, chunk)):
            s.prefill(prompt[i:i + chunk], rows_after=n - min(i + chunk, n))
            if c % 8 == 7:
                torch.cuda.synchronize()
                now = compiled(cache)
                new = [v for k, v in now.items() if k not in seen]
                print(f"run {run} at {i + chunk}: {time.perf_counter() - t0:.2f} s, "
                      f"{len(new)} compiled: {new}", flush=True)
                seen = now
        torch.cuda.synchronize()
        print(f"run {run}: {n / (time.perf_counter() - t0):.0f} tok/s", flush=True)
        del s


if __name__ == "__main__":
    main()
