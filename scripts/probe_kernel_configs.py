"""Tile and launch configurations of the indexer's scores, hc_mix and the row kernel's 16-bit
tiles at V4.1 shapes, against cuBLAS and the torch path (session 9's probe; results in
bench/results/kernels_probe_s9_*). Each configuration is set through the modules' constants.
OLD_INDEXER=file.py: also time that version of strata/kernels/indexer.py (session 9 used
`git show 6e5d1ca:strata/kernels/indexer.py`, the masked head sum).
On the device: source scripts/device_env.sh && python scripts/probe_kernel_configs.py"""
import importlib.util
import itertools
import json
import os

import torch
from triton.testing import do_bench
from strata.kernels import indexer as ix, mhc, rowwise
from strata.model.numerics import rows_bmm, row_matmul, row_mean

old_indexer = None
if os.environ.get("OLD_INDEXER"):
    spec = importlib.util.spec_from_file_location("old_indexer", os.environ["OLD_INDEXER"])
    old_indexer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old_indexer)
dev = "cuda"
out = {}


def t(fn):
    return do_bench(fn, warmup=5, rep=30) * 1000  # µs


def log(k, v):
    out[k] = v
    print(f"{k:70s} {v:10.1f} us", flush=True)

index_defaults = ix.BLOCK_T, ix.BLOCK_N, ix.BLOCK_K, ix.NUM_WARPS
mix_defaults = mhc.MIX_ROWS, mhc.MIX_K, mhc.MIX_CHUNK
g = torch.Generator(device=dev).manual_seed(0)
for T, n in [(1, 512), (1, 8192), (6, 512), (512, 16384), (4096, 16384)]:
    q = torch.randn(T, 32, 128, device=dev, generator=g).bfloat16()
    keys = torch.randn(n, 128, device=dev, generator=g).bfloat16()
    w = torch.randn(T, 32, device=dev, generator=g) * 0.02
    vis = torch.full((T,), n, device=dev)
    ref = ix.index_scores(q, keys, w, vis)
    if old_indexer is not None:
        log(f"index T{T} n{n} old-masked-kernel",
            t(lambda: old_indexer.index_scores(q, keys, w, vis)))
    log(f"index T{T} n{n} torch rows_bmm path", t(lambda: rows_bmm(w.unsqueeze(1), torch.relu(rows_bmm(q, keys.unsqueeze(0), torch.float32)).transpose(1, 2))))
    log(f"index T{T} n{n} cublas (bound)", t(lambda: torch.bmm(w.unsqueeze(1), torch.relu(torch.matmul(q, keys.t()).float()))))
    for bt, bn, bk, nw in itertools.product([1, 2, 4], [64, 128], [64, 128], [4, 8]):
        ix.BLOCK_T, ix.BLOCK_N, ix.BLOCK_K, ix.NUM_WARPS = bt, bn, bk, nw
        try:
            got = ix.index_scores(q, keys, w, vis)
            ok = torch.allclose(got, ref, rtol=1e-3, atol=1e-3)
            log(f"index T{T} n{n} reshape bt{bt} bn{bn} bk{bk} w{nw} ok{int(ok)}", t(lambda: ix.index_scores(q, keys, w, vis)))
        except Exception as e:
            print("index fail", bt, bn, bk, nw, repr(e)[:200], flush=True)
    ix.BLOCK_T, ix.BLOCK_N, ix.BLOCK_K, ix.NUM_WARPS = index_defaults

for T in [1, 6, 4096]:
    h = torch.randn(T, 4, 5120, device=dev, generator=g).bfloat16()
    fn = torch.randn(24, 20480, device=dev, generator=g) * 0.01
    x = h.float().flatten(1)
    log(f"hcmix T{T} old row_matmul+mean", t(lambda: (row_matmul(h.flatten(1), fn, torch.float32), row_mean(x * x))))
    log(f"hcmix T{T} cublas (bound)", t(lambda: (h.flatten(1).float() @ fn.t())))
    ref = mhc.hc_mix(h, fn)
    for rows, bk, chunk, nw in itertools.product([16, 32], [32, 64, 128], [256, 512, 1024, 2048], [4]):
        if bk > chunk: continue
        mhc.MIX_ROWS, mhc.MIX_K, mhc.MIX_CHUNK = rows, bk, chunk
        try:
            m, sq = mhc.hc_mix(h, fn)
            ok = torch.allclose(m, ref[0], rtol=1e-4, atol=1e-4)
            log(f"hcmix T{T} rows{rows} bk{bk} chunk{chunk} ok{int(ok)}", t(lambda: mhc.hc_mix(h, fn)))
        except Exception as e:
            print("hcmix fail", rows, bk, chunk, repr(e)[:200], flush=True)
    mhc.MIX_ROWS, mhc.MIX_K, mhc.MIX_CHUNK = mix_defaults

# the row kernel at attention prefill shapes (queries × 64 heads × 512 vs their 640 gathered rows)
for B, M, N, K in [(1024, 64, 640, 512), (1, 64, 640, 512), (1024, 64, 512, 640)]:
    x = torch.randn(B, M, K, device=dev, generator=g).bfloat16()
    wt = torch.randn(B, N, K, device=dev, generator=g).bfloat16()
    log(f"rowwise B{B} M{M} N{N} K{K} cublas", t(lambda: torch.bmm(x, wt.transpose(1, 2)).float()))
    orig = rowwise.tile_shape
    for tiles in [(64, 64, 64), (32, 64, 64), (16, 64, 64), (64, 128, 64), (64, 64, 128), (128, 64, 64)]:
        rowwise.tile_shape = lambda M_, native=False, tiles=tiles: (1, 32, 64) if M_ == 1 else tiles
        try:
            log(f"rowwise B{B} M{M} N{N} K{K} tiles{tiles}", t(lambda: rowwise.rowwise_bmm(x, wt, out_dtype=torch.float32)))
        except Exception as e:
            print("rowwise fail", tiles, repr(e)[:200], flush=True)
    rowwise.tile_shape = orig
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_s9.json"), "w"), indent=1)
