"""Load benchmark: throughput and peak host RSS of the streaming loader, from a checkpoint folder
or from its runtime pack.

  python -m strata.bench.load DIR --size 8GB --device cuda:0 [--pack] [--runs 3] [--cold] [--json F]

Writes (once) a synthetic checkpoint of about `--size` bytes into DIR/src with the V4.1 shapes
and encodings of what dominates loading — per layer, 16 routed experts of fp4 w1/w2/w3
(2304×5120 with ue8m0 group scales) and the fp8 attention projections wq_b and wo_b (with
tile scales) — and, with `--pack`, packs it once into DIR/pack (`strata pack`). Each run then
loads every weight onto the device the way the engine does: from a folder one tensor per
expert, from a pack one read per stacked [E, ...] tensor. Reported per run: seconds, GB/s and
peak RSS above the pre-load baseline (VmHWM, reset through /proc/self/clear_refs). On a CUDA
device the weights stay on the GPU until the run ends, so peak RSS above baseline should be
about the staging pool; on the CPU each tensor is dropped after loading to measure the
streaming alone (peak RSS then also holds the largest single tensor, whose home is RAM).
`--cold` evicts the files from the page cache before each run (posix_fadvise DONTNEED, no root
needed for clean pages), so the disk is measured, not the page cache.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from strata.bench.memory import PeakRss
from strata.checkpoint.loader import DEFAULT_BUFFER_BYTES, DEFAULT_N_BUFFERS, TensorLoader
from strata.checkpoint.pack import PackFolder, is_pack, open_checkpoint, pack
from strata.checkpoint.safetensors_io import (INDEX_NAME, CheckpointFolder, TensorInfo,
                                              write_safetensors)
from strata.runtime.placement import parse_bytes

MiB = 1 << 20
EXPERTS_PER_LAYER = 16
D, I, Q_LORA, HEADS_HD, O_LORA = 5120, 2304, 1280, 64 * 512, 8 * 1024


def _layer_tensors(layer: int, experts: int) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """One synthetic layer: fp4 experts (I8 packed + F8_E8M0 per 32) and fp8 projections."""
    fill = layer % 251
    tensors, dtypes = {}, {}
    for e in range(experts):
        for proj, (out, inp) in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
            p = f"layers.{layer}.ffn.experts.{e}.{proj}"
            tensors[f"{p}.weight"] = torch.full((out, inp // 2), fill, dtype=torch.int8)
            tensors[f"{p}.scale"] = torch.full((out, inp // 32), 127, dtype=torch.uint8)
            dtypes[f"{p}.weight"], dtypes[f"{p}.scale"] = "I8", "F8_E8M0"
    for name, (out, inp) in (("wq_b", (HEADS_HD, Q_LORA)), ("wo_b", (D, O_LORA))):
        p = f"layers.{layer}.attn.{name}"
        tensors[f"{p}.weight"] = torch.full((out, inp), fill, dtype=torch.uint8).view(
            torch.float8_e4m3fn)
        tensors[f"{p}.scale"] = torch.full((out // 32, inp // 32), 127, dtype=torch.uint8)
        dtypes[f"{p}.scale"] = "F8_E8M0"
    return tensors, dtypes


def write_synthetic(folder: Path, total: int, experts: int = EXPERTS_PER_LAYER) -> None:
    """A checkpoint of whole synthetic layers, about `total` bytes, one shard per layer
    (skipped when the index already exists)."""
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / INDEX_NAME).exists():
        return
    weight_map: dict[str, str] = {}
    written, layer = 0, 0
    while written < total:
        tensors, dtypes = _layer_tensors(layer, experts)
        name = f"model-{layer:05d}.safetensors"
        write_safetensors(folder / name, tensors, dtypes)
        weight_map.update({t: name for t in tensors})
        written += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
        layer += 1
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


_PER_EXPERT = re.compile(r"\.experts\.\d+\.")


def load_plan(folder: CheckpointFolder) -> list[TensorInfo]:
    """What the engine reads: from a pack each stacked expert tensor whole, else per tensor."""
    if isinstance(folder, PackFolder):
        stacks = [folder.stacked_info(n) for n in folder.stacked_names()]
        rest = [folder.info(n) for n in folder.names() if not _PER_EXPERT.search(n)]
        return stacks + rest
    return [folder.info(n) for n in folder.names()]


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
    infos = load_plan(folder)
    kept = []
    with PeakRss() as rss:
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
    peak = rss.over
    nbytes = sum(i.nbytes for i in infos)
    del kept
    return {"seconds": seconds, "gb_per_s": nbytes / seconds / 1e9, "bytes": nbytes,
            "reads": len(infos),
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
    p.add_argument("--experts", type=int, default=EXPERTS_PER_LAYER,
                   help="routed experts per synthetic layer")
    p.add_argument("--pack", action="store_true",
                   help="load from the runtime pack of the synthetic checkpoint")
    p.add_argument("--json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    src = Path(args.dir) / "src"
    write_synthetic(src, parse_bytes(args.size), args.experts)
    if args.pack:
        dst = Path(args.dir) / "pack"
        if not is_pack(dst):
            pack(src, dst, progress=False)
        folder = open_checkpoint(dst, verify="size")
    else:
        folder = CheckpointFolder(src)
    runs = [run_once(folder, device, args.buffer_mb * MiB, args.buffers, args.cold)
            for _ in range(args.runs)]
    med = statistics.median(r["gb_per_s"] for r in runs)
    peak = max(r["peak_rss_over_baseline"] for r in runs)
    print(f"{runs[0]['bytes'] / 1e9:.2f} GB from a {'pack' if args.pack else 'folder'} to "
          f"{device}, {'cold' if args.cold else 'warm'} page "
          f"cache: median {med:.2f} GB/s over {len(runs)} runs; peak RSS above baseline "
          f"{peak / MiB:.0f} MiB (staging pool {args.buffer_mb * args.buffers} MiB"
          + (f"; on the CPU also the largest tensor, {runs[0]['largest_tensor_bytes'] / MiB:.0f}"
             " MiB, whose home is RAM)" if device.type == "cpu" else ")"))
    if args.json:
        meta = {"command": "python -m strata.bench.load " + " ".join(sys.argv[1:]),
                "date": time.strftime("%Y-%m-%d"),
                "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                else platform.processor() or platform.machine()}
        meta["source"] = "pack" if args.pack else "folder"
        Path(args.json).write_text(json.dumps({"meta": meta, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
