"""The runtime pack: a checkpoint converted once into the engine's layout, bit for bit.

`strata pack SRC DST` (`pack(src, dst)`) reads an official (fp8/fp4) or EXL3 (full or
routed-only) checkpoint folder and writes DST, a folder that `Model.load` reads directly
(`open_checkpoint`). No quantized bit changes: every stored byte of every tensor is copied as
is — nothing is dequantized, requantized, transposed or re-tiled. What changes is where the
bytes sit:

- One safetensors file per unit, written with our own header encoder: `globals.safetensors`
  (embed, head, final norm, anything outside a layer), `layer-NNN.safetensors` per backbone
  layer, `mtp-K.safetensors` per DSpark stage. A layer's tensors are then one sequential read.
- Routed experts stacked per layer (DSpark stages too): the E per-expert tensors
  `<p>.experts.{e}.<proj>.<suffix>` become one tensor `<p>.experts.<proj>.<suffix>` of shape
  [E, *expert shape], experts in order, each expert's bytes unchanged and contiguous — e.g.
  `layers.3.ffn.experts.w1.trellis` I16 [E, k/16, n/16, 16K] (EXL3; `.suh` [E, k], `.svh`
  [E, n], the codebook marker [E]) or `layers.3.ffn.experts.w1.weight` I8 [E, out, in/2] +
  `.scale` [E, out, in/32] (fp4). EXL3 trellis tiles keep their stored order (row-major
  [k/16][n/16] tiles, ring order inside a tile): our Triton kernels read the tiles as stored,
  so the pack needs no tile permutation. A group whose experts differ in dtype, shape or
  tensor set (e.g. per-expert bit widths) is kept per expert.
- Engram tables: `<p>.engram.embed.weight` (e4m3 [rows, d]) + `.scale` (ue8m0 [rows, d/32])
  become `layer-NNN.engram`, a raw file of `rows` adjacent records of d + d/32 bytes (264 for
  d = 256): the row's values, then its scales, so one positional read fetches a row
  (strata.engram_store.RowSource.packed).
- Config, tokenizer and other small top-level files (not weights) are copied as is, plus
  `inference/config.json` when present.
- `strata-pack.json`, the manifest, written last and atomically: format and version, the
  source path and format, the checksum algorithm (sha256: `sha256sum` can check a file by
  hand), and per file its name, kind (safetensors | engram | copy), byte size, checksum,
  mtime, the digest of the source bytes it was made from, and what it holds (tensor names and
  stacked groups with their expert counts; an Engram table's prefix, rows, dim, record bytes).

Resumable: each output is written to `<name>.tmp`, fsynced and renamed, and its record is
added to `strata-pack.partial.json` (rewritten atomically) before the next file starts. A new
run over the same DST takes the records of the partial journal (and of an old manifest), and
skips every planned file whose record has the same source digest and size and whose checksum,
recomputed from the file, still matches; everything else is rewritten. The final manifest
replaces the journal only when every file is done, so a pack without `strata-pack.json` is
refused at load ("interrupted: run strata pack again").

Bounded memory: the writer never holds a shard or a tensor. A reader thread fills a few fixed
buffers (default 4 × 32 MiB) with positional reads of the source ranges (Engram rows are
interleaved into records inside a buffer), the calling thread hashes and writes them in order.
Host memory is the pool plus a small scratch, whatever the checkpoint size. A tqdm bar shows
bytes and GB/s. Free disk space is checked against the planned size before anything is written.

Loading: `PackFolder` has the CheckpointFolder interface over the *source* names, so
WeightReader and the model code load a pack unchanged: an expert's `...experts.{e}.w1.trellis`
is a view at offset e·stride into the stacked tensor (`stacked_info` gives the whole [E, ...]
tensor, which `WeightReader.stacked` loads in one read); an Engram `.weight` / `.scale` is a
strided column of the record file (`RecordColumnInfo`, read by `WeightReader.tensor` in
record chunks) and `engram_tables` gives EngramDiskWeights the record file itself. Opening a
pack checks the manifest against the files before any weight is read: verify="size" (default:
existence and byte size; a file whose mtime differs from the record is also checksummed, so an
in-place edit is caught), "full" (every checksum; `strata pack --verify DST`), or "none". Every
mismatch is a CheckpointError naming the file.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from strata.checkpoint.safetensors_io import (INDEX_NAME, ST_DTYPES,
                                              CheckpointFolder, TensorInfo, _byte_view,
                                              _pread_exact, encode_header)
from strata.errors import CheckpointError

MANIFEST_NAME = "strata-pack.json"
PARTIAL_NAME = "strata-pack.partial.json"
PACK_FORMAT = "strata-pack"
PACK_VERSION = 1
CHECKSUM = "sha256"
VERIFY_MODES = ("none", "size", "full")
DEFAULT_PACK_BUFFER_BYTES = 32 << 20
DEFAULT_PACK_BUFFERS = 4
ENGRAM_GROUP = 32  # one ue8m0 scale byte per 32 e4m3 values (strata.engram_store.GROUP)
FORMAT_OFFICIAL = "official (fp8 dense, fp4 experts, fp8 Engram)"

# Files never copied from the source folder: weights (handled tensor by tensor or not ours).
_SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".tmp")
_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>[^.]+)\.(?P<suffix>[^.]+)$")
_UNIT = re.compile(r"^(?P<kind>layers|mtp)\.(?P<i>\d+)\.")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")


def engram_record_bytes(dim: int) -> int:
    """Bytes of one packed Engram record: dim values + dim/32 scales (264 for dim 256)."""
    return dim + dim // ENGRAM_GROUP


def is_pack(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a strata pack (complete or interrupted)."""
    p = Path(path)
    return (p / MANIFEST_NAME).is_file() or (p / PARTIAL_NAME).is_file()


