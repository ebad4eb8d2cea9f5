"""GPU check of the wgmma plan for EXL3 exactness: with BLOCK_M = 64 both the fused
decode-in-registers kernel and the reconstruct + GEMM kernel lower tl.dot to wgmma (operand B
through shared memory, canonical k16 order). Are they bit-identical to each other, to the mma.sync
GEMM at kWidth 2, and batch-invariant (a row alone == in 64 / 200 rows)? And what does BM = 64 cost
the decode path at 1 / 6 rows against BM = 16?
Usage (GPU machine): python3 scripts/exl3_diag2.py
"""
from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton.testing  # noqa: E402

from strata.kernels import exl3 as X  # noqa: E402

X._check_mma = lambda compiled, name: None  # this experiment allows wgmma


def trellis(k, n, K, seed, dev):
    L = int(16 * K) if K == int(K) else int(16 * (K - 0.5)) + 8
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**15, 2**15, (k // 16, n // 16, L), generator=g,
                         dtype=torch.int32).to(torch.int16).to(dev)


def run(xr, tr, cb, path, bm, gbm, gbn=128, gwarps=8):
    X.BLOCK_M, X.GEMM_BLOCK_M, X.GEMM_BLOCK_N, X.GEMM_NUM_WARPS = bm, gbm, gbn, gwarps
    return X.exl3_matmul(xr, tr, cb, path)


def main() -> int:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    small = dev.type == "cpu"
    cases = [((256, 128) if small else (5120, 2304), 2.0, "mul1"),
             ((256, 128) if small else (2304, 5120), 3.0, "3inst"),
             ((256, 128) if small else (1280, 4096), 2.5, "mul1")]
    ok = True
    for (k, n), K, cb in cases:
        tr = trellis(k, n, K, 1, dev)
        g = torch.Generator().manual_seed(2)
        xr = (torch.randn(200, k, generator=g)).half().to(dev)
        ref = run(xr, tr, cb, "gemm", 16, 32, 128, 8)           # mma.sync, kWidth 2
        res = {"gemm wgmma 64x128 4w": run(xr, tr, cb, "gemm", 16, 64, 128, 4),
               "gemm wgmma 128x128 8w": run(xr, tr, cb, "gemm", 16, 128, 128, 8),
               "fused BM64 (wgmma)": run(xr, tr, cb, "fused", 64, 32),
               "fused BM16 (mma kW4)": run(xr, tr, cb, "fused", 16, 32)}
        for M in (1, 5, 64):
            res[f"fused BM64 rows[:{M}]"] = torch.cat(
                [run(xr[:M], tr, cb, "fused", 64, 32), ref[M:]])
        for i in (0, 77, 199):
            one = run(xr[i:i + 1], tr, cb, "fused", 64, 32)
            res[f"fused BM64 row {i} alone"] = torch.cat([ref[:i], one, ref[i + 1:]])
        for name, y in res.items():
            eq = torch.equal(y, ref)
            ok &= eq or "kW4" in name
            print(f"{k}x{n} K={K:g} {cb:5s} {name:28s} equal={eq} "
                  f"mismatch={int((y != ref).sum())}")
    if dev.type == "cuda":
        for (k, n) in ((5120, 2304), (2304, 5120), (1280, 32768)):
            tr = trellis(k, n, 2.5, 3, dev)
            for M in (1, 6):
                xr = torch.randn(M, k, device=dev).half()
                t = {}
                for bm in (16, 64):
                    X.BLOCK_M = bm
                    t[bm] = 1e3 * triton.testing.do_bench(
                        lambda: X.exl3_partials(xr, tr, "mul1", "fused"), warmup=10, rep=40,
                        return_mode="median")
                print(f"time {k}x{n} K=2.5 rows={M}: BM16 {t[16]:.1f} µs, BM64 {t[64]:.1f} µs")
    print("ALL EQUAL" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
