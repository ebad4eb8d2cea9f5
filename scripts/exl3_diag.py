"""GPU diagnosis: why do the fused EXL3 kernel and reconstruct + GEMM round differently on CUDA?

Each variant computes y' = x'·Ŵ for one weight with a single split (all k-steps in one program,
ascending) and is compared bit for bit with the fused kernel at BLOCK_M = 16 (the decode path).
For every compiled variant it prints the MMA version and the dot-operand kWidth from the TTGIR,
the suspects being the k-grouping of products into MMA instructions (kWidth) and wgmma.
Usage (GPU machine): python3 scripts/exl3_diag.py [name filters]
"""
from __future__ import annotations

import os
import re
import sys

import torch

if not torch.cuda.is_available():  # the logic check on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton
import triton.language as tl

from strata.kernels import exl3 as X
from strata.kernels.exl3 import _decode_block


@triton.jit
def fused_var(x_ptr, tr_ptr, y_ptr, M, k_steps, row_words, sx, sy,
              K2: tl.constexpr, CB: tl.constexpr, ASM: tl.constexpr, R: tl.constexpr,
              BN: tl.constexpr, BK: tl.constexpr):
    """R blocks of 16 rows per program, Ŵ decoded once per k-step, one [16, BK]·[BK, BN] dot
    per row block (the decode dot shape whatever R)."""
    nb = tl.program_id(0)
    g = tl.program_id(1)
    offs_k = tl.arange(0, BK)
    offs_n = nb * BN + tl.arange(0, BN)
    r0 = g * (16 * R) + tl.arange(0, 16)
    acc0 = tl.zeros([16, BN], dtype=tl.float32)
    acc1 = tl.zeros([16, BN], dtype=tl.float32)
    acc2 = tl.zeros([16, BN], dtype=tl.float32)
    acc3 = tl.zeros([16, BN], dtype=tl.float32)
    for ks in range(0, k_steps):
        b = _decode_block(tr_ptr, row_words, ks, nb, K2, CB, ASM, BK, BN)
        kk = ks * BK + offs_k
        a = tl.load(x_ptr + r0[:, None] * sx + kk[None, :], mask=(r0 < M)[:, None], other=0.0)
        acc0 = tl.dot(a, b, acc0)
        if R > 1:
            a = tl.load(x_ptr + (r0 + 16)[:, None] * sx + kk[None, :],
                        mask=(r0 + 16 < M)[:, None], other=0.0)
            acc1 = tl.dot(a, b, acc1)
        if R > 2:
            a = tl.load(x_ptr + (r0 + 32)[:, None] * sx + kk[None, :],
                        mask=(r0 + 32 < M)[:, None], other=0.0)
            acc2 = tl.dot(a, b, acc2)
            a = tl.load(x_ptr + (r0 + 48)[:, None] * sx + kk[None, :],
                        mask=(r0 + 48 < M)[:, None], other=0.0)
            acc3 = tl.dot(a, b, acc3)
    tl.store(y_ptr + r0[:, None] * sy + offs_n[None, :], acc0, mask=(r0 < M)[:, None])
    if R > 1:
        tl.store(y_ptr + (r0 + 16)[:, None] * sy + offs_n[None, :], acc1,
                 mask=(r0 + 16 < M)[:, None])
    if R > 2:
        tl.store(y_ptr + (r0 + 32)[:, None] * sy + offs_n[None, :], acc2,
                 mask=(r0 + 32 < M)[:, None])
        tl.store(y_ptr + (r0 + 48)[:, None] * sy + offs_n[None, :], acc3,
                 mask=(r0 + 48 < M)[:, None])


@triton.jit
def fused_bm(x_ptr, tr_ptr, y_ptr, M, k_steps, row_words, sx, sy,
             K2: tl.constexpr, CB: tl.constexpr, ASM: tl.constexpr, BM: tl.constexpr,
             BN: tl.constexpr, BK: tl.constexpr):
    """One [BM, BK]·[BK, BN] dot per k-step (BM = 16 is the decode kernel's shape)."""
    nb = tl.program_id(0)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    offs_n = nb * BN + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for ks in range(0, k_steps):
        b = _decode_block(tr_ptr, row_words, ks, nb, K2, CB, ASM, BK, BN)
        a = tl.load(x_ptr + rows[:, None] * sx + (ks * BK + offs_k)[None, :],
                    mask=(rows < M)[:, None], other=0.0)
        acc = tl.dot(a, b, acc)
    tl.store(y_ptr + rows[:, None] * sy + offs_n[None, :], acc, mask=(rows < M)[:, None])


