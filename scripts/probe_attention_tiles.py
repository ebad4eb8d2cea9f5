"""Attention's two batched products at decode shapes with other tiles of the row kernel: are the
bits the same (an output element's chain of k-steps should not depend on the tile's width), and
how long does a call take (CUDA-graph replays of 20 calls on distinct operands, µs a call)?
q·kᵀ: 64 heads × 512 against 640 rows (PAIR16, committed tile 64 × 128 × 64); p·v: fp32 p
[64, 640] against bf16 rows (SPLIT, committed 64 × 64 × 64). One-off probe (GPU):
source scripts/device_env.sh && python scripts/probe_attention_tiles.py"""
import torch

from strata.kernels.rowwise import rowwise_bmm

dev = torch.device("cuda:0")
g = torch.Generator(device=dev).manual_seed(0)
N_OPS = 20


def timed(fn, args_list) -> float:
    for a in args_list:
        fn(*a)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for a in args_list:
            fn(*a)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(args_list))
    return sorted(times)[len(times) // 2]


for B in (1, 6):
    q = [torch.randn(B, 64, 512, device=dev, generator=g).bfloat16() for _ in range(N_OPS)]
    rows = [torch.randn(B, 640, 512, device=dev, generator=g).bfloat16() for _ in range(N_OPS)]
    p = [torch.softmax(torch.randn(B, 64, 640, device=dev, generator=g), -1)
         for _ in range(N_OPS)]
    for name, xs, ws, tiles in (
            ("q·k", q, rows, [(64, 128, 64), (64, 64, 64), (64, 32, 64)]),
            ("p·v", p, [r.transpose(1, 2) for r in rows], [(64, 64, 64), (64, 32, 64),
                                                          (64, 16, 64)])):
        base = None
        for tile in tiles:
            def call(x, w, tile=tile):
                return rowwise_bmm(x, w, out_dtype=torch.float32, tile=tile)
            out = call(xs[0], ws[0])
            same = "base" if base is None else ("same bits" if torch.equal(out, base)
                                                else "BITS DIFFER")
            base = out if base is None else base
            us = timed(call, list(zip(xs, ws)))
            print(f"B={B} {name} tile {tile}: {us:6.2f} µs a call, {same}")
