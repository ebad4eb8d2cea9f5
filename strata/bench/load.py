"""Load benchmark: throughput and peak host RSS of the streaming loader on a synthetic checkpoint.

  python -m strata.bench.load DIR --size 8GB --device cuda:0 [--runs 3] [--cold] [--json F]

Writes (once) a synthetic sharded checkpoint of `--size` bytes into DIR (uint8 tensors of
mixed sizes, some larger than one staging buffer), then loads every tensor onto the device
`--runs` times. Each run reports seconds, GB/s and peak RSS above the pre-load baseline
(VmHWM, reset through /proc/self/clear_refs). On a CUDA device the weights stay on the GPU
until the run ends, so peak RSS above baseline should be about the staging pool; on the CPU
each tensor is dropped after loading to measure the streaming alone (peak RSS then also
holds the largest single tensor, whose home is RAM).
`--cold` evicts the files from the page cache before each run (posix_fadvise DONTNEED, no root
needed for clean pages), so the disk is measured, not the page cache.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from strata.checkpoint.loader import DEFAULT_BUFFER_BYTES, DEFAULT_N_BUFFERS, TensorLoader
from strata.checkpoint.safetensors_io import INDEX_NAME, CheckpointFolder, write_safetensors
from strata.runtime.placement import parse_bytes

MiB = 1 << 20
# A mix like the real checkpoint: many ~6 MB expert tensors, some big dense ones.
TENSOR_SIZES = (6 * MiB, 6 * MiB, 6 * MiB, 370 * 1024, 64 * MiB, 300 * MiB)


def write_synthetic(folder: Path, total: int, shard_bytes: int = 2 << 30) -> None:
    """A sharded checkpoint of about `total` bytes (skipped when the index already exists)."""
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / INDEX_NAME).exists():
        return
    weight_map: dict[str, str] = {}
    written, shard, i = 0, 0, 0
    while written < total:
        name = f"model-{shard:05d}.safetensors"
        tensors, size = {}, 0
        while size < shard_bytes and written + size < total:
            n = TENSOR_SIZES[i % len(TENSOR_SIZES)]
            tensors[f"t{i}"] = torch.full((n,), i % 251, dtype=torch.uint8)
            weight_map[f"t{i}"] = name
            size += n
            i += 1
        write_safetensors(folder / name, tensors)
        del tensors
        written += size
        shard += 1
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _evict(files: list[Path]) -> None:
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_once(folder: CheckpointFolder, device: torch.device, buffer_bytes: int,
             n_buffers: int, cold: bool) -> dict[str, float]:
    if cold:
        _evict(folder.files())
    names = folder.names()
    infos = [folder.info(n) for n in names]
    baseline = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS
    kept = []
    t0 = time.perf_counter()
    with TensorLoader(device, buffer_bytes=buffer_bytes, n_buffers=n_buffers) as loader:
        for info in infos:
            t = loader.load(info)
            if device.type == "cuda":
                kept.append(t)
            del t  # on the CPU, free it before the next one is allocated
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM") - baseline
    nbytes = sum(i.nbytes for i in infos)
    del kept
    return {"seconds": seconds, "gb_per_s": nbytes / seconds / 1e9, "bytes": nbytes,
            "peak_rss_over_baseline": peak, "pool_bytes": buffer_bytes * n_buffers,
            "largest_tensor_bytes": max(i.nbytes for i in infos)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m strata.bench.load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir")
    p.add_argument("--size", default="8GB")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--buffer-mb", type=int, default=DEFAULT_BUFFER_BYTES // MiB)
    p.add_argument("--buffers", type=int, default=DEFAULT_N_BUFFERS)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--cold", action="store_true")
    p.add_argument("--json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    folder_path = Path(args.dir)
    write_synthetic(folder_path, parse_bytes(args.size))
    folder = CheckpointFolder(folder_path)
    runs = [run_once(folder, device, args.buffer_mb * MiB, args.buffers, args.cold)
            for _ in range(args.runs)]
    med = statistics.median(r["gb_per_s"] for r in runs)
    peak = max(r["peak_rss_over_baseline"] for r in runs)
    print(f"{runs[0]['bytes'] / 1e9:.2f} GB to {device}, {'cold' if args.cold else 'warm'} page "
          f"cache: median {med:.2f} GB/s over {len(runs)} runs; peak RSS above baseline "
          f"{peak / MiB:.0f} MiB (staging pool {args.buffer_mb * args.buffers} MiB"
          + (f"; on the CPU also the largest tensor, {runs[0]['largest_tensor_bytes'] / MiB:.0f}"
             " MiB, whose home is RAM)" if device.type == "cpu" else ")"))
    if args.json:
        meta = {"command": "python -m strata.bench.load " + " ".join(sys.argv[1:]),
                "date": time.strftime("%Y-%m-%d"),
                "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                else platform.processor() or platform.machine()}
        Path(args.json).write_text(json.dumps({"meta": meta, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
