"""The grouped EXL3 MoE linears at a prefill chunk's size (4,096 tokens × 6 of 384 experts,
random routing; V4.1's expert shapes at the synthetic mix: gate + up K 2.5 mul1, down K 3
3inst), with the split loop's expert tiles of 64 and 128 pairs (exl3.MOE_LOOP_BLOCK_M), each
with and without the register cap: ms per call (CUDA events, median of 5 after a warm-up) and
whether they all give the same bits. Session 15's prefill profile put 39 % of a chunk in
these calls.
On the device: source scripts/device_env.sh && python scripts/probe_moe_prefill.py"""
import json
import os

import torch

import strata.kernels.exl3 as X

dev = "cuda"
E, T, k, D, I = 384, 4096, 6, 5120, 2304
g = torch.Generator(device=dev).manual_seed(0)


def stack(kin: int, nout: int, K: float):
    L = int(16 * K) if K == int(K) else int(16 * (K - 0.5)) + 8
    tr = torch.randint(-2**15, 2**15, (E, kin // 16, nout // 16, L), device=dev, generator=g,
                       dtype=torch.int32).to(torch.int16)
    suh = (torch.randn(E, kin, device=dev, generator=g) / kin ** 0.5).half()
    svh = (torch.randn(E, nout, device=dev, generator=g) * 0.05).half()
    return tr, suh, svh


def ms(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


w1, w3, w2 = stack(D, I, 2.5), stack(D, I, 2.5), stack(I, D, 3)
idx = torch.stack([torch.randperm(E, device=dev, generator=g)[:k] for _ in range(T)])
x = torch.randn(T, D, device=dev, generator=g).bfloat16()
a = torch.randn(T, k, I, device=dev, generator=g).bfloat16()
counts = torch.bincount(idx.reshape(-1), minlength=E)
out = {"pairs_per_expert": {"mean": float(counts.float().mean()), "max": int(counts.max()),
                            "min": int(counts.min())}}
print(out, flush=True)
results = {}
cap = X.FUSED_MAX_REGISTERS
for tile, regs in ((64, cap), (64, 0), (128, cap), (128, 0)):
    # (regs 0: no register cap — the cap is chosen for decode's occupancy; compiled here the
    # split-loop kernel spills under it)
    X.MOE_LOOP_BLOCK_M, X.FUSED_MAX_REGISTERS = tile, regs
    up = lambda: X.exl3_moe_linear(x, idx, [w1, w3], "mul1", I, torch.bfloat16)
    down = lambda: X.exl3_moe_linear(a, idx, [w2], "3inst", D, torch.bfloat16)
    name = f"tile{tile} cap{regs}"
    results[name] = up() + down()
    out[f"{name} gate+up ms"] = ms(up)
    out[f"{name} down ms"] = ms(down)
    print(name, out[f"{name} gate+up ms"], out[f"{name} down ms"], flush=True)
X.MOE_LOOP_BLOCK_M, X.FUSED_MAX_REGISTERS = 64, cap
first = next(iter(results.values()))
same = all(torch.equal(p, q) for r in results.values() for p, q in zip(first, r))
out["every variant bit-identical"] = same
print("bit-identical:", same, flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_moe_prefill.json"), "w"),
          indent=1)