def open_checkpoint(path: str | os.PathLike[str], verify: str = "size") -> CheckpointFolder:
    """A pack (files checked against the manifest as `verify` asks) or a checkpoint folder;
    either way with every header validated, before any weight is read."""
    folder = PackFolder(path, verify=verify) if is_pack(path) else CheckpointFolder(path)
    try:
        folder.validate()
    except BaseException:
        folder.close()
        raise
    return folder


def checkpoint_format(folder: CheckpointFolder) -> str:
    """"official (...)", "EXL3 full", "EXL3 routed-only", "unquantized", or "pack of X"."""
    if isinstance(folder, PackFolder):
        return f"pack of {folder.source_format}"
    names = folder.names()
    trellis = [n for n in names if n.endswith(".trellis")]
    if trellis:
        return "EXL3 routed-only" if all(".ffn.experts." in n for n in trellis) else "EXL3 full"
    dtypes = {folder.info(n).dtype for n in names}
    if dtypes & {"F8_E4M3", "I8"}:
        return FORMAT_OFFICIAL
    return "unquantized"


# ------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class _Table:
    """An Engram table of the source: fp8 rows + per-32 scales, two tensors."""

    prefix: str
    weight: TensorInfo
    scale: TensorInfo

    @property
    def rows(self) -> int:
        return self.weight.shape[0]

    @property
    def dim(self) -> int:
        return self.weight.shape[1]


