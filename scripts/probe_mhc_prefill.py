"""mHC's two prefill-sized kernels at a 4,096-row chunk (V4.1: 4 copies of 5,120, 24 mixes):
hc_update (elementwise, bandwidth-bound; all 4 output copies a program since session 47, when
a program per copy ran 0.289 ms at 1.3 TB/s on an H100) for columns a program (BD) and
warps, and hc_mix's partials for rows a program (BT) and warps — ms a call (CUDA events,
median of 5, 2 weight sets alternating), GB/s counting the bytes each must move, and whether
each variant gives the default's bits (neither the row block nor BD is part of any value's
order of operations). On the device: source scripts/device_env.sh && python
scripts/probe_mhc_prefill.py"""
import json
import os

import torch
import triton

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


def update(bd: int, warps: int, s):
    h, y, post, comb, _ = s
    o = torch.empty_like(h)
    mhc._hc_update_kernel[(T, triton.cdiv(D, bd))](
        y, h, post, comb, o, D, y.stride(0), h.stride(0), h.stride(1), o.stride(0), o.stride(1),
        H=H, HP=H, BD=bd, num_warps=warps, enable_fp_fusion=False, PDL=False)
    return o


def mix(bt: int, warps: int, s):
    h, fn = s[0], s[4]
    x = h.reshape(T, -1)
    chunks = triton.cdiv(H * D, mhc.MIX_CHUNK)
    part = torch.empty((chunks, T, N + 1), dtype=torch.float32, device=dev)
    mhc._hc_mix_kernel[(triton.cdiv(T, bt), chunks)](
        x, fn, part, T, N, H * D, x.stride(0), fn.stride(0), part.stride(0), part.stride(1),
        BT=bt, BN=32, BK=mhc.MIX_K, CHUNK=mhc.MIX_CHUNK, SPLIT=True, num_warps=warps, PDL=False)
    return part


def timed(fn, nbytes: float, name: str, ref):
    i = [0]

    def call():
        i[0] ^= 1
        return fn(sets[i[0]])
    ms = event_ms(call)
    same = torch.equal(fn(sets[0]), ref)
    out[name] = {"ms": round(ms, 4), "GB/s": round(nbytes / ms / 1e6), "same bits": same}
    print(f"{name:28s} {ms:8.4f} ms {nbytes / ms / 1e6:7.0f} GB/s  same bits: {same}", flush=True)


a = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
b = torch.empty_like(a)
ms = event_ms(lambda: b.copy_(a))
out["copy GB/s"] = round(2 * a.numel() / ms / 1e6)
print(f"copy (256 MiB, read + write): {out['copy GB/s']} GB/s", flush=True)
up_bytes = 2 * (T * H * D * 2) + T * D * 2
ref = update(mhc.BLOCK_D, 4, sets[0])
for bd, w in [(256, 4), (512, 4), (512, 8), (1024, 4), (1024, 8), (2048, 8)]:
    timed(lambda s, bd=bd, w=w: update(bd, w, s), up_bytes, f"hc_update BD {bd} warps {w}", ref)
mix_bytes = T * H * D * 2
ref = mix(mhc.MIX_ROWS, 4, sets[0])
for bt, w in [(16, 4), (32, 4), (64, 4), (64, 8), (128, 8)]:
    timed(lambda s, bt=bt, w=w: mix(bt, w, s), mix_bytes, f"hc_mix BT {bt} warps {w}", ref)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_mhc_prefill.json"), "w"),
          indent=1)
