"""The grouped EXL3 MoE linears at a prefill chunk's size (4,096 tokens × 6 of 384 experts,
random routing; V4.1's expert shapes at the synthetic mix: gate + up K 2.5 mul1, down K 3
3inst): the CUDA prefill kernel (exl3_mma.moe_prefill, tiles of PREFILL_TILE_M pairs) against
the Triton split loop (tiles of exl3.MOE_LOOP_BLOCK_M, as session 15 measured: 64 with the
register cap), for tiles of 64–128 pairs and register bounds of 1–2 programs an SM, and the
products on wgmma (session 37; tiles of 96 and 128 pairs on it: session 44) — ms
per call (CUDA events, median of 5 after a warm-up; the rotate_in and, for Triton, the
rotate_out launches included; PROFILE=1: also each kernel's time) and whether they give the
same bits. Session 15's prefill profile put 39 % of a chunk in these calls.
On the device: source scripts/device_env.sh && python scripts/probe_moe_prefill.py"""
import json
import os

import torch

import strata.kernels.exl3 as X
from strata.bench.kernels import event_ms

dev = "cuda"
E, k, D, I = 384, 6, 5120, 2304
T = int(os.environ.get("TOKENS", 4096))  # a prefill chunk's tokens
g = torch.Generator(device=dev).manual_seed(0)


def stack(kin: int, nout: int, K: float):
    L = int(16 * K) if K == int(K) else int(16 * (K - 0.5)) + 8
    tr = torch.randint(-2**15, 2**15, (E, kin // 16, nout // 16, L), device=dev, generator=g,
                       dtype=torch.int32).to(torch.int16)
    suh = (torch.randn(E, kin, device=dev, generator=g) / kin ** 0.5).half()
    svh = (torch.randn(E, nout, device=dev, generator=g) * 0.05).half()
    return tr, suh, svh


w1, w3, w2 = stack(D, I, 2.5), stack(D, I, 2.5), stack(I, D, 3)
idx = torch.stack([torch.randperm(E, device=dev, generator=g)[:k] for _ in range(T)])
x = torch.randn(T, D, device=dev, generator=g).bfloat16()
a = torch.randn(T, k, I, device=dev, generator=g).bfloat16()
counts = torch.bincount(idx.reshape(-1), minlength=E)
# (tiles: what the 64- and 128-pair forms decode each expert's weights for, ⌈pairs / tile⌉)
out = {"pairs_per_expert": {"mean": float(counts.float().mean()), "max": int(counts.max()),
                            "min": int(counts.min())},
       "tiles": {m: int((-(-counts // m)).sum()) for m in (64, 128)}}
print(out, flush=True)
why = X.exl3_mma.why_not(x, 5, X.CODEBOOK_IDS["mul1"], I, torch.bfloat16, None, w1[0],
                         X.split_schedule(D, I)[1], pairs=T * k, prefill=True)
out["cuda prefill kernel applies"] = why or "yes"
print("cuda prefill kernel applies:", why or "yes", flush=True)


def kernels(fn) -> dict:
    """ms per kernel name (the device's own events) over one call."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            by[ev.name[:60]] = by.get(ev.name[:60], 0.0) + ev.device_time / 1000
    return {k: round(v, 3) for k, v in sorted(by.items(), key=lambda kv: -kv[1])[:6]}


results = {}
defaults = (X.exl3_mma.ENABLED, X.exl3_mma.PREFILL_TILE_M, X.exl3_mma.PREFILL_MIN_BLOCKS,
            getattr(X.exl3_mma, "PREFILL_WGMMA", False), getattr(X.exl3_mma, "PREFILL_WG_DEPTH", 1))
# (name, CUDA kernels on, prefill tile, programs an SM, wgmma, tiles decoded before their wgmmas);
# ONLY=substring to run a subset (session 16 also measured tiles of 32 pairs with 2 and 3 programs
# an SM: slower than 64; session 45 tiles of 128 with 4 decoded at a time: no faster than 2)
variants = [("triton split loop", False, 64, 2, False, 1),
            ("cuda prefill tm64 minb2", True, 64, 2, False, 1),
            ("cuda prefill tm96 minb1", True, 96, 1, False, 1),
            ("cuda prefill tm128 minb1", True, 128, 1, False, 1),
            ("cuda prefill tm64 minb2 wgmma wd1", True, 64, 2, True, 1),
            ("cuda prefill tm64 minb2 wgmma wd2", True, 64, 2, True, 2),
            ("cuda prefill tm96 minb1 wgmma wd2", True, 96, 1, True, 2),
            ("cuda prefill tm128 minb1 wgmma wd1", True, 128, 1, True, 1),
            ("cuda prefill tm128 minb1 wgmma wd2", True, 128, 1, True, 2)]
for name, cuda, tm, minb, wg, wd in variants:
    if os.environ.get("ONLY", "") not in name:
        continue
    if wg and not hasattr(X.exl3_mma, "PREFILL_WGMMA"):
        continue  # (a tree from before the wgmma variant)
    if wd > 1 and not hasattr(X.exl3_mma, "PREFILL_WG_DEPTH"):
        continue  # (a tree from before the decode depth)
    X.exl3_mma.ENABLED = cuda
    X.exl3_mma.PREFILL_TILE_M, X.exl3_mma.PREFILL_MIN_BLOCKS = tm, minb
    X.exl3_mma.PREFILL_WGMMA, X.exl3_mma.PREFILL_WG_DEPTH = wg, wd
    up = lambda: X.exl3_moe_linear(x, idx, [w1, w3], "mul1", I, torch.bfloat16)
    down = lambda: X.exl3_moe_linear(a, idx, [w2], "3inst", D, torch.bfloat16)
    results[name] = up() + down()
    out[f"{name} gate+up ms"] = event_ms(up)
    out[f"{name} down ms"] = event_ms(down)
    print(name, out[f"{name} gate+up ms"], out[f"{name} down ms"], flush=True)
    if os.environ.get("PROFILE"):
        out[f"{name} gate+up kernels"] = kernels(up)
        print("  ", out[f"{name} gate+up kernels"], flush=True)
(X.exl3_mma.ENABLED, X.exl3_mma.PREFILL_TILE_M, X.exl3_mma.PREFILL_MIN_BLOCKS,
 X.exl3_mma.PREFILL_WGMMA, X.exl3_mma.PREFILL_WG_DEPTH) = defaults
first = next(iter(results.values()))
same = all(torch.equal(p, q) for r in results.values() for p, q in zip(first, r))
out["every variant bit-identical"] = same
print("bit-identical:", same, flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), f"probe_moe_prefill_{T}.json"),
                    "w"), indent=1)
