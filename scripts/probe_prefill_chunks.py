"""Prefill rate by chunk size on the synthetic V4.1 (one GPU, one build for every run).

    python scripts/probe_prefill_chunks.py LENGTHS CHUNKS OUT.json [--layers 0-4,20-24]

LENGTHS and CHUNKS are comma-separated token counts; every chunk size (in the order given,
repeats allowed, for alternating A/Bs) times a decoder-skipping prefill of each length through
strata.bench.synthetic.bench_prefill (an untimed warm-up of the same chunk forms first), and
prints the rate, the chunks' scratch (peak − the memory held before) and the peak.
"""
from __future__ import annotations

import argparse
import json
import time

from strata.bench.synthetic import bench_prefill, build_synthetic, parse_layers
from strata.config import v41_flash_config

from probe_session import PROBE_LAYERS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("lengths")
    p.add_argument("chunks")
    p.add_argument("out")
    p.add_argument("--layers", default=PROBE_LAYERS)
    p.add_argument("--device", default="cuda:0")
    args = p.parse_args()
    cfg = v41_flash_config()
    layers = parse_layers(args.layers, cfg.num_hidden_layers)
    scale = (len(layers) if layers else cfg.num_hidden_layers) / cfg.num_hidden_layers
    t0 = time.perf_counter()
    model, _ = build_synthetic(cfg, args.device, layers=layers, fmt="exl3", seed=0)
    print(f"build {time.perf_counter() - t0:.1f} s", flush=True)
    out = []
    for chunk in [int(x) for x in args.chunks.split(",")]:
        for n in [int(x) for x in args.lengths.split(",")]:
            r = bench_prefill(model, [n], chunk, "on", 0)[0]
            scratch = (r["peak_device_bytes"] - r["base_device_bytes"]) / 2 ** 30
            print(f"chunk {chunk:6d} prompt {n:7d}: {r['seconds']:.2f} s "
                  f"{r['tok_per_s']:8.0f} tok/s ({r['tok_per_s'] * scale:7.0f} scaled to all "
                  f"layers), chunk scratch {scratch:.2f} GiB, peak "
                  f"{r['peak_device_bytes'] / 2 ** 30:.1f} GiB", flush=True)
            out.append(r)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
