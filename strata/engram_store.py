"""Disk-resident Engram tables: positional row reads, LRU row cache, prefetch (dspark_engram §2.2-3).

V4.1's two Engram tables are ~101 GB each (384 M rows of 256 e4m3 bytes + 8 ue8m0 bytes), far
more than host RAM, while a token needs only 24 rows per table. So the rows stay on disk and an
`EngramStore` reads exactly the rows asked for:

- A `RowSource` says where every row's raw record (d value bytes, then d/32 scale bytes) lives,
  as one or more `RowPart`s — a byte range per row in some file. The official checkpoint has two
  parts (the `embed.weight` and `embed.scale` tensors, often in different shards: two reads per
  row); the packed layout has one 264-byte record per row (one read per row).
- Reads are positional (`os.preadv`) from a small thread pool, on an O_DIRECT descriptor when
  the filesystem allows it (no page-cache pollution, one device IO per 4 KiB page), else
  buffered. A request's rows are de-duplicated, sorted by offset, and nearby rows coalesced into
  one read, so a prefill chunk costs few IOs.
- Raw records (not dequantised floats: 264 B instead of 1 KiB per row) are kept in an LRU cache
  bounded in bytes, index included.
- `prefetch(ids)` starts reads as soon as ids are known (the next token, a draft block);
  `lookup(ids)` takes cached rows, waits for rows already in flight, and reads only the rest.
  Every read keeps its own buffer until its waiters have copied from it, so results are exact
  whatever the cache holds, even with a cache of a few rows.

Several threads may call lookup/prefetch at once: the cache and the in-flight map share one lock,
and a row is never read by two requests at the same time.
"""
from __future__ import annotations

import mmap
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from strata.checkpoint.encodings import dequant_engram_rows
from strata.checkpoint.safetensors_io import CheckpointFolder, TensorInfo
from strata.checkpoint.weights import WeightReader
from strata.errors import CheckpointError

GROUP = 32  # one ue8m0 scale byte per 32 values (spec §3.3)
ALIGN = 4096  # O_DIRECT offset/length/buffer alignment; 4 KiB satisfies 512 B and 4 KiB devices
# Python cost of one cache index entry (OrderedDict slot + two int objects), measured with
# tracemalloc at ~155 B on CPython 3.11; counted against the cache's byte budget.
INDEX_BYTES_PER_ROW = 160
SCALE_DTYPES = ("F8_E8M0", "U8")
# Threads reading a table's rows. Measured, a cold 20-layer decode on the H200 machine's disk:
# 153.5 tok/s with 4, 129-138 with 8, 121 with 16, ~101 with 32 or 64 (the hand-offs and the
# GIL cost more than the deeper queue gives); the development VM's O_DIRECT reads peaked at 4
# too (bench/results/engram.md).
IO_THREADS = 4


def record_bytes(dim: int) -> int:
    """Bytes of one raw row record: dim e4m3 values, then dim/32 ue8m0 exponents (264 for d=256)."""
    return dim + dim // GROUP


