"""Tiles for the row kernel's session-15 products, timed by CUDA-graph replay over 16
operand sets each (past L2, as a decode step's layers are): attention's p·v (SPLIT) and the
router's row tiles (PAIR16), at decode (1 query / 1 and 6 rows) and prefill shapes, against
the products they replace. µs per call; JSON to $OUT.
On the device: source scripts/device_env.sh && python scripts/probe_rowwise_tiles.py"""
import json
import os

import torch

from strata.bench.kernels import replay_us
from strata.kernels import rowwise

dev = "cuda"
out = {}
g = torch.Generator(device=dev).manual_seed(0)
SETS = 16


def log(k, v):
    out[k] = v
    print(f"{k:60s} {v:10.2f}", flush=True)


def with_tile(prod, tile, fn):
    orig_p, orig_t = rowwise.product, rowwise.tile_shape
    rowwise.product = lambda M, x, w: rowwise.Product.ROW if M == 1 else prod
    rowwise.tile_shape = lambda M, p=None: (1, 32, 64) if M == 1 else tile
    try:
        return fn()
    finally:
        rowwise.product, rowwise.tile_shape = orig_p, orig_t


P = rowwise.Product
for B in (1, 243):
    sets = []
    for _ in range(SETS if B == 1 else 2):
        p = torch.rand(B, 64, 640, device=dev, generator=g)
        rows = torch.randn(B, 640, 512, device=dev, generator=g).bfloat16()
        sets.append((p / p.sum(-1, keepdim=True), rows.transpose(1, 2)))
    calls = [lambda p=p, v=v: rowwise.rowwise_bmm(p, v) for p, v in sets]
    for name, prod, tile in [("fma 32x32x32 (old)", P.FMA, (32, 32, 32)),
                             ("split 32x64x64", P.SPLIT, (32, 64, 64)),
                             ("split 32x32x64", P.SPLIT, (32, 32, 64)),
                             ("split 32x32x32", P.SPLIT, (32, 32, 32)),
                             ("split 16x64x64", P.SPLIT, (16, 64, 64)),
                             ("split 64x64x64", P.SPLIT, (64, 64, 64)),
                             ("split 64x128x64", P.SPLIT, (64, 128, 64))]:
        try:
            log(f"pv B{B} {name}", with_tile(prod, tile, lambda: replay_us(calls)))
        except Exception as e:  # a tile Triton cannot lower
            print(f"pv B{B} {name} failed: {e!r}"[:300], flush=True)

for T in (1, 6, 4096):
    sets = []
    for _ in range(SETS if T < 100 else 2):
        w = (torch.randn(384, 5120, device=dev, generator=g) * 0.02).bfloat16()
        sets.append((torch.randn(T, 5120, device=dev, generator=g).bfloat16(), w, w.float()))
    old = [lambda x=x, wf=wf: rowwise.rowwise_bmm(x.unsqueeze(1), wf.unsqueeze(0),
                                                  out_dtype=torch.float32) for x, _, wf in sets]
    log(f"router T{T} row per program, fp32 w (old)", replay_us(old))
    row16 = [lambda x=x, w=w: rowwise.rowwise_bmm(x.unsqueeze(1), w.unsqueeze(0),
                                                  out_dtype=torch.float32) for x, w, _ in sets]
    log(f"router T{T} row per program, bf16 w", replay_us(row16))
    for tile in [(16, 32, 64), (16, 64, 64), (16, 32, 128), (16, 16, 64), (32, 32, 64)]:
        orig = rowwise.ROWS_TILE
        rowwise.ROWS_TILE = tile
        try:
            calls = [lambda x=x, w=w: rowwise.rowwise_rows(x, w, torch.float32)
                     for x, w, _ in sets]
            log(f"router T{T} row tiles {tile}", replay_us(calls))
        except Exception as e:
            print(f"router T{T} {tile} failed: {e!r}"[:300], flush=True)
        finally:
            rowwise.ROWS_TILE = orig
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_tiles.json"), "w"),
          indent=1)
