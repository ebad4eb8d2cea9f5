"""The M = 1 row kernel (strata.kernels.rowwise, PRODUCT ROW) by its outputs per program
(ROW_BLOCK_N): µs (triton.testing.do_bench, L2 flushed) and GB/s of the weight read, and
whether each width gives the default width's bits — at the DSpark draft's Markov pick
([1, 256] fp32 · [129,280, 256]ᵀ bf16, five a draft) and a router-sized row product. One-off
diagnostic (GPU): source scripts/device_env.sh && python scripts/probe_row_widths.py"""
import torch
import triton

from strata.kernels import rowwise

SHAPES = (("markov_pick", 129280, 256, torch.float32, torch.bfloat16),
          ("router_row", 384, 4096, torch.float32, torch.float32),
          ("row_4096x4096_fp32xbf16", 4096, 4096, torch.float32, torch.bfloat16))
WIDTHS = (16, 32, 64, 128, 256)
default = rowwise.ROW_BLOCK_N
g = torch.Generator(device="cpu").manual_seed(0)
for name, N, K, xd, wd in SHAPES:
    x = torch.randn(1, 1, K, generator=g).to("cuda", xd)
    w = torch.randn(1, N, K, generator=g).to("cuda", wd)
    rowwise.ROW_BLOCK_N = default
    ref = rowwise.rowwise_bmm(x, w, out_dtype=torch.float32)
    for width in WIDTHS:
        rowwise.ROW_BLOCK_N = width
        out = rowwise.rowwise_bmm(x, w, out_dtype=torch.float32)
        us = 1e3 * triton.testing.do_bench(
            lambda: rowwise.rowwise_bmm(x, w, out_dtype=torch.float32), warmup=25, rep=100)
        gbs = w.numel() * w.element_size() / us / 1e3
        print(f"{name:26s} width {width:4d}: {us:7.2f} µs, {gbs:7.1f} GB/s of w, bits "
              f"{'equal' if torch.equal(out, ref) else 'DIFFER'} to width {default}", flush=True)
rowwise.ROW_BLOCK_N = default