def pack_records(rows: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    """Rows e4m3 [n, d] + scales [n, d/32] → the packed layout's records, uint8 [n, d + d/32]."""
    n, d = rows.shape
    if d % GROUP or tuple(scale.shape) != (n, d // GROUP):
        raise ValueError(f"pack_records: rows {tuple(rows.shape)} need scale [{n}, {d // GROUP}], "
                         f"got {tuple(scale.shape)}")
    out = np.empty((n, record_bytes(d)), dtype=np.uint8)
    out[:, :d] = rows.contiguous().view(torch.uint8).numpy()
    out[:, d:] = scale.contiguous().view(torch.uint8).numpy()
    return out


# ------------------------------------------------------------------------------- row sources


@dataclass(frozen=True)
class RowPart:
    """One piece of every row's record: row r's `width` bytes start at base + r·stride in `path`,
    and go to bytes [column, column + width) of the record."""

    path: Path
    base: int
    stride: int
    width: int
    column: int


@dataclass(frozen=True)
class RowSource:
    """Where a table's n_rows records of record_bytes(dim) bytes live on disk."""

    parts: tuple[RowPart, ...]
    n_rows: int
    dim: int

    @property
    def row_bytes(self) -> int:
        return record_bytes(self.dim)

    @classmethod
    def official(cls, weight: TensorInfo, scale: TensorInfo) -> "RowSource":
        """The checkpoint layout: `<p>.weight` F8_E4M3 [rows, d] and `<p>.scale` F8_E8M0|U8
        [rows, d/32] as separate tensors — two reads per row."""
        if weight.dtype != "F8_E4M3" or len(weight.shape) != 2:
            raise CheckpointError(f"{weight.file}: tensor {weight.name!r} is {weight.dtype} "
                                  f"{list(weight.shape)}; an Engram table needs F8_E4M3 [rows, d]")
        n, d = weight.shape
        if d % GROUP:
            raise CheckpointError(f"{weight.file}: tensor {weight.name!r}: row width {d} is not a "
                                  f"multiple of {GROUP}")
        if scale.dtype not in SCALE_DTYPES or tuple(scale.shape) != (n, d // GROUP):
            raise CheckpointError(f"{scale.file}: tensor {scale.name!r} is {scale.dtype} "
                                  f"{list(scale.shape)}; expected F8_E8M0 or U8 "
                                  f"[{n}, {d // GROUP}]")
        return cls((RowPart(weight.file, weight.offset, d, d, 0),
                    RowPart(scale.file, scale.offset, d // GROUP, d // GROUP, d)), n, d)

    @classmethod
    def packed(cls, path: str | os.PathLike[str], n_rows: int, dim: int,
               offset: int = 0) -> "RowSource":
        """The packed layout: n_rows adjacent records (values then scales) from byte `offset`."""
        if dim <= 0 or dim % GROUP:
            raise CheckpointError(f"{path}: packed Engram row width {dim} is not a positive "
                                  f"multiple of {GROUP}")
        rb = record_bytes(dim)
        return cls((RowPart(Path(path), offset, rb, rb, 0),), n_rows, dim)


# ---------------------------------------------------------------------------------- file IO


class _File:
    """One open file of a row source: a buffered descriptor and, where allowed, an O_DIRECT one."""

    def __init__(self, path: Path, direct: bool | None) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot open Engram table file: {e}") from e
        self.size = os.fstat(self.fd).st_size
        self.direct_fd: int | None = None
        self.note = "buffered (O_DIRECT not requested)"
        if direct is False:
            return
        reason = self._open_direct()
        if reason is not None:
            if direct is True:
                os.close(self.fd)
                raise CheckpointError(
                    f"{path}: O_DIRECT was required but is not possible: {reason}")
            self.note = f"buffered (O_DIRECT unavailable: {reason})"
        else:
            self.note = "O_DIRECT"

    def _open_direct(self) -> str | None:
        """Open with O_DIRECT and prove one aligned read works; the reason it does not, or None.

        Some filesystems (tmpfs, some overlay setups) refuse O_DIRECT at open, others only at
        the first read, so both are tried."""
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return "this platform has no O_DIRECT"
        try:
            fd = os.open(self.path, os.O_RDONLY | flag)
        except OSError as e:
            return f"open failed: {e.strerror}"
        buf = mmap.mmap(-1, ALIGN)  # anonymous maps are page aligned
        try:
            os.preadv(fd, [buf], 0)
        except OSError as e:
            os.close(fd)
            return f"aligned read failed: {e.strerror}"
        finally:
            buf.close()
        self.direct_fd = fd
        return None

    def close(self) -> None:
        for fd in (self.fd, self.direct_fd):
            if fd is not None:
                os.close(fd)
        self.direct_fd = None


class _Batch:
    """One read task: sorted unique row ids, their raw records once read, and who waits."""

    __slots__ = ("ids", "data", "done", "error")

    def __init__(self, ids: np.ndarray, row_bytes: int) -> None:
        self.ids = ids
        self.data = np.empty((ids.size, row_bytes), dtype=np.uint8)
        self.done = threading.Event()
        self.error: BaseException | None = None


@dataclass(frozen=True)
class EngramStats:
    lookups: int            # lookup calls
    rows_requested: int     # ids asked for by lookups, duplicates included
    unique_rows: int        # distinct ids per lookup, summed
    cache_hits: int         # of unique_rows, found in the row cache
    prefetch_hits: int      # of unique_rows, already being read by a prefetch (waited for)
    misses: int             # of unique_rows, read on demand by the lookup
    prefetch_rows: int      # rows whose reads prefetch started
    rows_read: int          # rows read from disk (any reason)
    bytes_read: int         # bytes read from disk, alignment and coalescing gaps included
    read_calls: int         # preadv calls
    io_busy_s: float        # wall time with at least one read in flight
    io_mode: str            # "O_DIRECT", or "buffered (...why...)"

    @property
    def hit_rate(self) -> float:
        """Fraction of looked-up rows served from the cache (prefetched rows count as misses)."""
        return self.cache_hits / self.unique_rows if self.unique_rows else 0.0

    @property
    def rows_per_s(self) -> float:
        return self.rows_read / self.io_busy_s if self.io_busy_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d.update(hit_rate=self.hit_rate, rows_per_s=self.rows_per_s)
        return d


def drop_page_cache(path: Path) -> str:
    """Ask the kernel to drop the file's cached pages; say what was possible."""
    if not hasattr(os, "posix_fadvise"):
        return "not possible (no posix_fadvise on this platform)"
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # only clean pages can be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError as e:
        return f"posix_fadvise(DONTNEED) failed: {e.strerror}"
    finally:
        os.close(fd)
    return "posix_fadvise(DONTNEED) issued"


class EngramStore:
    """An Engram table on disk with the `EngramTable.lookup` interface.

    cache_bytes bounds the row cache (records plus index; 0 disables it). io_threads read in
    parallel (the queue depth the disk sees). direct: None = O_DIRECT where possible, else
    buffered; True = require O_DIRECT; False = buffered. merge_gap_bytes: rows whose byte ranges
    are at most this far apart are fetched with one read (one larger IO beats two on NVMe).
    """

    prefetches = True  # the model starts its reads ahead of the lookups (Model.prefetch_engram)

    def __init__(self, source: RowSource, device: torch.device | str = "cpu", *,
                 cache_bytes: int = 1 << 30, io_threads: int = IO_THREADS,
                 direct: bool | None = None, merge_gap_bytes: int = ALIGN,
                 max_read_bytes: int = 256 * 1024) -> None:
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        if cache_bytes < 0 or merge_gap_bytes < 0 or max_read_bytes < ALIGN:
            raise ValueError("cache_bytes and merge_gap_bytes must be >= 0 and max_read_bytes "
                             f">= {ALIGN}")
        self.source = source
        self.device = torch.device(device)
        self.dim = source.dim
        self.row_bytes = source.row_bytes
        self.io_threads = io_threads
        self.merge_gap = merge_gap_bytes
        self.max_read = max_read_bytes
        self._files: dict[Path, _File] = {}
        try:
            for part in source.parts:
                if part.path not in self._files:
                    self._files[part.path] = _File(part.path, direct)
                f = self._files[part.path]
                end = part.base + (source.n_rows - 1) * part.stride + part.width
                if source.n_rows and (part.base < 0 or end > f.size):
                    raise CheckpointError(
                        f"{part.path}: Engram rows need bytes [{part.base}, {end}) but the file "
                        f"has {f.size} bytes (truncated file or wrong offsets)")
        except BaseException:
            self.close()
            raise
        notes = sorted({f.note for f in self._files.values()})
        self.io_mode = notes[0] if len(notes) == 1 else "; ".join(notes)
        self.direct = all(f.direct_fd is not None for f in self._files.values())

        # (never more slots than the table has rows: a budget above the table's size is the
        # whole table, not an allocation of the budget)
        self.capacity = min(cache_bytes // (self.row_bytes + INDEX_BYTES_PER_ROW),
                            source.n_rows)
        self._slab = np.empty((self.capacity, self.row_bytes), dtype=np.uint8)
        self._index: OrderedDict[int, int] = OrderedDict()  # row id → slab slot, LRU first
        self._used_slots = 0  # slots [0, used) hold rows; once full, the LRU row's slot is reused
        self._inflight: dict[int, _Batch] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="engram-io")
        self._local = threading.local()  # per reader thread: its aligned O_DIRECT buffer
        self._active = 0
        self._busy_since = 0.0
        self._c = dict(lookups=0, rows_requested=0, unique_rows=0, cache_hits=0,
                       prefetch_hits=0, misses=0, prefetch_rows=0, rows_read=0, bytes_read=0,
                       read_calls=0, io_busy_s=0.0)

    @classmethod
    def from_checkpoint(cls, folder: CheckpointFolder, prefix: str,
                        device: torch.device | str = "cpu", **options) -> "EngramStore":
        """The table `<prefix>.weight` / `<prefix>.scale` of a checkpoint folder."""
        for name in (f"{prefix}.weight", f"{prefix}.scale"):
            if not folder.has(name):
                raise CheckpointError(f"tensor {name} is missing from the checkpoint {folder.path}")
        return cls(RowSource.official(folder.info(f"{prefix}.weight"),
                                      folder.info(f"{prefix}.scale")), device, **options)

    # ------------------------------------------------------------------------------ public
    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows [..., d] for ids [...], on the store's device, dequantised exactly like
        `dequant_engram_rows` on the stored bytes."""
        raw = torch.from_numpy(self.records(ids)).to(self.device)  # one host→device copy
        return self.from_records(raw, ids.shape)

    def from_records(self, raw: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """fp32 rows [*shape, d] from records already on the device (uint8 [n, row_bytes], as
        `records` returns them): the part of `lookup` a CUDA graph replays when the records
        were read before it (runtime/static_step.py)."""
        out = dequant_engram_rows(raw[:, :self.dim], raw[:, self.dim:])
        return out.view(*shape, self.dim)

    def records(self, ids: torch.Tensor) -> np.ndarray:
        """The raw records (d e4m3 bytes, then d/32 ue8m0 bytes) of the flattened ids, uint8
        [ids.numel(), row_bytes]: cached rows are copied, rows in flight waited for, the rest
        read now."""
        flat = self._host_ids(ids)
        uniq, inverse = np.unique(flat, return_inverse=True)
        raw = np.empty((uniq.size, self.row_bytes), dtype=np.uint8)
        with self._lock:
            hit_pos, hit_slots, waits, missing = [], [], [], []
            for k, rid in enumerate(uniq.tolist()):
                slot = self._index.get(rid)
                if slot is not None:
                    self._index.move_to_end(rid)
                    hit_pos.append(k)
                    hit_slots.append(slot)
                elif (b := self._inflight.get(rid)) is not None:
                    waits.append((b, k))
                else:
                    missing.append(k)
            # Copy hits now: once the lock is released their slots may be reused.
            raw[hit_pos] = self._slab[hit_slots]
            new = self._start(uniq[missing], keep_first=True) if missing else []
            c = self._c
            c["lookups"] += 1
            c["rows_requested"] += flat.size
            c["unique_rows"] += uniq.size
            c["cache_hits"] += len(hit_pos)
            c["prefetch_hits"] += len(waits)
            c["misses"] += len(missing)
        if new:
            self._run(new[0])  # this thread's share of the reads
        for b in new:
            waits.extend((b, int(k)) for k in np.searchsorted(uniq, b.ids))
        by_batch: dict[int, tuple[_Batch, list[int]]] = {}
        for b, k in waits:
            by_batch.setdefault(id(b), (b, []))[1].append(k)
        for b, ks in by_batch.values():
            b.done.wait()
            if b.error is not None:
                raise CheckpointError(f"Engram row read failed: {b.error}") from b.error
            pos = np.asarray(ks, dtype=np.int64)
            raw[pos] = b.data[np.searchsorted(b.ids, uniq[pos])]
        return raw[inverse.reshape(-1)]

    def prefetch(self, ids: torch.Tensor) -> None:
        """Start reading the rows of ids that are neither cached nor in flight; returns at once.
        Read errors surface in the lookup that needs the row (it reads again)."""
        uniq = np.unique(self._host_ids(ids))
        with self._lock:
            todo = [rid for rid in uniq.tolist()
                    if rid not in self._index and rid not in self._inflight]
            if todo:
                self._start(np.asarray(todo, dtype=np.int64))
                self._c["prefetch_rows"] += len(todo)

    def stats(self) -> EngramStats:
        with self._lock:
            c = dict(self._c)
            if self._active:
                c["io_busy_s"] += time.perf_counter() - self._busy_since
        return EngramStats(**c, io_mode=self.io_mode)

    def reset_stats(self) -> None:
        with self._lock:
            for k in self._c:
                self._c[k] = 0.0 if k == "io_busy_s" else 0
            self._busy_since = time.perf_counter()

    def clear_cache(self) -> None:
        with self._lock:
            self._index.clear()
            self._used_slots = 0

    def drop_caches(self) -> str:
        """Start cold, as after a restart on a box whose page cache no longer holds the table
        (benchmarks: `strata bench synthetic --engram-cache cold`): the row cache cleared and
        the kernel asked to drop the files' cached pages; says what was possible."""
        self.clear_cache()
        return "; ".join(sorted({drop_page_cache(path) for path in self._files}))

    @property
    def cached_rows(self) -> int:
        return len(self._index)

    def close(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        for f in self._files.values():
            f.close()
        self._files = {}

    def __enter__(self) -> "EngramStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------- helpers
    def _host_ids(self, ids: torch.Tensor) -> np.ndarray:
        flat = torch.as_tensor(ids).reshape(-1).to("cpu", torch.int64).numpy()
        if flat.size and (flat.min() < 0 or flat.max() >= self.source.n_rows):
            bad = int(flat[(flat < 0) | (flat >= self.source.n_rows)][0])
            raise IndexError(f"{self.source.parts[0].path}: Engram row id {bad} out of range "
                             f"[0, {self.source.n_rows})")
        return flat

    def _start(self, ids: np.ndarray, keep_first: bool = False) -> list[_Batch]:
        """Register sorted unique ids as in flight and queue their reads (caller holds the lock).

        The ids are cut into up to io_threads batches, one per thread (the queue depth the disk
        sees); a waiter needs only the batches holding its rows. keep_first: the first batch is
        not queued — the calling thread reads it itself, saving a thread hand-off."""
        n_batches = min(ids.size, self.io_threads)
        batches = [_Batch(chunk, self.row_bytes) for chunk in np.array_split(ids, n_batches)]
        for i, b in enumerate(batches):
            for rid in b.ids.tolist():
                self._inflight[rid] = b
            if i or not keep_first:
                self._pool.submit(self._run, b)
        return batches

    def _run(self, b: _Batch) -> None:
        """Pool task: read a batch, then publish it to the cache and wake its waiters."""
        with self._lock:
            if self._active == 0:
                self._busy_since = time.perf_counter()
            self._active += 1
        nbytes = calls = 0
        try:
            nbytes, calls = self._read_into(b.ids, b.data)
        except BaseException as e:  # handed to the waiters; never lost in the pool
            b.error = e
        finally:
            with self._lock:
                for rid in b.ids.tolist():
                    if self._inflight.get(rid) is b:
                        del self._inflight[rid]
                if b.error is None:
                    self._insert(b)
                    self._c["rows_read"] += b.ids.size
                self._c["bytes_read"] += nbytes
                self._c["read_calls"] += calls
                self._active -= 1
                if self._active == 0:
                    self._c["io_busy_s"] += time.perf_counter() - self._busy_since
            b.done.set()

    def _insert(self, b: _Batch) -> None:
        """Put a batch's records in the LRU (caller holds the lock)."""
        if self.capacity == 0:
            return
        # Rows beyond the capacity would only evict this batch's own earlier rows.
        first = max(0, b.ids.size - self.capacity)
        slots, rows = [], []
        for k, rid in enumerate(b.ids[first:].tolist(), start=first):
            slot = self._index.get(rid)
            if slot is not None:
                self._index.move_to_end(rid)
            elif self._used_slots < self.capacity:
                slot = self._used_slots
                self._used_slots += 1
                self._index[rid] = slot
            else:
                _, slot = self._index.popitem(last=False)
                self._index[rid] = slot
            slots.append(slot)
            rows.append(k)
        self._slab[slots] = b.data[rows]

    def _buffer(self, nbytes: int) -> memoryview:
        """This thread's page-aligned read buffer, at least nbytes long."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            # The old map is dropped, not closed: views of it may still be alive.
            buf = mmap.mmap(-1, max(nbytes, self.max_read + 2 * ALIGN))
            self._local.buf = buf
        return memoryview(buf)[:nbytes]

    def _read_into(self, ids: np.ndarray, data: np.ndarray) -> tuple[int, int]:
        """Fill data [n, row_bytes] with the records of sorted ids; returns (bytes read, calls).

        Plain Python on lists and memoryviews (no numpy per row): this loop runs once per row
        on a random-access workload and, holding the GIL, bounds the rows/s of all threads."""
        total = calls = 0
        rb = self.row_bytes
        dst = memoryview(data).cast("B")
        for part in self.source.parts:
            f = self._files[part.path]
            direct = f.direct_fd is not None
            fd = f.direct_fd if direct else f.fd
            w, col = part.width, part.column
            offs = (part.base + ids * part.stride).tolist()
            # The byte span each row needs; O_DIRECT reads whole aligned pages.
            if direct:
                lo = [o // ALIGN * ALIGN for o in offs]
                hi = [-(-(o + w) // ALIGN) * ALIGN for o in offs]
            else:
                lo, hi = offs, [o + w for o in offs]
            n_ids, i0 = len(offs), 0
            while i0 < n_ids:
                # Extend a run over rows that are close by and fit the read size cap.
                start, end, i1 = lo[i0], hi[i0], i0 + 1
                while (i1 < n_ids and lo[i1] <= end + self.merge_gap
                       and hi[i1] - start <= self.max_read):
                    end = max(end, hi[i1])
                    i1 += 1
                need = offs[i1 - 1] + w - start  # bytes the run must deliver
                # A lone buffered row goes straight to its place; anything else via a buffer.
                lone = i1 == i0 + 1 and not direct
                buf = dst[i0 * rb + col:i0 * rb + col + w] if lone else self._buffer(end - start)
                got = 0
                while got < need:
                    # O_DIRECT lengths must stay aligned, so ask for the rest of the aligned span.
                    n = os.preadv(fd, [buf[got:]], start + got)
                    calls += 1
                    if n <= 0:
                        raise CheckpointError(
                            f"{part.path}: unexpected end of file reading Engram rows "
                            f"{int(ids[i0])}..{int(ids[i1 - 1])} at byte {start + got} "
                            f"(file truncated after open?)")
                    got += n
                total += got
                if not lone:
                    for i in range(i0, i1):
                        r = offs[i] - start
                        dst[i * rb + col:i * rb + col + w] = buf[r:r + w]
                i0 = i1
        return total, calls


class EngramDiskWeights(WeightReader):
    """A WeightReader that leaves the Engram tables on disk (`Model.load(engram="disk")`):
    `Engram` asks it for a store instead of reading the table tensors."""

    def __init__(self, *args, store_options: dict | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)  # WeightReader's own arguments, unchanged
        self.store_options = dict(store_options or {})  # EngramStore keywords
        self.stores: list[EngramStore] = []

    def engram_table(self, prefix: str, n_rows: int, dim: int) -> EngramStore:
        """The store of `<prefix>.weight` / `<prefix>.scale`, checked against [n_rows, dim]:
        from a runtime pack its record file (one read per row), else the two tensors."""
        packed = getattr(self.folder, "engram_tables", {}).get(prefix)
        if packed is not None:
            if packed.record_bytes != record_bytes(packed.dim):
                raise CheckpointError(f"{packed.path}: Engram records of {packed.record_bytes} B "
                                      f"do not hold rows of {packed.dim} values + scales")
            store = EngramStore(RowSource.packed(packed.path, packed.rows, packed.dim),
                                self.device, **self.store_options)
        else:
            store = EngramStore.from_checkpoint(self.folder, prefix, self.device,
                                                **self.store_options)
        if (store.source.n_rows, store.dim) != (n_rows, dim):
            store.close()
            info = self.folder.info(f"{prefix}.weight")
            raise CheckpointError(f"{info.file}: tensor {prefix}.weight has shape "
                                  f"{list(info.shape)}; expected {[n_rows, dim]}")
        self.used.update((f"{prefix}.weight", f"{prefix}.scale"))
        self.stores.append(store)
        return store