@dataclass
class _Entry:
    """One tensor of a pack safetensors file and the source tensors whose bytes it holds."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    sources: list[TensorInfo]
    experts: int | None = None  # stacked: the expert count


@dataclass
class _Planned:
    """One output file of the pack: what it holds and its exact size."""

    name: str
    kind: str  # safetensors | engram | copy
    size: int = 0
    source_digest: str = ""
    entries: list[_Entry] = field(default_factory=list)
    header: bytes = b""
    table: _Table | None = None
    src: Path | None = None

    def record(self) -> dict:
        """The manifest record, less checksum and mtime."""
        r: dict = {"name": self.name, "kind": self.kind, "bytes": self.size,
                   "source_digest": self.source_digest}
        if self.kind == "safetensors":
            r["tensors"] = [e.name for e in self.entries]
            r["stacked"] = {e.name: e.experts for e in self.entries if e.experts is not None}
        elif self.kind == "engram":
            t = self.table
            assert t is not None
            r.update(table=t.prefix, rows=t.rows, dim=t.dim,
                     record_bytes=engram_record_bytes(t.dim), scale_dtype=t.scale.dtype)
        return r


def _engram_tables(folder: CheckpointFolder) -> dict[str, _Table]:
    """Engram tables in the record-compatible encoding (others stay plain tensors)."""
    tables: dict[str, _Table] = {}
    for name in folder.names():
        if not (name.endswith(".embed.weight") and ".engram." in name):
            continue
        prefix = name[:-len(".weight")]
        if not folder.has(f"{prefix}.scale"):
            continue
        w, s = folder.info(name), folder.info(f"{prefix}.scale")
        if (w.dtype == "F8_E4M3" and len(w.shape) == 2 and w.shape[1] % ENGRAM_GROUP == 0
                and w.shape[1] > 0 and s.dtype in ("F8_E8M0", "U8")
                and tuple(s.shape) == (w.shape[0], w.shape[1] // ENGRAM_GROUP)):
            tables[prefix] = _Table(prefix, w, s)
    return tables


def _expert_stacks(folder: CheckpointFolder) -> dict[str, _Entry]:
    """Stacked tensors by the name of their expert-0 member (where the stack goes)."""
    groups: dict[tuple[str, str], dict[int, dict[str, str]]] = {}
    for name in folder.names():
        m = _EXPERT.match(name)
        if m:
            by_e = groups.setdefault((m["prefix"], m["proj"]), {})
            by_e.setdefault(int(m["e"]), {})[m["suffix"]] = name
    stacks: dict[str, _Entry] = {}
    for (prefix, proj), by_e in groups.items():
        E = len(by_e)
        if sorted(by_e) != list(range(E)):
            continue  # experts missing: keep them as stored
        suffixes = list(by_e[0])
        if any(set(by_e[e]) != set(suffixes) for e in range(E)):
            continue
        members = {s: [folder.info(by_e[e][s]) for e in range(E)] for s in suffixes}
        if any(len({(i.dtype, i.shape) for i in infos}) != 1 for infos in members.values()):
            continue  # e.g. experts at different bit widths
        for s, infos in members.items():
            stacks[infos[0].name] = _Entry(f"{prefix}.{proj}.{s}", infos[0].dtype,
                                           (E, *infos[0].shape), infos, E)
    return stacks


def _unit_of(name: str) -> tuple[int, int, str]:
    """(order, index, file stem) of the unit a tensor belongs to."""
    m = _UNIT.match(name)
    if not m:
        return (0, 0, "globals")
    i = int(m["i"])
    return (1, i, f"layer-{i:03d}") if m["kind"] == "layers" else (2, i, f"mtp-{i}")


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _copy_names(src: Path) -> list[str]:
    """Top-level non-weight files (config, tokenizer, ...) and inference/config.json."""
    out = []
    for p in sorted(src.iterdir()):
        if (p.name.startswith(".") or not p.is_file() or p.name.endswith(_SKIP_SUFFIXES)
                or p.name in (INDEX_NAME, MANIFEST_NAME, PARTIAL_NAME)):
            continue
        out.append(p.name)
    if (src / "inference" / "config.json").is_file():
        out.append("inference/config.json")
    return out


def plan_pack(folder: CheckpointFolder) -> list[_Planned]:
    """Every file of the pack of `folder`, with exact sizes (headers only; no data read)."""
    src = folder.path
    tables = _engram_tables(folder)
    table_names = {n for p in tables for n in (f"{p}.weight", f"{p}.scale")}
    stacks = _expert_stacks(folder)
    members = {i.name for e in stacks.values() for i in e.sources}
    units: dict[tuple[int, int, str], list[_Entry]] = {}
    for name in folder.names():
        if name in table_names or (name in members and name not in stacks):
            continue
        entry = stacks.get(name)
        if entry is None:
            info = folder.info(name)
            entry = _Entry(name, info.dtype, tuple(info.shape), [info])
        units.setdefault(_unit_of(name), []).append(entry)

    file_stats: dict[Path, tuple[int, int]] = {}

    def where(i: TensorInfo) -> list:
        """What identifies a source tensor's bytes, for the resume check: its place, and its
        file's size and modification time (a shard replaced by another of the same size — a
        re-download — changes the time, so the files made from it are written again)."""
        if i.file not in file_stats:
            st = i.file.stat()
            file_stats[i.file] = (st.st_size, st.st_mtime_ns)
        rel = i.file.relative_to(src).as_posix() if i.file.is_relative_to(src) else str(i.file)
        return [rel, i.offset, i.nbytes, *file_stats[i.file]]

    planned: list[_Planned] = []
    for name in _copy_names(src):
        st = (src / name).stat()
        planned.append(_Planned(name, "copy", st.st_size,
                                _digest(["copy", name, st.st_size, st.st_mtime_ns]),
                                src=src / name))
    for (_, _, stem), entries in sorted(units.items()):
        fname = f"{stem}.safetensors"
        head, sizes = encode_header([(e.name, e.dtype, e.shape) for e in entries],
                                    {"format": "pt", "strata_pack": str(PACK_VERSION)}, fname)
        for e, n in zip(entries, sizes):
            if n != sum(i.nbytes for i in e.sources):
                raise CheckpointError(f"{e.sources[0].file}: tensor {e.name}: sizes do not add up")
        planned.append(_Planned(
            fname, "safetensors", len(head) + sum(sizes),
            _digest(["safetensors", PACK_VERSION,
                     [[e.name, e.dtype, list(e.shape), [where(i) for i in e.sources]]
                      for e in entries]]),
            entries, head))
    used_names = {p.name for p in planned}
    for prefix, t in sorted(tables.items(), key=lambda kv: _unit_of(kv[0])):
        order, _, stem = _unit_of(prefix + ".")
        fname = f"{stem}.engram" if order == 1 and prefix.endswith(".engram.embed") else \
            f"{prefix}.engram"
        if fname in used_names:
            fname = f"{prefix}.engram"
        used_names.add(fname)
        planned.append(_Planned(
            fname, "engram", t.rows * engram_record_bytes(t.dim),
            _digest(["engram", PACK_VERSION, t.prefix, where(t.weight), where(t.scale),
                     t.weight.dtype, t.scale.dtype, list(t.weight.shape)]), table=t))
    return planned


def pack_bytes(folder: CheckpointFolder) -> int:
    """Disk space the pack of `folder` takes (all files, manifest aside)."""
    return sum(p.size for p in plan_pack(folder))


# ------------------------------------------------------------------------------ writing


class _Pipe:
    """Fixed buffers filled by one reader thread, hashed and written by the caller in order."""

    def __init__(self, buffer_bytes: int, n_buffers: int, bar) -> None:
        if buffer_bytes < 4096 or n_buffers < 1:
            raise ValueError(f"pack buffers {n_buffers} × {buffer_bytes} bytes: need at least "
                             "one of ≥ 4096 bytes")
        self.buffer_bytes, self.n_buffers, self.bar = buffer_bytes, n_buffers, bar
        self._buffers: list[memoryview] = []
        self._free: deque[memoryview] = deque()
        self._fds: dict[Path, int] = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="strata-pack")

    def close(self) -> None:
        self._reader.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._buffers.clear()
        self._free.clear()

    def fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(f"{path}: cannot open source file: {e}") from e
        return fd

    # A batch is (nbytes, [fill(buffer view)]) whose fills write disjoint parts of [0, nbytes).
    def range_batches(self, ranges: Iterable[tuple[TensorInfo, int, int]]
                      ) -> Iterable[tuple[int, list[Callable[[memoryview], None]]]]:
        """Batches copying (tensor, start, n) byte ranges back to back, ≤ one buffer each."""
        fills: list[Callable[[memoryview], None]] = []
        used = 0
        for info, start, n in ranges:
            while n > 0:
                if used == self.buffer_bytes:
                    yield used, fills
                    fills, used = [], 0
                take = min(n, self.buffer_bytes - used)
                what = (f"tensor {info.name!r}" if take == info.nbytes
                        else f"bytes {start}..{start + take} of tensor {info.name!r}")
                fills.append(functools.partial(self._read_range, info.file, info.offset + start,
                                               used, take, what))
                used += take
                start += take
                n -= take
        if used:
            yield used, fills

    def _read_range(self, path: Path, offset: int, at: int, n: int, what: str,
                    buf: memoryview) -> None:
        _pread_exact(self.fd(path), buf[at:at + n], offset, path, what)

    def record_batches(self, t: _Table) -> Iterable[tuple[int, list[Callable[[memoryview], None]]]]:
        rb = engram_record_bytes(t.dim)
        per = max(1, self.buffer_bytes // rb)
        for r0 in range(0, t.rows, per):
            r1 = min(t.rows, r0 + per)
            yield (r1 - r0) * rb, [functools.partial(self._read_records, t, r0, r1)]

    def _read_records(self, t: _Table, r0: int, r1: int, buf: memoryview) -> None:
        """Rows r0..r1 of the table as records: values, then scales, row after row."""
        d, g = t.dim, t.dim // ENGRAM_GROUP
        n = r1 - r0
        vals = np.empty((n, d), dtype=np.uint8)
        scales = np.empty((n, g), dtype=np.uint8)
        for arr, info, w in ((vals, t.weight, d), (scales, t.scale, g)):
            _pread_exact(self.fd(info.file), memoryview(arr).cast("B"), info.offset + r0 * w,
                         info.file, f"rows {r0}..{r1 - 1} of tensor {info.name!r}")
        rec = np.frombuffer(buf, dtype=np.uint8, count=n * (d + g)).reshape(n, d + g)
        rec[:, :d] = vals
        rec[:, d:] = scales

    def _buffer(self) -> memoryview | None:
        if self._free:
            return self._free.popleft()
        if len(self._buffers) < self.n_buffers:
            buf = memoryview(bytearray(self.buffer_bytes))
            self._buffers.append(buf)
            return buf
        return None

    @staticmethod
    def _fill(buf: memoryview, fills: list[Callable[[memoryview], None]]) -> None:
        for f in fills:
            f(buf)

    def write(self, out: Path, head: bytes, batches: Iterable) -> tuple[int, str]:
        """Write head + the batches' bytes to `out` (via out.tmp, fsynced, renamed);
        returns (size, checksum)."""
        tmp = out.with_name(out.name + ".tmp")
        out.parent.mkdir(parents=True, exist_ok=True)
        h = hashlib.new(CHECKSUM)
        pending: deque[tuple[Future, memoryview, int]] = deque()
        size = 0
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            def drain() -> None:
                nonlocal size
                fut, buf, n = pending.popleft()
                try:
                    fut.result()
                    view = buf[:n]
                    h.update(view)
                    _write_all(fd, view, tmp)
                finally:
                    self._free.append(buf)
                size += n
                if self.bar is not None:
                    self.bar.update(n)

            if head:
                h.update(head)
                _write_all(fd, memoryview(head), tmp)
                size += len(head)
                if self.bar is not None:
                    self.bar.update(len(head))
            try:
                for n, fills in batches:
                    buf = self._buffer()
                    if buf is None:
                        drain()
                        buf = self._free.popleft()
                    pending.append((self._reader.submit(self._fill, buf, fills), buf, n))
                while pending:
                    drain()
            except BaseException:
                for fut, buf, _ in pending:  # no buffer may be written after we return
                    try:
                        fut.result()
                    except BaseException:
                        pass
                    self._free.append(buf)
                pending.clear()
                raise
            os.fsync(fd)
            if hasattr(os, "posix_fadvise"):  # written and durable: no need to cache it
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, out)
        return size, h.hexdigest()


def _write_all(fd: int, view: memoryview, path: Path) -> None:
    done = 0
    while done < len(view):
        try:
            done += os.write(fd, view[done:])
        except OSError as e:
            raise CheckpointError(f"{path}: write failed: {e}") from e


def _write_json(path: Path, obj: dict) -> None:
    """Atomically replace `path` with obj as JSON."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def file_checksum(path: Path, bar=None, buffer_bytes: int = 8 << 20) -> str:
    """The file's checksum (CHECKSUM), streamed through one small buffer."""
    h = hashlib.new(CHECKSUM)
    buf = memoryview(bytearray(buffer_bytes))
    try:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(buf[:n])
                if bar is not None:
                    bar.update(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read pack file: {e}") from e
    return h.hexdigest()


def _bar(total: int, desc: str, progress: bool | None):
    if progress is False:
        return None
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=desc,
                disable=None if progress is None else False, dynamic_ncols=True)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read the pack manifest: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: the pack manifest is not a JSON object")
    return data


