"""mHC's two prefill-sized kernels at a 4,096-row chunk (V4.1: 4 copies of 5,120, 24 mixes),
through the model's own calls with the module's tile constants varied: hc_update for columns a
program (mhc.BLOCK_D; all 4 output copies a program since session 47, when a program per copy
ran 0.289 ms at 1.3 TB/s on an H100) and hc_mix's partials for rows a program above 16
(mhc.MIX_ROWS_WIDE) — ms a call (CUDA events, median of 5, 2 weight sets alternating), GB/s
counting the bytes each must move, and whether each variant gives the default's bits (neither
is part of any value's order of operations). Session 47's runs also launched 8 warps a program
(slower at every size). On the device: source scripts/device_env.sh && python
scripts/probe_mhc_prefill.py"""
import json
import os

import torch

from strata.bench.kernels import event_ms
from strata.kernels import mhc

dev = "cuda"
T, H, D, N = int(os.environ.get("TOKENS", 4096)), 4, 5120, 24
g = torch.Generator(device=dev).manual_seed(0)
out = {"T": T}
sets = []
for _ in range(2):
    h = (torch.randn(T, H, D, device=dev, generator=g) * 3).bfloat16()
    y = torch.randn(T, D, device=dev, generator=g).bfloat16()
    post = torch.rand(T, H, device=dev, generator=g)
    comb = torch.rand(T, H, H, device=dev, generator=g)
    fn = torch.randn(N, H * D, device=dev, generator=g) * (H * D) ** -0.5
    sets.append((h, y, post, comb, fn))


def update(s):
    h, y, post, comb, _ = s
    return mhc.hc_update(y, h, post, comb)


def mix(s):
    return mhc._mix_partials(s[0], s[4])


def timed(fn, name: str, const: str, values, nbytes: float) -> None:
    """fn under each value of mhc.<const>, against the default's bits."""
    default = getattr(mhc, const)
    ref = fn(sets[0])
    i = [0]

    def call():
        i[0] ^= 1
        return fn(sets[i[0]])
    for v in values:
        setattr(mhc, const, v)
        ms = event_ms(call)
        same = torch.equal(fn(sets[0]), ref)
        key = f"{name} {const} {v}"
        out[key] = {"ms": round(ms, 4), "GB/s": round(nbytes / ms / 1e6), "same bits": same}
        print(f"{key:30s} {ms:8.4f} ms {nbytes / ms / 1e6:7.0f} GB/s  same bits: {same}",
              flush=True)
    setattr(mhc, const, default)


a = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
b = torch.empty_like(a)
ms = event_ms(lambda: b.copy_(a))
out["copy GB/s"] = round(2 * a.numel() / ms / 1e6)
print(f"copy (256 MiB, read + write): {out['copy GB/s']} GB/s", flush=True)
timed(update, "hc_update", "BLOCK_D", (256, 512, 1024, 2048), 2 * (T * H * D * 2) + T * D * 2)
timed(mix, "hc_mix", "MIX_ROWS_WIDE", (16, 32, 64, 128), T * H * D * 2)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_mhc_prefill.json"), "w"),
          indent=1)