@triton.jit
def gemm_var(x_ptr, w_ptr, y_ptr, M, k_steps, sx, sw, sy,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PERM: tl.constexpr):
    """Ŵ fp16 from memory. PERM: load the block through the decode's index structure and
    permute/reshape it like _decode_block, so the dot operand arrives the same way."""
    nb = tl.program_id(0)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    offs_n = nb * BN + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for ks in range(0, k_steps):
        a = tl.load(x_ptr + rows[:, None] * sx + (ks * BK + offs_k)[None, :],
                    mask=(rows < M)[:, None], other=0.0)
        if PERM:
            TK: tl.constexpr = BK // 16
            TN: tl.constexpr = BN // 16
            i = tl.arange(0, TK * TN * 4)
            tk = i // (TN * 4)
            tn = (i // 4) % TN
            u = i % 4
            j = tl.arange(0, 64)  # a unit's values in assembly order: (r: 4 bits, c3, c0)
            r = j >> 2
            c = (8 * ((j >> 1) & 1) + (j & 1))[None, :] + 2 * u[:, None]
            kr = ks * BK + tk[:, None] * 16 + r[None, :]
            nc = nb * BN + tn[:, None] * 16 + c
            v = tl.load(w_ptr + kr * sw + nc)                  # [units, 64]
            v = tl.reshape(v, [TK, TN, 4, 16, 2, 2])
            v = tl.permute(v, (0, 3, 1, 4, 2, 5))
            b = tl.reshape(v, [BK, BN])
        else:
            b = tl.load(w_ptr + (ks * BK + offs_k)[:, None] * sw + offs_n[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(y_ptr + rows[:, None] * sy + offs_n[None, :], acc, mask=(rows < M)[:, None])


def mma_info(c) -> str:
    if c is None or not hasattr(c, "asm"):
        return "(interpreter)"
    ir = c.asm.get("ttgir", "")
    vers = sorted(set(re.findall(r"versionMajor = (\d)", ir)))
    kw = sorted(set(re.findall(r"kWidth = (\d+)", ir)))
    ptx = c.asm.get("ptx", "")
    return (f"mma v{','.join(vers)} kWidth {','.join(kw)} wgmma={'wgmma' in ptx} "
            f"mma.sync={ptx.count('mma.sync')}")


def main() -> int:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    k, n, K, cb = 1024, 512, 2, "mul1"
    g = torch.Generator().manual_seed(0)
    tr = torch.randint(-2**15, 2**15, (k // 16, n // 16, 16 * K), generator=g,
                       dtype=torch.int32).to(torch.int16).to(dev)
    M = 64
    x = (torch.randn(M, k, generator=g)).half().to(dev)
    words = tr.view(torch.int32)
    K2, CB, kst, rw = 2 * K, X.CODEBOOK_IDS[cb], k // 128, (n // 16) * 4 * 2 * K
    w = X.reconstruct(tr, cb)

    def run_fused_bm(BM, warps):
        y = torch.zeros(M, n, dtype=torch.float32, device=dev)
        c = fused_bm[(n // 64, triton.cdiv(M, BM))](x, words, y, M, kst, rw, x.stride(0),
                                                     y.stride(0), K2=K2, CB=CB, ASM=X._asm(x),
                                                     BM=BM, BN=64, BK=128, num_warps=warps,
                                                     num_stages=1, enable_fp_fusion=False)
        return y, c

    def run_fused_r(R):
        y = torch.zeros(M, n, dtype=torch.float32, device=dev)
        c = fused_var[(n // 64, triton.cdiv(M, 16 * R))](x, words, y, M, kst, rw, x.stride(0),
                                                         y.stride(0), K2=K2, CB=CB, ASM=X._asm(x),
                                                         R=R, BN=64, BK=128, num_warps=4,
                                                         num_stages=1, enable_fp_fusion=False)
        return y, c

    def run_gemm(BM, BN, warps, stages, perm=False):
        y = torch.zeros(M, n, dtype=torch.float32, device=dev)
        c = gemm_var[(n // BN, triton.cdiv(M, BM))](x, w, y, M, kst, x.stride(0), w.stride(0),
                                                    y.stride(0), BM=BM, BN=BN, BK=128,
                                                    PERM=perm, num_warps=warps,
                                                    num_stages=stages)
        return y, c

    base, c0 = run_fused_bm(16, 4)
    ref = (x.double() @ w.double()).float()
    print(f"baseline fused BM16/4w: {mma_info(c0)}; max |y - fp64| {float((base - ref).abs().max()):.3e}")
    # the library's own paths
    lib_f = X.sum_partials(X.exl3_partials(x, tr, cb, "fused"))
    lib_g = X.exl3_matmul(x, tr, cb, "gemm")
    print(f"library fused vs gemm: equal={torch.equal(lib_f, lib_g)} "
          f"mismatch={int((lib_f != lib_g).sum())}/{lib_f.numel()}")
    cases = {
        "fused BM16 8w": lambda: run_fused_bm(16, 8),
        "fused BM32 4w": lambda: run_fused_bm(32, 4),
        "fused BM64 4w": lambda: run_fused_bm(64, 4),
        "fused R2": lambda: run_fused_r(2),
        "fused R4": lambda: run_fused_r(4),
        "gemm 16x64 4w s1": lambda: run_gemm(16, 64, 4, 1),
        "gemm 16x64 4w s3": lambda: run_gemm(16, 64, 4, 3),
        "gemm 32x128 8w s3": lambda: run_gemm(32, 128, 8, 3),
        "gemm 64x128 4w s3": lambda: run_gemm(64, 128, 4, 3),
        "gemm 128x128 8w s3": lambda: run_gemm(128, 128, 8, 3),
        "gemm PERM 16x64 4w s1": lambda: run_gemm(16, 64, 4, 1, True),
        "gemm PERM 64x64 4w s1": lambda: run_gemm(64, 64, 4, 1, True),
    }
    only = sys.argv[1:]
    for name, fn in cases.items():
        if only and not any(o in name for o in only):
            continue
        try:
            y, c = fn()
            eq = torch.equal(y, base)
            print(f"{name:24s} equal={eq} mismatch={int((y != base).sum()):6d} "
                  f"maxdiff={float((y - base).abs().max()):.3e} | {mma_info(c)}")
        except Exception as e:  # report and go on
            print(f"{name:24s} ERROR {type(e).__name__}: {str(e)[:200]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