@dataclass
class PackResult:
    path: Path
    written: list[str]    # files written by this run
    reused: list[str]     # files kept from an earlier (interrupted) run, checksums verified
    bytes: int            # pack size
    seconds: float


def check_loadable(src: Path) -> None:
    """Build the model of `src` on the meta device: its config, tokenizer and every tensor's
    name, dtype and shape checked as loading checks them, no weight read — a checkpoint
    missing a tensor is refused before hours of packing, not after."""
    from strata.errors import StrataError
    from strata.model.model import Model
    try:
        Model.load(src, device="meta", verify="none")
    except StrataError:
        raise  # (the loader's own refusal: it names the tensor or field)
    except Exception as e:  # a step that needs data on meta: a gap in the dry run, not the files
        warnings.warn(f"{src}: the dry-run load stopped ({type(e).__name__}: {e}); packing "
                      "without checking every tensor first", stacklevel=2)


def pack(src: str | os.PathLike[str], dst: str | os.PathLike[str], *,
         buffer_bytes: int = DEFAULT_PACK_BUFFER_BYTES, n_buffers: int = DEFAULT_PACK_BUFFERS,
         progress: bool | None = None) -> PackResult:
    """Convert the checkpoint folder `src` into the pack `dst` (resuming an earlier run there).

    progress: True shows a bar (bytes, GB/s) on stderr, False never, None when a terminal."""
    t0 = time.perf_counter()
    src, dst = Path(src), Path(dst)
    if is_pack(src):
        raise CheckpointError(f"{src}: is already a strata pack")
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(f"{dst}: exists and is not a folder")
    if dst.exists() and dst.resolve() == src.resolve():
        raise CheckpointError(f"{dst}: the pack must go to another folder than its source")
    if dst.is_dir() and any(dst.iterdir()) and not is_pack(dst):
        raise CheckpointError(f"{dst}: folder is not empty and holds no strata pack; refusing "
                              "to write into it")
    if any((src / c).is_file() for c in ("config.json", "inference/config.json")):
        check_loadable(src)  # (a checkpoint the engine cannot load: said before the work)
    folder = CheckpointFolder(src)
    try:
        folder.validate()
        source_format = checkpoint_format(folder)
        planned = plan_pack(folder)
        source_bytes = folder.total_bytes()
    except BaseException:
        folder.close()
        raise
    folder.close()

    # Records of files finished by earlier runs: the final manifest, then the newer journal.
    old: dict[str, dict] = {}
    for journal in (dst / MANIFEST_NAME, dst / PARTIAL_NAME):
        if journal.is_file():
            try:
                data = _read_json(journal)
            except CheckpointError:
                continue  # an unreadable journal only means nothing is reused
            was = (data.get("source") or {}).get("path") if isinstance(data, dict) else None
            if isinstance(was, str) and Path(was) != src.resolve():
                # (resuming is for the same source; another model's pack is not overwritten)
                raise CheckpointError(f"{dst}: holds a pack of {was}, not of {src.resolve()}; "
                                      "pack into another folder, or remove that one first")
            if data.get("format") == PACK_FORMAT and data.get("version") == PACK_VERSION:
                old.update({r["name"]: r for r in data.get("files", [])
                            if isinstance(r, dict) and isinstance(r.get("name"), str)})

    def reusable(p: _Planned) -> dict | None:
        r = old.get(p.name)
        path = dst / p.name
        if (r is None or r.get("source_digest") != p.source_digest or r.get("bytes") != p.size
                or r.get("kind") != p.kind or not path.is_file()
                or path.stat().st_size != p.size):
            return None
        return r

    dst.mkdir(parents=True, exist_ok=True)
    total = sum(p.size for p in planned)
    need = sum(p.size for p in planned if reusable(p) is None)
    free = shutil.disk_usage(dst).free
    if need > free:
        raise CheckpointError(f"{dst}: the pack needs {need / 1e9:.2f} GB more disk space but "
                              f"only {free / 1e9:.2f} GB are free there")
    head = {"format": PACK_FORMAT, "version": PACK_VERSION, "complete": False,
            "source": {"path": str(src.resolve()), "format": source_format,
                       "tensor_bytes": source_bytes},
            "checksum": CHECKSUM}
    done: list[dict] = []
    # From here on the journal is the truth: an old manifest must not outlive a partial rewrite.
    _write_json(dst / PARTIAL_NAME, dict(head, files=list(old.values())))
    (dst / MANIFEST_NAME).unlink(missing_ok=True)

    bar = _bar(total, f"packing {dst.name}", progress)
    pipe = _Pipe(buffer_bytes, n_buffers, bar)
    written, reused = [], []
    try:
        for p in planned:
            path = dst / p.name
            r = reusable(p)
            if r is not None and file_checksum(path, bar) == r.get(CHECKSUM):
                rec = dict(r, mtime_ns=path.stat().st_mtime_ns)
                reused.append(p.name)
            else:
                size, digest = _write_planned(pipe, p, path)
                if size != p.size:
                    raise CheckpointError(f"{path}: wrote {size} bytes, planned {p.size}")
                rec = dict(p.record(), **{CHECKSUM: digest, "mtime_ns": path.stat().st_mtime_ns})
                written.append(p.name)
            done.append(rec)
            _write_json(dst / PARTIAL_NAME,
                        dict(head, files=done + [v for k, v in old.items()
                                                 if k not in {d["name"] for d in done}]))
    finally:
        pipe.close()
        if bar is not None:
            bar.close()
    names = {p.name for p in planned}
    for n in names:
        (dst / (n + ".tmp")).unlink(missing_ok=True)
    for stale in old:  # files of an earlier plan that this one no longer has
        if stale not in names and _SAFE_NAME.match(stale) and ".." not in stale.split("/"):
            (dst / stale).unlink(missing_ok=True)
    _write_json(dst / MANIFEST_NAME, dict(head, complete=True, total_bytes=total,
                                          created=time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                time.gmtime()),
                                          files=done))
    (dst / PARTIAL_NAME).unlink(missing_ok=True)
    return PackResult(dst, written, reused, total, time.perf_counter() - t0)


