"""The prefill GEMM's (exl3._gemm_kernel: reconstructed Ŵ fp16 from memory, the fixed split
order) tile configurations at a 4,096-row chunk and V4.1's non-routed linear shapes, against
cuBLAS (torch.mm, fp16) as the tensor cores' ceiling. Every configuration's output is compared
bit for bit with the default's: a tile shape changes which program computes an element, not
its k16 chain or its split sums, so the bits must not move. BASE_EXL3=file.py: also time
that version of strata/kernels/exl3.py's GEMM (e.g. `git show REV:strata/kernels/exl3.py`) at
the default tiles, its bits compared too; DEFAULT_ONLY=1: no other tiles.
Results: bench/results/kernels.md. On the device:
    source scripts/device_env.sh && python scripts/probe_gemm_tiles.py [OUT.json]"""
import importlib.util
import json
import os
import sys

import torch
import triton
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor

from strata.kernels import exl3 as X

M = 4096
# (name, k_p, n_p): the linears a prefill chunk runs on the reconstruct + GEMM path
SHAPES = [("wq_a", 5120, 1280), ("wq_b", 1280, 32768), ("wkv", 5120, 512),
          ("wo_a group", 4096, 1024), ("wo_b", 8192, 5120), ("shared w13", 5120, 4608),
          ("shared w2", 2304, 5120), ("index wq_b", 1280, 4096)]
# (BM, BN, warps, stages); the first is the default
CONFIGS = [(X.GEMM_BLOCK_M, X.GEMM_BLOCK_N, X.GEMM_NUM_WARPS, X.GEMM_NUM_STAGES),
           (128, 128, 8, 2), (128, 256, 8, 2), (256, 128, 8, 2),
           (128, 64, 4, 4)]
if os.environ.get("DEFAULT_ONLY") == "1":
    CONFIGS = CONFIGS[:1]
BASE = None
if os.environ.get("BASE_EXL3"):
    spec = importlib.util.spec_from_file_location("exl3_base", os.environ["BASE_EXL3"])
    BASE = sys.modules["exl3_base"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(BASE)
    CONFIGS.append("base")


def gemm(xr, w, y, per, cfg):
    K = X
    if cfg == "base":
        K, cfg = BASE, CONFIGS[0]
    bm, bn, nw, ns = cfg
    grid = (triton.cdiv(xr.shape[0], bm), w.shape[1] // bn)
    if K is BASE and "x_desc" not in K._gemm_kernel.arg_names:  # (before session 49)
        return K._gemm_kernel[grid](xr, w, y, xr.shape[0], xr.shape[1] // X.BLOCK_K, per,
                                    xr.stride(0), w.stride(0), y.stride(0), BM=bm, BN=bn,
                                    BK=X.BLOCK_K, JOIN_B=X._join_b(xr), num_warps=nw,
                                    num_stages=ns)
    tma = X._gemm_tma(xr)
    xd = TensorDescriptor.from_tensor(xr, [bm, X.BLOCK_K]) if tma else xr
    wd = TensorDescriptor.from_tensor(w, [X.BLOCK_K, bn]) if tma else w
    return K._gemm_kernel[grid](xr, w, xd, wd, y, xr.shape[0], xr.shape[1] // X.BLOCK_K, per,
                                xr.stride(0), w.stride(0), y.stride(0), BM=bm, BN=bn,
                                BK=X.BLOCK_K, JOIN_B=X._join_b(xr), TMA=tma, num_warps=nw,
                                num_stages=ns)


def main():
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    out = {"device": torch.cuda.get_device_name(), "M": M, "shapes": {}}
    totals = {cfg: 0.0 for cfg in CONFIGS}
    totals["cublas"] = 0.0
    for name, kp, n in SHAPES:
        xr = torch.randn(M, kp, device=dev, generator=g).half()
        w = (torch.randn(kp, n, device=dev, generator=g) * 0.05).half()
        per, S = X.split_schedule(kp, n)
        flops = 2 * M * kp * n
        row = {"k_p": kp, "n_p": n, "per_split": per, "splits": S}
        ref = torch.empty(M, n, device=dev)
        gemm(xr, w, ref, per, CONFIGS[0])
        for cfg in CONFIGS:
            y = torch.full((M, n), float("nan"), device=dev)
            try:
                c = gemm(xr, w, y, per, cfg)
                torch.cuda.synchronize()
            except Exception as e:  # (a configuration the GPU cannot hold: out of resources)
                row[str(cfg)] = f"failed: {type(e).__name__}: {str(e)[:120]}"
                print(f"{name:12s} {cfg}: {row[str(cfg)]}", flush=True)
                totals[cfg] = float("nan")
                continue
            same = bool(torch.equal(y, ref))
            us = do_bench(lambda: gemm(xr, w, y, per, cfg), warmup=10, rep=60) * 1000
            totals[cfg] += us
            # (shared memory: the pipeline's stages of A and B tiles, where it buffers them)
            row[str(cfg)] = {"us": round(us, 1), "tflops": round(flops / us / 1e6, 1),
                             "bits_equal": same, "shared": c.metadata.shared}
            print(f"{name:12s} {cfg}: {us:8.1f} us {flops / us / 1e6:6.1f} TFLOPS "
                  f"bits {'equal' if same else 'DIFFER'}, shared {c.metadata.shared} B",
                  flush=True)
        us = do_bench(lambda: torch.mm(xr, w), warmup=10, rep=60) * 1000
        totals["cublas"] += us
        row["cublas"] = {"us": round(us, 1), "tflops": round(flops / us / 1e6, 1)}
        print(f"{name:12s} cuBLAS fp16: {us:8.1f} us {flops / us / 1e6:6.1f} TFLOPS", flush=True)
        out["shapes"][name] = row
    out["totals_us"] = {str(k): round(v, 1) for k, v in totals.items()}
    print("sum over the shapes (µs):", out["totals_us"], flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
