"""Our own safetensors reader/writer and a Hugging Face checkpoint-folder view.

Why not the official package: the V4.1-Flash checkpoint is ~510 GB on machines with far less
RAM, so every read must touch only the bytes of the tensor (or rows) asked for, through
positional reads (``os.preadv``) that are thread-safe and never map the whole file. Headers are
validated up front so that a truncated download or a wrong shard is reported at open time,
naming the file and tensor at fault, instead of surfacing as garbage weights mid-decode.

File layout: 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``, then
the data; offsets are relative to the start of the data.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from strata.errors import CheckpointError

# safetensors dtype string -> (torch dtype, bytes per element). F8_E8M0 is handed out as raw
# uint8 exponent bytes: its meaning (2^(b-127)) belongs to strata.checkpoint.encodings.
ST_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BF16": (torch.bfloat16, 2),
    "F16": (torch.float16, 2),
    "F32": (torch.float32, 4),
    "F64": (torch.float64, 8),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "I16": (torch.int16, 2),
    "I32": (torch.int32, 4),
    "I64": (torch.int64, 8),
    "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E8M0": (torch.uint8, 1),
}

# torch dtype -> default safetensors dtype string used by the writer.
_DEFAULT_ST_DTYPE: dict[torch.dtype, str] = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
}

# The official implementation refuses headers above 100 MB; a real shard header is < 1 MB.
MAX_HEADER_BYTES = 100_000_000
_ALIGN = 8
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: enough to read it with a single positional read."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    offset: int  # absolute byte offset of the tensor's first byte in `file`
    nbytes: int


def _byte_view(t: torch.Tensor) -> memoryview:
    """A writable flat byte view of a contiguous CPU tensor's storage (no copy)."""
    flat = t.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def _pread_exact(fd: int, buf: memoryview, offset: int, path: Path, what: str) -> None:
    """Fill `buf` from `offset`, looping on short reads (Linux caps one read near 2 GiB)."""
    done = 0
    total = len(buf)
    while done < total:
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(
                f"{path}: unexpected end of file reading {what} at byte {offset + done} "
                f"({total - done} bytes missing; file changed or truncated after open?)"
            )
        done += n


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """json object hook: duplicate tensor names would silently shadow one another."""
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_Holder = TypeVar("_Holder", bound="ClosedOnExit")