def _write_planned(pipe: _Pipe, p: _Planned, path: Path) -> tuple[int, str]:
    """Write one planned file (one function, so tests can interrupt a pack between files)."""
    if p.kind == "copy":
        assert p.src is not None
        info = TensorInfo(p.name, "U8", (p.size,), p.src, 0, p.size)
        return pipe.write(path, b"", pipe.range_batches([(info, 0, p.size)]))
    if p.kind == "engram":
        assert p.table is not None
        return pipe.write(path, b"", pipe.record_batches(p.table))
    ranges = ((i, 0, i.nbytes) for e in p.entries for i in e.sources if i.nbytes)
    return pipe.write(path, p.header, pipe.range_batches(ranges))


# ------------------------------------------------------------------------------ reading


@dataclass(frozen=True)
class RecordColumnInfo(TensorInfo):
    """A column of a packed record file seen as a tensor: row r's `shape[1]` elements sit at
    offset + r·row_stride (not contiguous: read it with WeightReader.tensor / PackFolder.read,
    never with TensorLoader.load)."""

    row_stride: int = 0  # bytes from one row to the next: the record size
    column: int = 0      # where this column starts inside a record
    table: str = ""      # the Engram table prefix; its columns are <table>.weight, .scale

    @property
    def base(self) -> int:
        """Offset of the record file's first record."""
        return self.offset - self.column


