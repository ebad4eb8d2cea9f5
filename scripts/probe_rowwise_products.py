"""The row kernel's tensor-core products for prefill (session 15) against what they replace,
at V4.1 shapes, same operands, same run: attention's p·v (fp32 p against bf16 rows: the
split product against IEEE fp32 FMAs, and cuBLAS on the widened operands) and the router's
row_matmul (bf16 rows sharing row tiles against one row per program on the fp32 weight).
Prints µs and the largest difference between the two products; JSON to $OUT.
On the device: source scripts/device_env.sh && python scripts/probe_rowwise_products.py"""
import json
import os

import torch
from triton.testing import do_bench

from strata.kernels import rowwise

dev = "cuda"
out = {}
g = torch.Generator(device=dev).manual_seed(0)


def t(fn):
    return do_bench(fn, warmup=5, rep=40) * 1000  # µs


def log(k, v):
    out[k] = v
    print(f"{k:60s} {v:12.4g}", flush=True)


def as_fma(fn):
    """fn with the tile path's products forced to IEEE fp32 FMAs in their old 32×32×32 tile."""
    orig = rowwise.product
    rowwise.product = lambda M, x, w: rowwise.Product.ROW if M == 1 else rowwise.Product.FMA
    try:
        return fn()
    finally:
        rowwise.product = orig


for B in (1, 243, 1024):  # a decode step; a prefill piece of queries (ATTN_SCRATCH); more
    p = torch.rand(B, 64, 640, device=dev, generator=g)
    p = p / p.sum(-1, keepdim=True)
    rows = torch.randn(B, 640, 512, device=dev, generator=g).bfloat16()
    v = rows.transpose(1, 2)
    new = rowwise.rowwise_bmm(p, v)
    old = as_fma(lambda: rowwise.rowwise_bmm(p, v))
    log(f"pv B{B} split max|new-old|", float((new - old).abs().max()))
    log(f"pv B{B} split us", t(lambda: rowwise.rowwise_bmm(p, v)))
    log(f"pv B{B} fma us", as_fma(lambda: t(lambda: rowwise.rowwise_bmm(p, v))))
    rf = rows.float()
    log(f"pv B{B} cublas fp32 us", t(lambda: torch.bmm(p, rf)))

w = (torch.randn(384, 5120, device=dev, generator=g) * 0.02).bfloat16()
wf = w.float()
for T in (1, 6, 4096):  # decode, a verify window, a prefill chunk
    x = torch.randn(T, 5120, device=dev, generator=g).bfloat16()
    new = rowwise.rowwise_rows(x, w, torch.float32)
    old = rowwise.rowwise_bmm(x.unsqueeze(1), wf.unsqueeze(0), out_dtype=torch.float32)[:, 0]
    log(f"router T{T} max|new-old|", float((new - old).abs().max()))
    log(f"router T{T} row tiles us", t(lambda: rowwise.rowwise_rows(x, w, torch.float32)))
    log(f"router T{T} row per program (fp32 w) us",
        t(lambda: rowwise.rowwise_bmm(x.unsqueeze(1), wf.unsqueeze(0), out_dtype=torch.float32)))
    log(f"router T{T} cublas bf16 us", t(lambda: (x @ w.T).float()))
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_rowwise.json"), "w"),
          indent=1)
