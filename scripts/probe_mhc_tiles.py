"""mHC's mix + coefficients (kernels/mhc.hc_mixed_coeffs, the model's path) for chunk and
row-block sizes, timed by CUDA-graph replay over 16 weight sets each (past L2, as a decode
step's layers are): one decode row, a 6-row window, a 4,096-row prefill chunk. Session 15
moved hc_mix's products to tensor cores; its chunking (MIX_CHUNK: more chunks, more programs
for a decode row but more partials for hc_coeffs to add) was tuned in session 9 for fp32
FMAs. µs per call; JSON to $OUT. (Other chunkings sum in another order: other bits, not a
correctness issue — the partition is K's alone.)
On the device: source scripts/device_env.sh && python scripts/probe_mhc_tiles.py
(session 16: ROWS=16,32 CHUNKS=256 — session 15's run had T = 1 and part of 6 within its
limit)"""
import itertools
import json
import os

import torch

from strata.bench.kernels import replay_us
from strata.kernels import mhc

dev = "cuda"
out = {}
g = torch.Generator(device=dev).manual_seed(0)
H, D, N = 4, 5120, 24


defaults = mhc.MIX_ROWS, mhc.MIX_CHUNK
# (TS / ROWS / CHUNKS in the environment: a subset, e.g. ROWS=16,32 CHUNKS=256)
env = lambda name, default: [int(v) for v in os.environ.get(name, default).split(",")]
for T in env("TS", "1,6,4096"):
    sets = []
    for _ in range(16 if T < 100 else 2):
        fn = torch.randn(N, H * D, device=dev, generator=g) * (H * D) ** -0.5
        h = (torch.randn(T, H, D, device=dev, generator=g) * 3).bfloat16()
        sets.append((h, fn))
    scale = torch.ones(3, device=dev)
    base = torch.zeros(N, device=dev)
    for rows, chunk in itertools.product(env("ROWS", "16,32,64"),
                                         env("CHUNKS", "256,512,1024,2048")):
        mhc.MIX_ROWS, mhc.MIX_CHUNK = rows, chunk
        try:
            us = replay_us([lambda h=h, fn=fn: mhc.hc_mixed_coeffs(h, fn, scale, base, H, 1e-6,
                                                                      1e-6, 20)
                             for h, fn in sets])
            out[f"T{T} rows{rows} chunk{chunk}"] = us
            print(f"T{T:5d} rows {rows:3d} chunk {chunk:5d}  {us:9.2f} us", flush=True)
        except Exception as e:  # a configuration Triton cannot lower
            print(f"T{T} rows {rows} chunk {chunk} failed: {e!r}"[:300], flush=True)
    mhc.MIX_ROWS, mhc.MIX_CHUNK = defaults
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_mhc.json"), "w"), indent=1)