class ClosedOnExit:
    """A holder of open files (its close()): closed at the end of a `with` block, or when it
    is collected."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _Holder) -> _Holder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class SafetensorsFile(ClosedOnExit):
    """One .safetensors file: the header is parsed and validated at open, data is read lazily.

    The file descriptor stays open for the object's lifetime; reads are positional so one
    object may be shared between threads.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self._fd: int | None = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open safetensors file: {e}") from e
        try:
            self._infos, self.metadata = self._parse_header()
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------- header
    def _parse_header(self) -> tuple[dict[str, TensorInfo], dict[str, str]]:
        """Read and validate the header; every check names the file and, where one is at fault, the tensor."""
        assert self._fd is not None
        path = self.path
        size = os.fstat(self._fd).st_size
        if size < 8:
            raise CheckpointError(f"{path}: file is {size} bytes, too short for a safetensors header")
        head = os.pread(self._fd, 8, 0)
        (n,) = struct.unpack("<Q", head)
        if n < 2 or n > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: header length {n} is not sane (expected 2..{MAX_HEADER_BYTES})")
        if 8 + n > size:
            raise CheckpointError(
                f"{path}: header length {n} runs past the end of the file ({size} bytes); truncated file?"
            )
        buf = bytearray(n)
        _pread_exact(self._fd, memoryview(buf), 8, path, "the header")
        try:
            header = json.loads(buf.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
        except (UnicodeDecodeError, ValueError) as e:
            raise CheckpointError(f"{path}: header is not valid JSON: {e}") from e
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: header is not a JSON object")

        metadata_raw = header.pop("__metadata__", {})
        if not isinstance(metadata_raw, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata_raw.items()
        ):
            raise CheckpointError(f"{path}: __metadata__ must be an object of string to string")
        metadata: dict[str, str] = dict(metadata_raw)

        data_start = 8 + n
        data_size = size - data_start
        infos: dict[str, TensorInfo] = {}
        ranges: list[tuple[int, int, str]] = []
        for name, entry in header.items():
            if not isinstance(entry, dict):
                raise CheckpointError(f"{path}: tensor {name!r}: header entry is not an object")
            dtype = entry.get("dtype")
            shape = entry.get("shape")
            offsets = entry.get("data_offsets")
            if dtype not in ST_DTYPES:
                raise CheckpointError(f"{path}: tensor {name!r}: unknown dtype {dtype!r}")
            if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
                raise CheckpointError(f"{path}: tensor {name!r}: bad shape {shape!r}")
            if (
                not isinstance(offsets, list)
                or len(offsets) != 2
                or not all(_is_int(o) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]
            ):
                raise CheckpointError(f"{path}: tensor {name!r}: bad data_offsets {offsets!r}")
            begin, end = offsets
            nbytes = math.prod(shape) * ST_DTYPES[dtype][1]
            if end - begin != nbytes:
                raise CheckpointError(
                    f"{path}: tensor {name!r}: data_offsets {offsets} span {end - begin} bytes but "
                    f"{dtype} {shape} needs {nbytes}"
                )
            infos[name] = TensorInfo(name, dtype, tuple(shape), path, data_start + begin, nbytes)
            ranges.append((begin, end, name))

        # Report the first tensor (in file order) that a short file cannot hold, and overlaps.
        ranges.sort()
        prev_end, prev_name = 0, ""
        for begin, end, name in ranges:
            if end > data_size:
                raise CheckpointError(
                    f"{path}: truncated: tensor {name!r} needs data bytes [{begin}, {end}) but the file "
                    f"holds only {data_size} data bytes ({size} bytes in all)"
                )
            if begin < prev_end and end > begin:
                raise CheckpointError(f"{path}: tensor {name!r} overlaps tensor {prev_name!r} in the data")
            if end > begin:
                prev_end, prev_name = end, name
        return infos, metadata

    # ------------------------------------------------------------- accessors
    def names(self) -> list[str]:
        """Tensor names in the order their bytes appear in the file (good for sequential reads)."""
        return sorted(self._infos, key=lambda k: self._infos[k].offset)

    def has(self, name: str) -> bool:
        return name in self._infos

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in this file") from None

    def _fd_checked(self) -> int:
        if self._fd is None:
            raise CheckpointError(f"{self.path}: file is closed")
        return self._fd

    # ----------------------------------------------------------------- reads
    def read(self, name: str) -> torch.Tensor:
        """Read exactly one tensor's bytes into a fresh tensor of its mapped dtype and shape."""
        info = self.info(name)
        out = torch.empty(info.shape, dtype=ST_DTYPES[info.dtype][0])
        if info.nbytes:
            _pread_exact(self._fd_checked(), _byte_view(out), info.offset, self.path, f"tensor {name!r}")
        return out

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Read one tensor into a preallocated (e.g. pinned) buffer, avoiding a staging copy.

        `out` must be a contiguous CPU tensor of the mapped dtype and the same byte size; its
        shape is free so that flat staging buffers can be reused. Returns `out`.
        """
        info = self.info(name)
        want = ST_DTYPES[info.dtype][0]
        if out.dtype != want:
            raise CheckpointError(
                f"{self.path}: tensor {name!r}: read_into buffer dtype {out.dtype} != {want} ({info.dtype})"
            )
        if out.device.type != "cpu" or not out.is_contiguous():
            raise CheckpointError(f"{self.path}: tensor {name!r}: read_into buffer must be a contiguous CPU tensor")
        if out.numel() * out.element_size() != info.nbytes:
            raise CheckpointError(
                f"{self.path}: tensor {name!r}: read_into buffer holds {out.numel() * out.element_size()} "
                f"bytes, tensor has {info.nbytes}"
            )
        if info.nbytes:
            _pread_exact(self._fd_checked(), _byte_view(out), info.offset, self.path, f"tensor {name!r}")
        return out

    def read_rows(
        self, name: str, row_ids: Sequence[int] | np.ndarray | torch.Tensor
    ) -> torch.Tensor:
        """Read the given rows (any order, repeats allowed) of a 2-D tensor with positional reads.

        Used for disk-resident Engram tables (~100 GB each) where only a few rows per token are
        needed. Runs of consecutive ids are coalesced into one read.
        """
        info = self.info(name)
        if len(info.shape) != 2:
            raise CheckpointError(f"{self.path}: tensor {name!r}: read_rows needs a 2-D tensor, shape is {info.shape}")
        n_rows, n_cols = info.shape
        ids = np.asarray(row_ids.cpu() if isinstance(row_ids, torch.Tensor) else row_ids)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise CheckpointError(f"{self.path}: tensor {name!r}: row_ids must be a 1-D sequence of integers")
        ids = ids.astype(np.int64, copy=False)
        if ids.size and (ids.min() < 0 or ids.max() >= n_rows):
            bad = int(ids[(ids < 0) | (ids >= n_rows)][0])
            raise CheckpointError(f"{self.path}: tensor {name!r}: row id {bad} out of range [0, {n_rows})")
        out = torch.empty((ids.size, n_cols), dtype=ST_DTYPES[info.dtype][0])
        row_bytes = info.nbytes // n_rows if n_rows else 0
        if ids.size == 0 or row_bytes == 0:
            return out
        fd = self._fd_checked()
        view = _byte_view(out)
        # Split the request into runs where ids[k+1] == ids[k] + 1.
        breaks = np.flatnonzero(np.diff(ids) != 1) + 1
        starts = np.concatenate(([0], breaks))
        stops = np.concatenate((breaks, [ids.size]))
        for s, e in zip(starts.tolist(), stops.tolist()):
            first = int(ids[s])
            _pread_exact(
                fd,
                view[s * row_bytes : e * row_bytes],
                info.offset + first * row_bytes,
                self.path,
                f"rows {first}..{first + e - s - 1} of tensor {name!r}",
            )
        return out

    # ------------------------------------------------------------- lifetime
    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def encode_header(entries: Sequence[tuple[str, str, Sequence[int]]],
                  metadata: dict[str, str] | None = None,
                  where: str | os.PathLike[str] = "safetensors file") -> tuple[bytes, list[int]]:
    """The header block (8-byte length + JSON padded to 8 bytes) for tensors written back to
    back in the given order, and each tensor's data size. `entries`: (name, st dtype, shape).

    Shared by `write_safetensors` and the pack writer (strata.checkpoint.pack), which streams
    the data after this header without ever holding a tensor."""
    header: dict[str, object] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise CheckpointError(f"{where}: metadata must map strings to strings")
        header["__metadata__"] = dict(metadata)
    sizes: list[int] = []
    cursor = 0
    for name, st, shape in entries:
        if not isinstance(name, str) or name == "__metadata__" or not name or name in header:
            raise CheckpointError(f"{where}: invalid or repeated tensor name {name!r}")
        if st not in ST_DTYPES:
            raise CheckpointError(f"{where}: tensor {name!r}: unknown safetensors dtype {st!r}")
        nbytes = math.prod(shape) * ST_DTYPES[st][1]
        header[name] = {"dtype": st, "shape": list(shape), "data_offsets": [cursor, cursor + nbytes]}
        sizes.append(nbytes)
        cursor += nbytes
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * ((-(8 + len(hbytes))) % _ALIGN)
    return struct.pack("<Q", len(hbytes)) + hbytes, sizes


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: dict[str, torch.Tensor],
    dtypes: dict[str, str] | None = None,
    metadata: dict[str, str] | None = None,
) -> None:
    """Write a safetensors file (used for test fixtures and tiny converted checkpoints).

    Tensors are written in the given order with no gaps (the official reader rejects holes),
    and the header is padded with spaces so the data starts on an 8-byte boundary; each
    offset is then a multiple of 8 whenever the tensors before it have sizes that are.
    `dtypes` may force the stored dtype string: same torch dtype, or any 1-byte string for
    raw uint8/int8 data (e.g. "F8_E8M0" for uint8 scales, "I8" for packed fp4).
    The file is written to a temporary name and renamed, so a crash never leaves a half file.
    """
    path = Path(path)
    dtypes = dict(dtypes or {})
    for name in dtypes:
        if name not in tensors:
            raise CheckpointError(f"{path}: dtypes names tensor {name!r} which is not being written")

    blobs: list[torch.Tensor] = []
    entries: list[tuple[str, str, list[int]]] = []
    for name, t in tensors.items():
        if not isinstance(name, str) or name == "__metadata__" or not name:
            raise CheckpointError(f"{path}: invalid tensor name {name!r}")
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{path}: tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        st = dtypes.get(name) or _DEFAULT_ST_DTYPE.get(t.dtype)
        if st is None:
            raise CheckpointError(f"{path}: tensor {name!r}: torch dtype {t.dtype} has no safetensors dtype here")
        if st not in ST_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r}: unknown safetensors dtype {st!r}")
        mapped, itemsize = ST_DTYPES[st]
        raw_bytes = t.dtype in (torch.uint8, torch.int8) and itemsize == 1
        if mapped != t.dtype and not raw_bytes:
            raise CheckpointError(f"{path}: tensor {name!r}: cannot store torch {t.dtype} as {st}")
        t = t.detach().to("cpu").contiguous()
        entries.append((name, st, list(t.shape)))
        blobs.append(t)

    head, _ = encode_header(entries, metadata, path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(head)
        for t in blobs:
            if t.numel():
                f.write(_byte_view(t))
    os.replace(tmp, path)


class CheckpointFolder:
    """A Hugging Face checkpoint folder: sharded via model.safetensors.index.json or one model.safetensors.

    Shard headers are opened lazily (a header read per shard on first use), but every shard the
    index names must exist at construction, so a partial download fails before any weights load.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._shards: dict[str, SafetensorsFile] = {}
        index_path = self.path / INDEX_NAME
        single_path = self.path / SINGLE_NAME
        self.index_metadata: dict[str, object] = {}
        if index_path.is_file():
            self._weight_map = self._load_index(index_path)
        elif single_path.is_file():
            shard = SafetensorsFile(single_path)
            self._shards[SINGLE_NAME] = shard
            self._weight_map = {name: SINGLE_NAME for name in shard.names()}
        elif (self.path / "strata-pack.json").is_file() or (self.path / "strata-pack.partial.json").is_file():
            raise CheckpointError(f"{self.path}: this is a strata pack, not a safetensors checkpoint "
                                  "folder; open it with strata.checkpoint.pack.open_checkpoint")
        else:
            raise CheckpointError(f"{self.path}: neither {INDEX_NAME} nor {SINGLE_NAME} found in this folder")

        first_user: dict[str, str] = {}
        for tensor, shard_name in self._weight_map.items():
            first_user.setdefault(shard_name, tensor)
        for shard_name, tensor in first_user.items():
            if not (self.path / shard_name).is_file():
                raise CheckpointError(
                    f"{self.path}: shard {shard_name!r} named in {INDEX_NAME} is missing "
                    f"(needed by tensor {tensor!r}, among others)"
                )

    def _load_index(self, index_path: Path) -> dict[str, str]:
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise CheckpointError(f"{index_path}: cannot read index JSON: {e}") from e
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise CheckpointError(f"{index_path}: no 'weight_map' object")
        meta = index.get("metadata", {})
        self.index_metadata = dict(meta) if isinstance(meta, dict) else {}
        weight_map: dict[str, str] = {}
        for tensor, shard_name in index["weight_map"].items():
            if not isinstance(shard_name, str) or not shard_name or Path(shard_name).is_absolute() or ".." in Path(shard_name).parts:
                raise CheckpointError(f"{index_path}: tensor {tensor!r} maps to bad shard name {shard_name!r}")
            weight_map[tensor] = shard_name
        return weight_map

    def _shard(self, shard_name: str) -> SafetensorsFile:
        shard = self._shards.get(shard_name)
        if shard is None:
            shard = SafetensorsFile(self.path / shard_name)
            self._shards[shard_name] = shard
        return shard

    def names(self) -> list[str]:
        """All tensor names, in index (or single-file) order."""
        return list(self._weight_map)

    def has(self, name: str) -> bool:
        return name in self._weight_map

    def files(self) -> list[Path]:
        """The shard files, each once, sorted by name."""
        return [self.path / s for s in sorted(set(self._weight_map.values()))]

    def info(self, name: str) -> TensorInfo:
        shard_name = self._weight_map.get(name)
        if shard_name is None:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in this checkpoint")
        shard = self._shard(shard_name)
        if not shard.has(name):
            raise CheckpointError(
                f"{self.path}: {INDEX_NAME} maps tensor {name!r} to shard {shard_name!r}, "
                f"but that shard's header ({shard.path}) has no such tensor"
            )
        return shard.info(name)

    def read(self, name: str, dtype: str | None = None, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Read one tensor; when `dtype`/`shape` are given they must match the stored ones exactly."""
        info = self.info(name)
        if dtype is not None and info.dtype != dtype:
            raise CheckpointError(
                f"{info.file}: tensor {name!r}: expected dtype {dtype}, found {info.dtype}"
            )
        if shape is not None and tuple(shape) != info.shape:
            raise CheckpointError(
                f"{info.file}: tensor {name!r}: expected shape {tuple(shape)}, found {info.shape}"
            )
        return self._shard(self._weight_map[name]).read(name)

    def read_rows(self, name: str, row_ids: Sequence[int] | np.ndarray | torch.Tensor) -> torch.Tensor:
        """Rows of a 2-D tensor, read positionally (see SafetensorsFile.read_rows)."""
        self.info(name)
        return self._shard(self._weight_map[name]).read_rows(name, row_ids)

    def total_bytes(self) -> int:
        """Sum of tensor data bytes (the index's ``total_size`` convention); opens every shard header."""
        return sum(self.info(name).nbytes for name in self._weight_map)

    def validate(self) -> None:
        """Open every shard and check each indexed tensor is in its shard's header (fail early)."""
        for name in self._weight_map:
            self.info(name)

    def close(self) -> None:
        for shard in self._shards.values():
            shard.close()
        self._shards.clear()

    def __enter__(self) -> CheckpointFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
