"""The memory-bound kernels of a prefill chunk (4,096 rows, V4.1's shapes) against the copy
rate of the same bytes, measured in the same process: the EXL3 linears' Hadamard steps
(rotate_in: x → fp16 H128(x·suh), rotate_out: fp32 partials → H128(·)·svh) at tiles of
ROT_ROWS 16 (main), 32 and 64 rows a program — the same arithmetic per element, so the same
bits, which the probe checks — and RoPE on the queries and on the attention output. Session
44's chunk profile: rotate_in 5.2 ms, rotate_out 3.0 ms, RoPE 3.3 ms of a 128 ms chunk half.
ms per call: CUDA events, median of 5 after a warm-up; GB/s counts the bytes read and written
once. On the device: source scripts/device_env.sh && python scripts/probe_memory_kernels.py"""
import json
import os

import torch

import strata.kernels.exl3 as X
from strata.bench.kernels import event_ms
from strata.kernels import rope as R

dev = "cuda"
T = 4096
g = torch.Generator(device=dev).manual_seed(0)


out = {}


def report(name, t, nbytes):
    out[name] = {"ms": round(t, 4), "GB/s": round(nbytes / t / 1e6, 1)}
    print(f"{name:50s} {t:8.4f} ms {nbytes / t / 1e6:8.1f} GB/s", flush=True)


# the copy rate: 256 MiB read and written
buf = torch.empty(2**27, dtype=torch.float16, device=dev)
report("copy 256 MiB (torch)", event_ms(lambda: buf.clone()), 2 * buf.numel() * 2)

# (rows, k_in): wq_a / wkv / shared w1 input; wq_b; wo_b; wo_a's 8 groups as one 32,768-row
# input; the routed experts' down input (4,096 × 6 pairs of 2,304)
default_rows = X.ROT_ROWS
for M, k in ((T, 5120), (T, 1280), (T, 8192), (T, 32768), (6 * T, 2304)):
    x = torch.randn(M, k, device=dev, generator=g).bfloat16()
    suh = (torch.randn(k, device=dev, generator=g) / k ** 0.5).half()
    part = torch.randn(1, M, k, device=dev, generator=g)
    ref_in = ref_out = None
    for rows in (16, 32, 64):
        X.ROT_ROWS = rows
        y = X.rotate_in(x, suh)
        z = X.rotate_out(part, suh, out_dtype=torch.bfloat16)
        if ref_in is None:
            ref_in, ref_out = y, z
        out[f"rotate {M}x{k} rows {rows} same bits"] = bool(torch.equal(y, ref_in)
                                                             and torch.equal(z, ref_out))
        report(f"rotate_in {M}x{k} rows {rows}", event_ms(lambda: X.rotate_in(x, suh)), M * k * 4)
        report(f"rotate_out {M}x{k} rows {rows}",
               event_ms(lambda: X.rotate_out(part, suh, out_dtype=torch.bfloat16)), M * k * 6)
    X.ROT_ROWS = default_rows
    del x, part

# RoPE: the queries [T, 64, 512] bf16 (head channels copied), the output fp32 → bf16 (inverse)
q = torch.randn(T, 64, 512, device=dev, generator=g).bfloat16()
o = torch.randn(T, 64, 512, device=dev, generator=g)
pos = torch.arange(T, device=dev) + 28672
inv = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, device=dev, dtype=torch.float64) / 64))
cos, sin = R.cos_sin(inv, pos)
report("rope q [4096, 64, 512] bf16", event_ms(lambda: R.apply_rope(q, cos, sin)), q.numel() * 4)
report("rope o [4096, 64, 512] fp32 → bf16",
       event_ms(lambda: R.apply_rope(o, cos, sin, inverse=True, out_dtype=torch.bfloat16)),
       o.numel() * 6)
report("cast o fp32 → bf16 (torch)", event_ms(lambda: o.to(torch.bfloat16)), o.numel() * 6)
print("same bits across row tiles:", all(v for k, v in out.items() if "same bits" in k))
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_memory_kernels.json"),
                    "w"), indent=1)
