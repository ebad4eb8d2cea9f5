"""Our safetensors reader/writer and checkpoint-folder view: round trips, partial reads, failures."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from strata.checkpoint.safetensors_io import (
    ST_DTYPES,
    CheckpointFolder,
    SafetensorsFile,
    TensorInfo,
    write_safetensors,
)
from strata.errors import CheckpointError


def _sample(st_dtype: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of the torch dtype that `st_dtype` maps to, with varied (non-zero) contents."""
    g = torch.Generator().manual_seed(seed)
    dtype = ST_DTYPES[st_dtype][0]
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 10).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, shape, generator=g, dtype=torch.int64).to(dtype)


def _raw_header(path: Path) -> tuple[int, dict]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8 : 8 + n])


def _write_raw(path: Path, header: dict, data: bytes) -> None:
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


# ------------------------------------------------------------------------------ round trips


def test_round_trip_every_dtype(tmp_path: Path) -> None:
    tensors = {f"t.{st}": _sample(st, (3, 5), seed=i) for i, st in enumerate(ST_DTYPES)}
    tensors["scalar"] = torch.tensor(2.5, dtype=torch.float32)
    tensors["empty"] = torch.zeros(0, 7, dtype=torch.bfloat16)
    dtypes = {f"t.{st}": st for st in ST_DTYPES}  # F8_E8M0 must be forced; others are the default
    p = tmp_path / "all.safetensors"
    write_safetensors(p, tensors, dtypes=dtypes, metadata={"format": "pt", "note": "x"})
    with SafetensorsFile(p) as f:
        assert f.metadata == {"format": "pt", "note": "x"}
        assert f.names() == list(tensors)  # written in the given order
        for name, t in tensors.items():
            got = f.read(name)
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(got.view(torch.uint8) if got.dtype.itemsize == 1 else got, t.view(torch.uint8) if t.dtype.itemsize == 1 else t)
        info = f.info("t.F8_E8M0")
        assert info == TensorInfo("t.F8_E8M0", "F8_E8M0", (3, 5), p, info.offset, 15)
        assert f.read("t.F8_E8M0").dtype == torch.uint8
        assert f.info("t.F8_E4M3").dtype == "F8_E4M3" and f.read("t.F8_E4M3").dtype == torch.float8_e4m3fn


def test_offsets_aligned_to_8(tmp_path: Path) -> None:
    tensors = {"a": torch.ones(3, dtype=torch.float64), "b": torch.ones(5, dtype=torch.bfloat16)[:4], "c": torch.ones(8, dtype=torch.uint8)}
    p = tmp_path / "a.safetensors"
    write_safetensors(p, tensors)
    n, header = _raw_header(p)
    assert (8 + n) % 8 == 0
    assert header[b"a".decode()]["data_offsets"] == [0, 24]
    with SafetensorsFile(p) as f:
        assert all(f.info(k).offset % 8 == 0 for k in tensors)
        assert torch.equal(f.read("b"), torch.ones(4, dtype=torch.bfloat16))  # non-contiguous source ok


def test_forced_dtypes(tmp_path: Path) -> None:
    p = tmp_path / "f.safetensors"
    scale = torch.tensor([[127, 128]], dtype=torch.uint8)
    packed = torch.tensor([[0x2F, 0x11]], dtype=torch.uint8)
    write_safetensors(p, {"s": scale, "w": packed}, dtypes={"s": "F8_E8M0", "w": "I8"})
    with SafetensorsFile(p) as f:
        assert f.info("s").dtype == "F8_E8M0" and torch.equal(f.read("s"), scale)
        assert f.info("w").dtype == "I8" and torch.equal(f.read("w").view(torch.uint8), packed)
    with pytest.raises(CheckpointError, match="'x'.*float32 as BF16"):
        write_safetensors(p, {"x": torch.zeros(2)}, dtypes={"x": "BF16"})
    with pytest.raises(CheckpointError, match="'y'.*complex"):
        write_safetensors(p, {"y": torch.zeros(2, dtype=torch.complex64)})


