"""The RMSNorm kernel (strata.kernels.norm) at V4.1's shapes with its constants varied
(norm.BLOCK: columns a chunk; norm.NUM_WARPS): a decode row's mHC collapse + norm ([1, 4,
5,120], the weight), the query latent's norm ([1, 1,280]), the window key's norm + RoPE ([1,
512]) and a prefill chunk's collapse ([4,096, 4, 5,120]). Each variant's time a call, µs, as a
graphed decode step sees it: 64 calls captured in one CUDA graph (early launch on, as in the
model), replayed (strata.bench.kernels.replay_us; session 48's figures took the median of 7
replays instead of the mean of 20); and whether it gives the default's bits
(the final sum's tree follows the layout, so a variant may not). On the device: source
scripts/device_env.sh && python scripts/probe_norm.py"""
import json
import os

import torch

from strata.bench.kernels import replay_us
from strata.kernels import norm

dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
D, H, eps = 5120, 4, 1e-6


def shapes(T: int):
    h = (torch.randn(T, H, D, device=dev, generator=g) * 3).bfloat16()
    pre = torch.rand(T, H, device=dev, generator=g)
    w = torch.rand(D, device=dev, generator=g) + 0.5
    return h, pre, w


h1, pre1, w1 = shapes(1)
hP, preP, wP = shapes(4096)
q = torch.randn(1, 1280, device=dev, generator=g).bfloat16()
wq = torch.rand(1280, device=dev, generator=g) + 0.5
kv = torch.randn(1, 512, device=dev, generator=g).bfloat16()
wk = torch.rand(512, device=dev, generator=g) + 0.5
cos, sin = torch.rand(1, 32, device=dev, generator=g), torch.rand(1, 32, device=dev, generator=g)
CASES = {
    "collapse 1x4x5120": lambda: norm.collapse_rms_norm(h1, pre1, w1, eps),
    "q_norm 1x1280": lambda: norm.rms_norm(q, wq, eps),
    "kv norm+rope 1x512": lambda: norm.rms_norm_rope(kv, wk, eps, cos, sin),
    "collapse 4096x4x5120": lambda: norm.collapse_rms_norm(hP, preP, wP, eps),
}


out = {}
refs = {name: fn() for name, fn in CASES.items()}
for block, warps in ((1024, 4), (1024, 8), (2048, 8), (1024, 16), (2048, 16), (8192, 16),
                     (512, 4), (512, 8)):
    norm.BLOCK, norm.NUM_WARPS = block, warps
    for name, fn in CASES.items():
        us = replay_us([fn] * (64 if "4096" not in name else 8))
        same = torch.equal(fn(), refs[name])
        key = f"{name} BLOCK {block} warps {warps}"
        out[key] = {"us": round(us, 2), "same bits": same}
        print(f"{key:45s} {us:9.2f} µs  same bits: {same}", flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_norm.json"), "w"),
          indent=1)
