"""The indexer's scores (strata.kernels.indexer.index_scores) at a 32K prefill chunk's shape —
4,096 queries × 32 heads × 128 against 8,192 entries, the reference numerics' fp32 queries
against bf16 keys (three bf16 products) and the vendor's 16-bit pairs — for the module's tile
constants (BLOCK_T queries × BLOCK_H heads a tile, BLOCK_N entries, NUM_WARPS): ms a call
(CUDA events, median of 5 after a warm-up), tensor-core TFLOPS (the split counted as its
three products) and whether each variant gives the default's bits. Session 45's chunk profile:
7.4 ms of a 121 ms chunk half at 32K; session 41's: 28 ms of 208 at 128K. (Session 45 also
had each program take 2–16 blocks of entries in turn, its queries' tiles then read from L1:
−5 % fp32, −10 % bf16 at best — not kept.)
Also RoPE at a decode step's shape (one query's 64 heads, in place) at 1 and 8 rows a program,
device time from the profiler. On the device: source scripts/device_env.sh &&
python scripts/probe_index_scores.py"""
import json
import os

import torch

from strata.bench.kernels import event_ms
from strata.kernels import indexer as K
from strata.kernels import rope as R

dev = "cuda"
T, H, D, N = 4096, 32, 128, 8192
g = torch.Generator(device=dev).manual_seed(0)
out = {}


keys = torch.randn(N, D, device=dev, generator=g).bfloat16()
w = torch.randn(T, H, device=dev, generator=g)
visible = (torch.arange(T, device=dev) + 28672 + 1) // 4
defaults = (K.BLOCK_T, K.BLOCK_N, K.NUM_WARPS)
variants = [(2, 128, 4), (2, 64, 4), (2, 256, 8), (4, 128, 8), (4, 64, 4), (2, 128, 8)]
for qdt, products in ((torch.float32, 3), (torch.bfloat16, 1)):
    q = torch.randn(T, H, D, device=dev, generator=g).to(qdt)
    ref = None
    for bt, bn, nw in variants:
        K.BLOCK_T, K.BLOCK_N, K.NUM_WARPS = bt, bn, nw
        name = f"q {str(qdt)[6:]} BLOCK_T {bt} BLOCK_N {bn} warps {nw}"
        try:
            got = K.index_scores(q, keys, w, visible, 0.01)
        except Exception as e:  # (a tile Triton cannot lower: reported, not fatal)
            out[name] = f"failed: {type(e).__name__}: {str(e)[:200]}"
            print(name, out[name], flush=True)
            continue
        ref = got if ref is None else ref
        t = event_ms(lambda: K.index_scores(q, keys, w, visible, 0.01))
        out[name] = {"ms": round(t, 4), "TFLOPS": round(2 * T * H * N * D * products / t / 1e9, 1),
                     "default's bits": bool(torch.equal(got, ref))}
        print(name, out[name], flush=True)
    K.BLOCK_T, K.BLOCK_N, K.NUM_WARPS = defaults

inv = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, device=dev, dtype=torch.float64) / 64))
cos, sin = R.cos_sin(inv, torch.tensor([30000], device=dev))
q1 = torch.randn(1, 64, 512, device=dev, generator=g).bfloat16()
for small, label in ((256, "1 row"), (0, "8 rows")):
    R.SMALL = small
    for _ in range(3):
        R.apply_rope(q1, cos, sin, in_place=True)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(100):
            R.apply_rope(q1, cos, sin, in_place=True)
        torch.cuda.synchronize()
    us = sum(e.device_time for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and "rope" in e.name) / 100
    out[f"rope decode in place, {label} a program, us"] = round(us, 3)
    print(f"rope decode in place, {label} a program: {us:.3f} us", flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_index_scores.json"), "w"),
          indent=1)