def test_interop_with_official_safetensors(tmp_path: Path) -> None:
    tensors = {st: _sample(st, (4, 6), seed=3) for st in ("BF16", "F32", "I8", "U8")}
    tensors["odd"] = _sample("U8", (3,))  # an odd-sized tensor: later offsets unaligned, still no gaps
    tensors["after"] = _sample("F32", (2, 2))
    p = tmp_path / "ours.safetensors"
    write_safetensors(p, tensors, metadata={"format": "pt"})
    with safe_open(str(p), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(tensors)
        for name, t in tensors.items():
            assert torch.equal(f.get_tensor(name), t)
    # And the other way: a file written by the official package reads back through ours.
    from safetensors.torch import save_file

    q = tmp_path / "theirs.safetensors"
    save_file(tensors, str(q), metadata={"k": "v"})
    with SafetensorsFile(q) as f:
        assert f.metadata == {"k": "v"}
        for name, t in tensors.items():
            assert torch.equal(f.read(name), t)


# ------------------------------------------------------------------------------ partial reads


def test_read_rows(tmp_path: Path) -> None:
    table = torch.arange(50 * 8, dtype=torch.int32).view(50, 8)
    p = tmp_path / "t.safetensors"
    write_safetensors(p, {"pad": torch.ones(3, dtype=torch.uint8), "table": table})
    with SafetensorsFile(p) as f:
        ids = [7, 8, 9, 0, 49, 9, 10, 3]
        assert torch.equal(f.read_rows("table", ids), table[ids])
        assert torch.equal(f.read_rows("table", np.array([5], dtype=np.uint32)), table[[5]])
        assert torch.equal(f.read_rows("table", torch.tensor([2, 1])), table[[2, 1]])
        assert f.read_rows("table", []).shape == (0, 8)
        with pytest.raises(CheckpointError, match="row id 50 out of range"):
            f.read_rows("table", [1, 50])
        with pytest.raises(CheckpointError, match="row id -1"):
            f.read_rows("table", [-1])
        with pytest.raises(CheckpointError, match="'pad'.*2-D"):
            f.read_rows("pad", [0])


def test_read_touches_only_its_bytes(tmp_path: Path) -> None:
    a = torch.randn(16, 16)
    b = torch.randn(16, 16)
    c = torch.randn(8)
    p = tmp_path / "g.safetensors"
    write_safetensors(p, {"a": a, "b": b, "c": c})
    with SafetensorsFile(p) as f:
        ib = f.info("b")
    raw = bytearray(p.read_bytes())
    raw[ib.offset : ib.offset + ib.nbytes] = os.urandom(ib.nbytes)  # garbage in b only
    p.write_bytes(bytes(raw))
    with SafetensorsFile(p) as f:
        assert torch.equal(f.read("a"), a)
        assert torch.equal(f.read("c"), c)
        assert torch.equal(f.read_rows("a", [15, 0]), a[[15, 0]])
        assert not torch.equal(f.read("b"), b)


def test_read_into_preallocated(tmp_path: Path) -> None:
    w = torch.randn(4, 8).bfloat16()
    p = tmp_path / "r.safetensors"
    write_safetensors(p, {"w": w})
    with SafetensorsFile(p) as f:
        buf = torch.empty(32, dtype=torch.bfloat16)  # flat staging buffer, same bytes
        assert f.read_into("w", buf) is buf
        assert torch.equal(buf.view(4, 8), w)
        with pytest.raises(CheckpointError, match="'w'.*dtype"):
            f.read_into("w", torch.empty(32, dtype=torch.float16))
        with pytest.raises(CheckpointError, match="'w'.*bytes"):
            f.read_into("w", torch.empty(31, dtype=torch.bfloat16))


# ----------------------------------------------------------------------------------- failures


def test_truncated_file_names_file_and_first_tensor(tmp_path: Path) -> None:
    p = tmp_path / "trunc.safetensors"
    write_safetensors(p, {"first": torch.zeros(64), "second": torch.zeros(64), "third": torch.zeros(64)})
    raw = p.read_bytes()
    p.write_bytes(raw[: len(raw) - 300])  # cuts into "second" (256 bytes each)
    with pytest.raises(CheckpointError, match=r"trunc\.safetensors.*truncated.*'second'"):
        SafetensorsFile(p)
    p.write_bytes(raw[:20])  # cuts into the header
    with pytest.raises(CheckpointError, match=r"trunc\.safetensors.*header length"):
        SafetensorsFile(p)
    p.write_bytes(raw[:5])
    with pytest.raises(CheckpointError, match="too short"):
        SafetensorsFile(p)


@pytest.mark.parametrize(
    "header, data, pattern",
    [
        ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, None, "not valid JSON"),
        ({"x": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "'x'.*unknown dtype 'Q4'"),
        ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 12, "'x'.*needs 12"),
        ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, "'x'.*bad data_offsets"),
        ({"x": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, "'x'.*bad shape"),
        (
            {
                "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
            "'y' overlaps tensor 'x'",
        ),
        ({"__metadata__": {"a": 1}}, b"", "__metadata__"),
        ([1, 2], b"", "not a JSON object"),
    ],
)
def test_bad_header(tmp_path: Path, header, data, pattern) -> None:
    p = tmp_path / "bad.safetensors"
    if data is None:
        h = b'{"x": oops'
        p.write_bytes(struct.pack("<Q", len(h)) + h + b"\0" * 8)
    else:
        _write_raw(p, header, data)
    with pytest.raises(CheckpointError, match=pattern) as e:
        SafetensorsFile(p)
    assert "bad.safetensors" in str(e.value)


def test_insane_header_length_and_duplicates(tmp_path: Path) -> None:
    p = tmp_path / "h.safetensors"
    p.write_bytes(struct.pack("<Q", 2**60) + b"{}")
    with pytest.raises(CheckpointError, match="not sane"):
        SafetensorsFile(p)
    h = b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    p.write_bytes(struct.pack("<Q", len(h)) + h + b"\0")
    with pytest.raises(CheckpointError, match="duplicate key 'x'"):
        SafetensorsFile(p)


# -------------------------------------------------------------------------- checkpoint folder


def _make_sharded(folder: Path) -> dict[str, torch.Tensor]:
    t = {
        "embed.weight": torch.randn(10, 4).bfloat16(),
        "layers.0.attn.wkv.weight": torch.randn(4, 4).to(torch.float8_e4m3fn),
        "layers.0.attn.wkv.scale": torch.full((1, 1), 127, dtype=torch.uint8),
        "norm.weight": torch.ones(4, dtype=torch.bfloat16),
    }
    write_safetensors(folder / "model-00001-of-00002.safetensors", {"embed.weight": t["embed.weight"]})
    write_safetensors(
        folder / "model-00002-of-00002.safetensors",
        {k: t[k] for k in ("layers.0.attn.wkv.weight", "layers.0.attn.wkv.scale", "norm.weight")},
        dtypes={"layers.0.attn.wkv.scale": "F8_E8M0"},
    )
    weight_map = {"embed.weight": "model-00001-of-00002.safetensors"}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in list(t)[1:]})
    total = sum(x.numel() * x.element_size() for x in t.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return t


def test_folder_sharded(tmp_path: Path) -> None:
    t = _make_sharded(tmp_path)
    with CheckpointFolder(tmp_path) as ck:
        assert ck.names() == list(t)
        assert ck.has("norm.weight") and not ck.has("nope")
        assert ck.files() == [tmp_path / "model-00001-of-00002.safetensors", tmp_path / "model-00002-of-00002.safetensors"]
        assert ck.info("layers.0.attn.wkv.scale").dtype == "F8_E8M0"
        assert torch.equal(ck.read("embed.weight", dtype="BF16", shape=(10, 4)), t["embed.weight"])
        assert torch.equal(ck.read_rows("embed.weight", [9, 2]), t["embed.weight"][[9, 2]])
        assert ck.total_bytes() == ck.index_metadata["total_size"]
        ck.validate()
        with pytest.raises(CheckpointError, match="no tensor 'nope'"):
            ck.info("nope")


def test_folder_dtype_shape_mismatch(tmp_path: Path) -> None:
    _make_sharded(tmp_path)
    ck = CheckpointFolder(tmp_path)
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: tensor 'norm\.weight': expected dtype F32, found BF16"):
        ck.read("norm.weight", dtype="F32")
    with pytest.raises(CheckpointError, match=r"model-00001-of-00002\.safetensors: tensor 'embed\.weight': expected shape \(4, 10\), found \(10, 4\)"):
        ck.read("embed.weight", shape=(4, 10))
    ck.close()


def test_folder_missing_shard(tmp_path: Path) -> None:
    _make_sharded(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"shard 'model-00002-of-00002\.safetensors'.*'layers\.0\.attn\.wkv\.weight'"):
        CheckpointFolder(tmp_path)


def test_folder_index_names_tensor_absent_from_shard(tmp_path: Path) -> None:
    _make_sharded(tmp_path)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    ck = CheckpointFolder(tmp_path)
    assert torch.equal(ck.read("norm.weight"), torch.ones(4, dtype=torch.bfloat16))
    with pytest.raises(CheckpointError, match=r"'ghost\.weight'.*'model-00001-of-00002\.safetensors'"):
        ck.read("ghost.weight")
    with pytest.raises(CheckpointError, match="ghost"):
        ck.validate()


def test_folder_single_file_and_empty(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "model.safetensors", {"b": torch.ones(2), "a": torch.zeros(3)})
    ck = CheckpointFolder(tmp_path)
    assert ck.names() == ["b", "a"]
    assert ck.files() == [tmp_path / "model.safetensors"]
    assert ck.total_bytes() == 20
    assert torch.equal(ck.read("a", dtype="F32", shape=(3,)), torch.zeros(3))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="empty.*neither model.safetensors.index.json nor model.safetensors"):
        CheckpointFolder(empty)
