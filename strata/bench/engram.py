"""Engram store benchmark: random row reads (cold and warm) and cache hit rates.

`python -m strata.bench.engram --file /nvme/engram.bin --size-gb 8` writes a synthetic table
(random bytes; values do not matter for IO) unless a file of the right size is already there,
then measures with the store's real read path (`EngramStore.records`: de-duplication,
coalescing, thread pool; no dequantisation, which is GPU work):

- decode: one request of 24 ids per step (one table's rows for one token), step latency p50/p99
  and rows/s; prefill: requests of 24 × 512 ids, rows/s. Ids are uniform over the table, so the
  row cache is off (cache_bytes=0) and every row is a disk read.
- cold: the page cache is dropped first with posix_fadvise(DONTNEED) (works without root for
  clean, unmapped pages; the report says whether it was issued), reads buffered; and O_DIRECT
  reads, which bypass the page cache entirely (cold by construction), where the filesystem
  allows them.
- warm: the same ids again, buffered, after they were read once (page cache hot).
- Zipf: hit rates of the LRU row cache for a Zipf-like id stream (exponent s over ranks that are
  scattered randomly over the table), for several cache sizes.

Size the file well above RAM for a true cold number on the target box; keep it small in CI.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys
import time
from pathlib import Path

import numpy as np
import torch

from strata.checkpoint.safetensors_io import SafetensorsFile
from strata.engram_store import (INDEX_BYTES_PER_ROW, IO_THREADS, EngramStore, RowSource,
                                  drop_page_cache, record_bytes)

DIM = 256  # V4.1 engram_head_dim: 264-byte records
TOKEN_IDS = 24  # row ids per token per table in V4.1


def table_rows(size_bytes: int, dim: int = DIM) -> int:
    return max(1, size_bytes // record_bytes(dim))


def write_table(path: Path, n_rows: int, layout: str = "packed", dim: int = DIM,
                seed: int = 0, chunk_rows: int = 1 << 16) -> RowSource:
    """Write (or reuse, when the size matches) a synthetic table; return its row source.

    packed: n_rows adjacent records from byte 0. official: one safetensors file with
    `t.weight` F8_E4M3 [n, d] and `t.scale` F8_E8M0 [n, d/32], streamed in chunks so the
    writer's memory stays small whatever the size."""
    path = Path(path)
    s = dim // 32
    if layout == "packed":
        total = n_rows * record_bytes(dim)
        header = b""
    elif layout == "official":
        meta = {"t.weight": {"dtype": "F8_E4M3", "shape": [n_rows, dim],
                             "data_offsets": [0, n_rows * dim]},
                "t.scale": {"dtype": "F8_E8M0", "shape": [n_rows, s],
                            "data_offsets": [n_rows * dim, n_rows * (dim + s)]}}
        h = json.dumps(meta, separators=(",", ":")).encode()
        h += b" " * (-(8 + len(h)) % 8)
        header = struct.pack("<Q", len(h)) + h
        total = len(header) + n_rows * (dim + s)
    else:
        raise ValueError(f"layout {layout!r}: expected 'packed' or 'official'")
    if not (path.is_file() and path.stat().st_size == total):
        rng = np.random.default_rng(seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(header)
            widths = [record_bytes(dim)] if layout == "packed" else [dim, s]
            for width in widths:
                for start in range(0, n_rows, chunk_rows):
                    n = min(chunk_rows, n_rows - start)
                    f.write(rng.integers(0, 255, n * width, dtype=np.uint8).tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    if layout == "packed":
        return RowSource.packed(path, n_rows, dim)
    with SafetensorsFile(path) as f:  # offsets from the header, as for a real checkpoint
        return RowSource.official(f.info("t.weight"), f.info("t.scale"))


def zipf_ids(rng: np.random.Generator, n_rows: int, count: int, s: float,
             perm_seed: int = 1) -> np.ndarray:
    """Zipf-like ids: rank k (1..n) with P ∝ k^-s, drawn by inverting the continuous CDF (O(1)
    memory, fine for 400 M rows), then scattered by a fixed affine map so hot rows are not
    adjacent on disk."""
    u = rng.random(count)
    if abs(s - 1.0) < 1e-9:
        k = np.power(float(n_rows), u)
    else:
        a = 1.0 - s
        k = np.power(u * (n_rows ** a - 1.0) + 1.0, 1.0 / a)
    rank = np.clip(np.floor(k).astype(np.int64) - 1, 0, n_rows - 1)
    # rank → row: multiply by a large odd constant mod n (a bijection when gcd = 1, else close)
    mult = int(np.random.default_rng(perm_seed).integers(n_rows // 3 + 1, n_rows + 2)) | 1
    while np.gcd(mult, n_rows) != 1:
        mult += 2
    return (rank * mult + 7) % n_rows


def _decode_run(store: EngramStore, reqs: np.ndarray) -> dict:
    lat = []
    t0 = time.perf_counter()
    for r in reqs:
        t = time.perf_counter()
        store.records(torch.from_numpy(r))
        lat.append(time.perf_counter() - t)
    wall = time.perf_counter() - t0
    lat_ms = sorted(x * 1e3 for x in lat)
    return {"rows_per_s": reqs.size / wall, "step_ms_p50": statistics.median(lat_ms),
            "step_ms_p99": lat_ms[min(len(lat_ms) - 1, int(0.99 * len(lat_ms)))]}


def _prefill_run(store: EngramStore, reqs: np.ndarray) -> dict:
    store.reset_stats()
    t0 = time.perf_counter()
    for r in reqs:
        store.records(torch.from_numpy(r))
    wall = time.perf_counter() - t0
    st = store.stats()
    return {"rows_per_s": st.rows_read / wall, "unique_rows": st.unique_rows,
            "read_calls": st.read_calls, "bytes_read": st.bytes_read}


def run(file: Path, size_bytes: int, layout: str = "packed", io_threads: int = IO_THREADS,
        decode_steps: int = 2000, prefill_chunks: int = 4, prefill_tokens: int = 512,
        zipf_s: float = 1.0, zipf_ids_count: int = 200_000,
        cache_fractions: tuple[float, ...] = (0.001, 0.01, 0.1), seed: int = 0) -> dict:
    """Run every measurement; returns a JSON-able dict (see the module docstring)."""
    n_rows = table_rows(size_bytes)
    t = time.perf_counter()
    src = write_table(file, n_rows, layout, seed=seed)
    out: dict = {"file": str(file), "layout": layout, "rows": n_rows,
                 "table_bytes": n_rows * record_bytes(DIM), "io_threads": io_threads,
                 "write_or_reuse_s": time.perf_counter() - t}
    rng = np.random.default_rng(seed + 1)
    dec = rng.integers(0, n_rows, (decode_steps, TOKEN_IDS))
    pre = rng.integers(0, n_rows, (prefill_chunks, prefill_tokens * TOKEN_IDS))

    def store(direct: bool) -> EngramStore:
        return EngramStore(src, cache_bytes=0, io_threads=io_threads, direct=direct)

    out["page_cache_drop"] = drop_page_cache(file)
    with store(False) as s:
        out["cold_buffered_decode"] = _decode_run(s, dec)
        out["cold_buffered_prefill"] = _prefill_run(s, pre)
    with store(False) as s:
        out["warm_buffered_decode"] = _decode_run(s, dec)
        out["warm_buffered_prefill"] = _prefill_run(s, pre)
    try:
        with store(True) as s:
            out["direct_decode"] = _decode_run(s, dec)
            out["direct_prefill"] = _prefill_run(s, pre)
            out["direct"] = "O_DIRECT"
    except Exception as e:  # the filesystem refuses O_DIRECT: say so, keep the rest
        out["direct"] = f"not possible: {e}"

    zipf = zipf_ids(rng, n_rows, zipf_ids_count // TOKEN_IDS * TOKEN_IDS, zipf_s)
    out["zipf"] = {"s": zipf_s, "ids": int(zipf.size), "distinct": int(np.unique(zipf).size),
                   "hit_rate_by_cache_rows": {}}
    for frac in cache_fractions:
        rows = max(1, int(n_rows * frac))
        cache = rows * (record_bytes(DIM) + INDEX_BYTES_PER_ROW)
        with EngramStore(src, cache_bytes=cache, io_threads=io_threads, direct=False) as s:
            for r in zipf.reshape(-1, TOKEN_IDS):
                s.records(torch.from_numpy(r))
            out["zipf"]["hit_rate_by_cache_rows"][rows] = round(s.stats().hit_rate, 4)
            out.setdefault("io_mode_zipf", s.io_mode)
    return out


def format_report(r: dict) -> str:
    lines = [f"Engram store benchmark — {r['file']} ({r['layout']}, {r['rows']:,} rows, "
             f"{r['table_bytes'] / 2**20:.0f} MiB), {r['io_threads']} IO threads",
             f"page cache: {r['page_cache_drop']}; O_DIRECT: {r['direct']}",
             "| run | decode rows/s | step p50 ms | step p99 ms | prefill rows/s |",
             "|---|---|---|---|---|"]
    for name, key in (("cold, buffered", "cold_buffered"), ("warm, buffered", "warm_buffered"),
                      ("O_DIRECT", "direct")):
        if f"{key}_decode" in r:
            d, p = r[f"{key}_decode"], r[f"{key}_prefill"]
            lines.append(f"| {name} | {d['rows_per_s']:,.0f} | {d['step_ms_p50']:.3f} | "
                         f"{d['step_ms_p99']:.3f} | {p['rows_per_s']:,.0f} |")
    z = r["zipf"]
    hits = ", ".join(f"{rows:,} rows: {hr:.1%}" for rows, hr in z["hit_rate_by_cache_rows"].items())
    lines.append(f"Zipf s={z['s']} ({z['ids']:,} ids, {z['distinct']:,} distinct) LRU hit rate — "
                 f"{hits}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m strata.bench.engram", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", type=Path, required=True, help="table file (written if needed)")
    ap.add_argument("--size-mb", type=float, default=256.0, help="table size in MiB")
    ap.add_argument("--layout", choices=("packed", "official"), default="packed")
    ap.add_argument("--threads", type=int, default=IO_THREADS)
    ap.add_argument("--decode-steps", type=int, default=2000)
    ap.add_argument("--prefill-chunks", type=int, default=4)
    ap.add_argument("--zipf-s", type=float, default=1.0)
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args(argv)
    # Keep torch to one thread: the benchmark's threads are the IO pool's.
    torch.set_num_threads(1)
    r = run(a.file, int(a.size_mb * 2**20), a.layout, a.threads, a.decode_steps,
            a.prefill_chunks, zipf_s=a.zipf_s)
    r["command"] = " ".join([sys.executable, "-m", "strata.bench.engram"] + sys.argv[1:])
    print(format_report(r))
    if a.json:
        a.json.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