@dataclass(frozen=True)
class PackedTable:
    """An Engram table stored as records in a pack file."""

    path: Path
    rows: int
    dim: int
    record_bytes: int
    scale_dtype: str


class PackFolder(CheckpointFolder):
    """A strata pack behind the CheckpointFolder interface, by the source's tensor names.

    The manifest is checked against the files at construction (`verify`), before anything is
    read; `validate()` then checks every header against the manifest."""

    def __init__(self, path: str | os.PathLike[str], verify: str = "size") -> None:
        self.path = Path(path)
        self._shards = {}
        self.index_metadata = {}
        self.manifest = read_manifest(self.path)
        self.source_format = str(self.manifest["source"].get("format", "unknown"))
        self.source_path = str(self.manifest["source"].get("path", ""))
        verify_files(self.path, self.manifest, verify)
        self._weight_map: dict[str, str] = {}    # stored name → file
        self._stacked: dict[str, int] = {}       # stacked name → experts
        self._virtual: dict[str, tuple[str, int]] = {}  # expert name → (stacked, e)
        self._columns: dict[str, tuple[str, str]] = {}  # Engram tensor → (table, part)
        self.engram_tables: dict[str, PackedTable] = {}
        self._order: list[str] = []
        self._infos: dict[str, TensorInfo] = {}
        for r in self.manifest["files"]:
            if r["kind"] == "safetensors":
                stacked = r.get("stacked", {})
                for t in r["tensors"]:
                    self._weight_map[t] = r["name"]
                    if t in stacked:
                        self._stacked[t] = stacked[t]
                        head, _, suffix = t.rpartition(".")
                        prefix, _, proj = head.rpartition(".")
                        for e in range(stacked[t]):
                            v = f"{prefix}.{e}.{proj}.{suffix}"
                            self._virtual[v] = (t, e)
                            self._order.append(v)
                    else:
                        self._order.append(t)
            elif r["kind"] == "engram":
                t = r["table"]
                self.engram_tables[t] = PackedTable(self.path / r["name"], r["rows"], r["dim"],
                                                    r["record_bytes"], r["scale_dtype"])
                for part in ("weight", "scale"):
                    self._columns[f"{t}.{part}"] = (t, part)
                    self._order.append(f"{t}.{part}")
        self._names = set(self._order)

    # ---------------------------------------------------------------- interface
    def names(self) -> list[str]:
        """The source checkpoint's tensor names (experts per expert, Engram weight/scale)."""
        return list(self._order)

    def has(self, name: str) -> bool:
        return name in self._names

    def files(self) -> list[Path]:
        """The pack's weight files (safetensors and Engram records)."""
        return [self.path / r["name"] for r in self.manifest["files"] if r["kind"] != "copy"]

    def stacked_names(self) -> list[str]:
        return list(self._stacked)

    def stacked_info(self, name: str) -> TensorInfo | None:
        """The whole stacked tensor `<p>.experts.<proj>.<suffix>` [E, ...], or None."""
        if name not in self._stacked:
            return None
        info = self._shard(self._weight_map[name]).info(name)
        if not info.shape or info.shape[0] != self._stacked[name]:
            raise CheckpointError(f"{info.file}: stacked tensor {name!r} has shape "
                                  f"{list(info.shape)}; the manifest says {self._stacked[name]} "
                                  "experts")
        return info

    def info(self, name: str) -> TensorInfo:
        info = self._infos.get(name)
        if info is not None:
            return info
        if name in self._virtual:
            stacked, e = self._virtual[name]
            s = self.stacked_info(stacked)
            assert s is not None
            stride = s.nbytes // s.shape[0]
            info = TensorInfo(name, s.dtype, tuple(s.shape[1:]), s.file, s.offset + e * stride,
                              stride)
        elif name in self._columns:
            table, part = self._columns[name]
            t = self.engram_tables[table]
            if part == "weight":
                info = RecordColumnInfo(name, "F8_E4M3", (t.rows, t.dim), t.path, 0,
                                        t.rows * t.dim, t.record_bytes, 0, table)
            else:
                g = t.record_bytes - t.dim
                info = RecordColumnInfo(name, t.scale_dtype, (t.rows, g), t.path, t.dim,
                                        t.rows * g, t.record_bytes, t.dim, table)
        elif name in self._weight_map and name not in self._stacked:
            info = self._shard(self._weight_map[name]).info(name)
        else:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in this pack")
        self._infos[name] = info
        return info

    def read(self, name: str, dtype: str | None = None,
             shape: tuple[int, ...] | None = None) -> torch.Tensor:
        info = self.info(name)
        if dtype is not None and info.dtype != dtype:
            raise CheckpointError(f"{info.file}: tensor {name!r}: expected dtype {dtype}, "
                                  f"found {info.dtype}")
        if shape is not None and tuple(shape) != info.shape:
            raise CheckpointError(f"{info.file}: tensor {name!r}: expected shape "
                                  f"{tuple(shape)}, found {info.shape}")
        if isinstance(info, RecordColumnInfo):
            return self.read_rows(name, np.arange(info.shape[0]))
        out = torch.empty(info.shape, dtype=ST_DTYPES[info.dtype][0])
        if info.nbytes:
            with _Fd(info.file) as fd:
                _pread_exact(fd, _byte_view(out), info.offset, info.file, f"tensor {name!r}")
        return out

    def read_rows(self, name: str, row_ids: Sequence[int] | np.ndarray | torch.Tensor
                  ) -> torch.Tensor:
        """Rows of a 2-D tensor (a contiguous one or a record column), read positionally."""
        info = self.info(name)
        if len(info.shape) != 2:
            raise CheckpointError(f"{info.file}: tensor {name!r}: read_rows needs a 2-D tensor, "
                                  f"shape is {info.shape}")
        n_rows = info.shape[0]
        ids = np.asarray(row_ids.cpu() if isinstance(row_ids, torch.Tensor) else row_ids)
        ids = ids.astype(np.int64, copy=False).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= n_rows):
            bad = int(ids[(ids < 0) | (ids >= n_rows)][0])
            raise CheckpointError(f"{info.file}: tensor {name!r}: row id {bad} out of range "
                                  f"[0, {n_rows})")
        out = torch.empty((ids.size, info.shape[1]), dtype=ST_DTYPES[info.dtype][0])
        row_bytes = info.nbytes // n_rows if n_rows else 0
        if ids.size == 0 or row_bytes == 0:
            return out
        stride = info.row_stride if isinstance(info, RecordColumnInfo) else row_bytes
        view = _byte_view(out)
        with _Fd(info.file) as fd:
            if stride == row_bytes:  # runs of consecutive rows in one read each
                breaks = np.flatnonzero(np.diff(ids) != 1) + 1
                for s, e in zip(np.concatenate(([0], breaks)).tolist(),
                                np.concatenate((breaks, [ids.size])).tolist()):
                    _pread_exact(fd, view[s * row_bytes:e * row_bytes],
                                 info.offset + int(ids[s]) * stride, info.file,
                                 f"rows of tensor {name!r}")
            else:  # record columns: whole records in chunks, then the column
                per = max(1, (8 << 20) // stride)
                recs = np.empty((min(per, ids.size), stride), dtype=np.uint8)
                col = info.column
                dst = np.frombuffer(view, dtype=np.uint8).reshape(ids.size, row_bytes)
                for c0 in range(0, ids.size, per):
                    chunk = ids[c0:c0 + per]
                    if chunk[-1] - chunk[0] == chunk.size - 1 and np.all(np.diff(chunk) == 1):
                        part = recs[:chunk.size]
                        _pread_exact(fd, memoryview(part).cast("B"),
                                     info.base + int(chunk[0]) * stride, info.file,
                                     f"records of tensor {name!r}")
                        dst[c0:c0 + chunk.size] = part[:, col:col + row_bytes]
                    else:
                        for k, r in enumerate(chunk.tolist()):
                            _pread_exact(fd, memoryview(dst[c0 + k]).cast("B"),
                                         info.offset + r * stride, info.file,
                                         f"row {r} of tensor {name!r}")
        return out

    def total_bytes(self) -> int:
        """Tensor data bytes by the source's accounting (same as the source folder's)."""
        return sum(self.info(n).nbytes for n in self._order)

    def validate(self) -> None:
        """Every safetensors header against the manifest (tensor sets, stacked shapes) and
        every record file's arithmetic; a mismatch names the file."""
        for r in self.manifest["files"]:
            path = self.path / r["name"]
            if r["kind"] == "safetensors":
                shard = self._shard(r["name"])
                have, want = set(shard.names()), set(r["tensors"])
                if have != want:
                    extra, missing = sorted(have - want)[:3], sorted(want - have)[:3]
                    raise CheckpointError(f"{path}: its tensors do not match the pack manifest "
                                          f"(missing {missing}, unexpected {extra})")
                for name in r.get("stacked", {}):
                    self.stacked_info(name)
            elif r["kind"] == "engram":
                if (r["record_bytes"] != engram_record_bytes(r["dim"])
                        or r["bytes"] != r["rows"] * r["record_bytes"]):
                    raise CheckpointError(f"{path}: the manifest's Engram geometry is "
                                          f"inconsistent ({r['rows']} rows × "
                                          f"{r['record_bytes']} B ≠ {r['bytes']} B)")


class _Fd:
    def __init__(self, path: Path) -> None:
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot open pack file: {e}") from e

    def __enter__(self) -> int:
        return self.fd

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def read_manifest(path: Path) -> dict:
    """The pack's manifest, its structure checked (not the files: see verify_files)."""
    mpath = path / MANIFEST_NAME
    if not mpath.is_file():
        if (path / PARTIAL_NAME).is_file():
            raise CheckpointError(f"{path}: this pack is incomplete (packing was interrupted; "
                                  f"{MANIFEST_NAME} is missing): run `strata pack SRC {path}` "
                                  "again to finish it")
        raise CheckpointError(f"{mpath}: missing: {path} is not a strata pack")
    m = _read_json(mpath)
    if m.get("format") != PACK_FORMAT:
        raise CheckpointError(f"{mpath}: not a strata pack manifest (format {m.get('format')!r})")
    if m.get("version") != PACK_VERSION:
        raise CheckpointError(f"{mpath}: pack format version {m.get('version')!r}; this strata "
                              f"reads version {PACK_VERSION} (pack the checkpoint again)")
    if m.get("complete") is not True or m.get("checksum") != CHECKSUM:
        raise CheckpointError(f"{mpath}: manifest is not a complete {CHECKSUM} pack manifest")
    if not isinstance(m.get("source"), dict) or not isinstance(m.get("files"), list):
        raise CheckpointError(f"{mpath}: manifest lacks 'source' or 'files'")
    seen = set()
    for r in m["files"]:
        name = r.get("name") if isinstance(r, dict) else None
        ok = (isinstance(name, str) and _SAFE_NAME.match(name) is not None
              and ".." not in name.split("/") and name not in seen
              and r.get("kind") in ("safetensors", "engram", "copy")
              and isinstance(r.get("bytes"), int) and isinstance(r.get(CHECKSUM), str))
        if ok and r["kind"] == "safetensors":
            ok = (isinstance(r.get("tensors"), list) and isinstance(r.get("stacked", {}), dict)
                  and all(isinstance(v, int) and v > 0 for v in r.get("stacked", {}).values()))
        if ok and r["kind"] == "engram":
            ok = all(isinstance(r.get(k), int) and r[k] > 0
                     for k in ("rows", "dim", "record_bytes")) and \
                isinstance(r.get("table"), str) and r.get("scale_dtype") in ("F8_E8M0", "U8")
        if not ok:
            raise CheckpointError(f"{mpath}: malformed file record {r!r}")
        seen.add(name)
    return m


def verify_files(path: Path, manifest: dict, mode: str = "size", progress: bool | None = False,
                 threads: int = 4) -> list[str]:
    """Check the pack's files against the manifest; raise CheckpointError naming every bad
    file. mode "size": each file exists with its recorded size, and files whose mtime differs
    from the record are checksummed; "full": every checksum; "none": nothing.
    Returns the names of the files that were checksummed."""
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify={mode!r}: expected one of {VERIFY_MODES}")
    if mode == "none":
        return []
    to_hash, bad = [], []
    for r in manifest["files"]:
        p = path / r["name"]
        try:
            st = p.stat()
        except FileNotFoundError:
            bad.append(f"{p}: missing from the pack (the manifest lists it, {r['bytes']} "
                       "bytes)")
            continue
        except OSError as e:
            bad.append(f"{p}: cannot stat pack file: {e}")
            continue
        if st.st_size != r["bytes"]:
            bad.append(f"{p}: wrong size: {st.st_size} bytes, the pack manifest says "
                       f"{r['bytes']} (truncated, replaced or edited file)")
        elif mode == "full" or st.st_mtime_ns != r.get("mtime_ns"):
            to_hash.append(r)
    sums = []
    if to_hash:
        bar = _bar(sum(r["bytes"] for r in to_hash), f"verifying {path.name}", progress)
        try:
            with ThreadPoolExecutor(max(1, min(threads, len(to_hash)))) as pool:
                sums = list(pool.map(lambda r: file_checksum(path / r["name"], bar), to_hash))
        finally:
            if bar is not None:
                bar.close()
    bad += [f"{path / r['name']}: checksum mismatch ({CHECKSUM} {got}, the pack manifest says "
            f"{r[CHECKSUM]}): the file was modified or corrupted; pack the checkpoint again"
            for r, got in zip(to_hash, sums) if got != r[CHECKSUM]]
    if bad:  # (every bad file, not only the first: one repair for all of them)
        raise CheckpointError(bad[0] if len(bad) == 1 else
                              f"{len(bad)} pack files are bad:\n  " + "\n  ".join(bad))
    if not to_hash:
        return []
    if mode == "size":
        warnings.warn(f"{path}: {len(to_hash)} pack file(s) changed since packing (mtime) and "
                      "were checksummed (they match); run `strata pack --verify "
                      f"{path}` once to re-stamp them", stacklevel=2)
    return [r["name"] for r in to_hash]


def verify_pack(path: str | os.PathLike[str], progress: bool | None = None,
                restamp: bool = True) -> tuple[int, int, float]:
    """Full check of a pack (every checksum, every header against the manifest). restamp:
    record the files' current mtimes, so later size-only checks of a copied pack stay cheap.
    Returns (files, bytes, seconds)."""
    t0 = time.perf_counter()
    path = Path(path)
    manifest = read_manifest(path)
    verify_files(path, manifest, "full", progress)
    with PackFolder(path, verify="none") as folder:
        folder.validate()
    if restamp:
        changed = False
        for r in manifest["files"]:
            m = (path / r["name"]).stat().st_mtime_ns
            if r.get("mtime_ns") != m:
                r["mtime_ns"], changed = m, True
        if changed:
            try:
                _write_json(path / MANIFEST_NAME, manifest)
            except OSError as e:  # (a read-only pack: verified all the same)
                warnings.warn(f"{path}: verified, but its manifest could not record the "
                              f"files' times ({e.strerror}); loads will check them in full")
    return len(manifest["files"]), sum(r["bytes"] for r in manifest["files"]), \
        time.perf_counter() - t0
