"""The runtime pack: bit-identical round trip, same tokens, manifest checks, resume, bounded RSS.

Fixtures are the tiny checkpoints in all three conventions (official fp8/fp4, EXL3 full,
EXL3 routed-only), each packed once per module. The memory test packs and then loads a
~300 MB synthetic checkpoint in subprocesses and compares peak RSS with the baseline (plus
the weights kept, when loading), as tests/test_loader.py does for a checkpoint folder.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from strata.checkpoint import pack as pack_mod
from strata.checkpoint.loader import TensorLoader
from strata.checkpoint.pack import (MANIFEST_NAME, PARTIAL_NAME, PackFolder, RecordColumnInfo,
                                    open_checkpoint, pack, verify_pack)
from strata.checkpoint.safetensors_io import INDEX_NAME, CheckpointFolder, write_safetensors
from strata.checkpoint.tiny import make_tiny
from strata.checkpoint.weights import WeightReader
from strata.cli import main
from strata.engram_store import pack_records
from strata.errors import CheckpointError, ConfigError
from strata.model.model import Model
from strata.runtime.session import Session

MiB = 1 << 20
FORMATS = ("official", "exl3", "exl3-routed")


def _raw(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else t.to(torch.uint8)


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """(source folder, pack) per convention; small buffers so tensors go through in pieces."""
    root = tmp_path_factory.mktemp("packs")
    out = {}
    for fmt in FORMATS:
        src = make_tiny(root / fmt, "tiny", seed=0, fmt=fmt)
        r = pack(src, root / f"{fmt}-pack", buffer_bytes=8192, n_buffers=2, progress=False)
        assert r.reused == [] and len(r.written) == len(json.loads(
            (r.path / MANIFEST_NAME).read_text())["files"])
        out[fmt] = (src, r.path)
    return out


# ---- round trip ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_is_bit_identical(packs, fmt):
    src, dst = packs[fmt]
    a, b = CheckpointFolder(src), open_checkpoint(dst, verify="full")
    assert isinstance(b, PackFolder)
    assert sorted(a.names()) == sorted(b.names())
    assert a.total_bytes() == b.total_bytes()
    for name in a.names():
        x, y = a.read(name), b.read(name)
        assert (x.dtype, x.shape) == (y.dtype, y.shape), name
        assert (a.info(name).dtype, a.info(name).shape) == (b.info(name).dtype, b.info(name).shape)
        assert torch.equal(_raw(x), _raw(y)), name
    # Experts are stacked per layer (DSpark stages too), bytes unchanged, in expert order.
    stacked = b.stacked_names()
    layer_stacks = [n for n in stacked if n.startswith("layers.3.ffn.experts.")]
    mtp_stacks = [n for n in stacked if n.startswith("mtp.1.ffn.experts.")]
    assert layer_stacks and mtp_stacks
    if fmt == "official":
        assert set(layer_stacks) == {f"layers.3.ffn.experts.{p}.{s}" for p in ("w1", "w2", "w3")
                                     for s in ("weight", "scale")}
    else:
        assert "layers.3.ffn.experts.w1.trellis" in layer_stacks
    for n in layer_stacks + mtp_stacks:
        head, _, suffix = n.rpartition(".")
        prefix, _, proj = head.rpartition(".")
        info = b.stacked_info(n)
        E = info.shape[0]
        members = [a.read(f"{prefix}.{e}.{proj}.{suffix}") for e in range(E)]
        assert info.shape[1:] == tuple(members[0].shape)
        whole = b._shard(b._weight_map[n]).read(n)
        assert torch.equal(_raw(whole), torch.cat([_raw(m) for m in members])), n
    # EXL3 tiles as stored: the stacked trellis is the experts' trellises, untouched.
    if fmt != "official":
        t = b.stacked_info("layers.3.ffn.experts.w2.trellis")
        assert t.dtype == "I16" and len(t.shape) == 4
    # Engram rows as adjacent records: values then scales, one record per row.
    for table, packed in b.engram_tables.items():
        assert packed.record_bytes == packed.dim + packed.dim // 32
        want = pack_records(a.read(f"{table}.weight"), a.read(f"{table}.scale"))
        got = np.fromfile(packed.path, dtype=np.uint8).reshape(packed.rows, packed.record_bytes)
        assert np.array_equal(got, want)
        assert isinstance(b.info(f"{table}.scale"), RecordColumnInfo)
        ids = [5, 3, 4, 0, packed.rows - 1]
        assert torch.equal(_raw(b.read_rows(f"{table}.scale", ids)),
                           _raw(a.read_rows(f"{table}.scale", ids)))
    # Config and tokenizer copied as is; the manifest's checksums are the files' sha256.
    m = json.loads((dst / MANIFEST_NAME).read_text())
    for r in m["files"]:
        assert hashlib.sha256((dst / r["name"]).read_bytes()).hexdigest() == r["sha256"]
        if r["kind"] == "copy":
            assert (dst / r["name"]).read_bytes() == (src / r["name"]).read_bytes()
    assert {r["name"] for r in m["files"] if r["kind"] == "copy"} >= {
        "config.json", "tokenizer.json", "tokenizer_config.json"}
    assert m["source"]["format"] == {"official": "official (fp8 dense, fp4 experts, fp8 Engram)",
                                     "exl3": "EXL3 full",
                                     "exl3-routed": "EXL3 routed-only"}[fmt]
    a.close()
    b.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_generates_the_same_tokens(packs, fmt, tmp_path):
    """Same logits bit for bit and same tokens: from the folder, from the pack (Engram loaded
    from the records) and from the pack with Engram on disk (RowSource.packed)."""
    src, dst = packs[fmt]
    prompt = torch.tensor([5, 6, 7, 8, 9, 10])
    results = []
    for path, engram in ((src, "device"), (dst, "device"), (dst, "disk")):
        m = Model.load(path, cache_dir=tmp_path, engram=engram)
        logits, _ = m.forward(prompt, m.new_state(32))
        toks = Session(m, 32).run(prompt, 6, stop_ids=frozenset()).tokens
        results.append((logits, toks))
        if engram == "disk":
            assert m.engram_stores and all(
                len(s.source.parts) == 1 and s.source.parts[0].path.suffix == ".engram"
                for s in m.engram_stores.values())
            for s in m.engram_stores.values():
                s.close()
    (l0, t0), *rest = results
    assert len(t0) == 6
    for logits, toks in rest:
        assert torch.equal(logits, l0) and toks == t0


def test_stacked_reader(packs):
    """WeightReader.stacked: one read of the stacked tensor from a pack, E reads from a folder,
    the same bytes either way."""
    src, dst = packs["exl3"]
    a, b = WeightReader(open_checkpoint(src)), WeightReader(open_checkpoint(dst))
    loads = []
    real = b.loader.load
    b.loader.load = lambda info: loads.append(info.name) or real(info)
    for suffix in ("w1.trellis", "w1.suh", "w2.svh", "w3.mul1"):
        assert b.is_stacked("layers.2.ffn.experts", suffix)
        assert not a.is_stacked("layers.2.ffn.experts", suffix)
        x = a.stacked("layers.2.ffn.experts", suffix, 8)
        y = b.stacked("layers.2.ffn.experts", suffix, 8)
        assert x.dtype == y.dtype and x.shape == y.shape and x.shape[0] == 8
        assert torch.equal(_raw(x), _raw(y))
        assert torch.equal(_raw(y[3]), _raw(a.tensor(f"layers.2.ffn.experts.3.{suffix}")))
    assert loads == [f"layers.2.ffn.experts.{s}" for s in ("w1.trellis", "w1.suh", "w2.svh",
                                                           "w3.mul1")]
    with pytest.raises(CheckpointError, match="shape"):
        b.stacked("layers.2.ffn.experts", "w1.trellis", 8, shape=(1, 2, 3))
    with pytest.raises(CheckpointError, match="missing"):
        b.stacked("layers.2.ffn.experts", "w1.trellis", 9)
    a.loader.close()
    b.loader.close()


def test_engram_records_load_into_device_tables(packs, tmp_path):
    """The in-device Engram path reads both columns from the record file in one pass."""
    src, dst = packs["official"]
    folder = open_checkpoint(dst)
    loader = TensorLoader("cpu", buffer_bytes=4096, n_buffers=2)
    w = WeightReader(folder, "cpu", loader)
    table = next(iter(folder.engram_tables))
    before = loader.bytes_loaded
    rows = w.tensor(f"{table}.weight", "F8_E4M3")
    mid = loader.bytes_loaded
    scale = w.tensor(f"{table}.scale", ("F8_E8M0", "U8"))
    assert loader.bytes_loaded == mid  # the scales came in the same pass
    assert mid - before == (dst / folder.engram_tables[table].path.name).stat().st_size
    with CheckpointFolder(src) as f:
        assert torch.equal(_raw(rows), _raw(f.read(f"{table}.weight")))
        assert torch.equal(_raw(scale), _raw(f.read(f"{table}.scale")))
    loader.close()


# ---- a pack that does not match its manifest -----------------------------------------------

def _flip_byte(path: Path, keep_mtime: bool = False) -> None:
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size - 3)
        b = f.read(1)
        f.seek(st.st_size - 3)
        f.write(bytes([b[0] ^ 0x5A]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def _edit_manifest(dst: Path, fn) -> None:
    m = json.loads((dst / MANIFEST_NAME).read_text())
    fn(m)
    (dst / MANIFEST_NAME).write_text(json.dumps(m))


def _record(m: dict, name: str) -> dict:
    return next(r for r in m["files"] if r["name"] == name)


BAD = {
    # case: (damage, verify mode, file named, words in the message)
    "edited file": (lambda d: _flip_byte(d / "layer-003.safetensors"), "size",
                    "layer-003.safetensors", "checksum mismatch"),
    "edited file, mtime kept": (lambda d: _flip_byte(d / "layer-006.safetensors", True), "full",
                                "layer-006.safetensors", "checksum mismatch"),
    "missing file": (lambda d: (d / "layer-005.safetensors").unlink(), "size",
                     "layer-005.safetensors", "missing"),
    "wrong size": (lambda d: _append(d / "layer-004.engram", b"\0" * 33), "size",
                   "layer-004.engram", "wrong size"),
    "truncated": (lambda d: os.truncate(d / "mtp-1.safetensors", 1000), "none",
                  "mtp-1.safetensors", ""),
    "checksum mismatch": (lambda d: _edit_manifest(d, lambda m: _record(m, "globals.safetensors")
                                                   .update(sha256="0" * 64)), "full",
                          "globals.safetensors", "checksum mismatch"),
    "tensor list": (lambda d: _edit_manifest(d, lambda m: _record(m, "layer-002.safetensors")
                                             ["tensors"].append("layers.2.extra")), "size",
                    "layer-002.safetensors", "do not match the pack manifest"),
    "interrupted": (lambda d: (d / MANIFEST_NAME).rename(d / PARTIAL_NAME), "size",
                    "", "incomplete"),
    "bad manifest": (lambda d: (d / MANIFEST_NAME).write_text("{not json"), "size",
                     MANIFEST_NAME, "cannot read the pack manifest"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_pack_is_refused_before_any_weight_loads(packs, tmp_path, case, capsys):
    damage, verify, culprit, words = BAD[case]
    dst = Path(shutil.copytree(packs["official"][1], tmp_path / "pack"))
    # A copy has new mtimes: a re-stamp (strata pack --verify) makes size checks cheap again.
    verify_pack(dst, progress=False)
    damage(dst)
    loader = TensorLoader("cpu", buffer_bytes=4096)
    loaded = []
    for fn in ("load", "load_into"):
        real = getattr(loader, fn)
        setattr(loader, fn, lambda info, *a, _r=real: loaded.append(info.name) or _r(info, *a))
    with pytest.raises(CheckpointError) as ei:
        Model.load(dst, cache_dir=tmp_path, loader=loader, verify=verify)
    msg = str(ei.value)
    assert str(dst / culprit) in msg and words in msg, msg
    assert loaded == [], "weights streamed from a pack that failed its checks"
    # `strata pack --verify` refuses it too, naming the file.
    assert main(["pack", "--verify", str(dst), "--quiet"]) == 2
    assert str(dst / culprit) in capsys.readouterr().err


def test_edit_after_restamp_caught_by_full_check_only(packs, tmp_path):
    dst = Path(shutil.copytree(packs["exl3"][1], tmp_path / "pack"))
    assert verify_pack(dst, progress=False)[0] > 10
    _flip_byte(dst / "layer-002.safetensors", keep_mtime=True)
    PackFolder(dst)  # sizes and mtimes match: a size-only check cannot see it
    with pytest.raises(CheckpointError, match="layer-002.safetensors: checksum mismatch"):
        PackFolder(dst, verify="full")


# ---- resume -------------------------------------------------------------------------------

def test_interrupted_pack_resumes(packs, tmp_path, monkeypatch):
    src, ref = packs["exl3-routed"]
    dst = tmp_path / "pack"
    calls = []
    real = pack_mod._write_planned

    def interrupt_after_six(pipe, p, path):
        calls.append(p.name)
        if len(calls) == 7:
            # Die inside the seventh file: part of it is written, then the process "crashes".
            monkeypatch.setattr(pipe, "_read_range",
                                lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
        return real(pipe, p, path)

    monkeypatch.setattr(pack_mod, "_write_planned", interrupt_after_six)
    with pytest.raises(KeyboardInterrupt):
        pack(src, dst, buffer_bytes=4096, progress=False)
    monkeypatch.setattr(pack_mod, "_write_planned", real)
    assert not (dst / MANIFEST_NAME).exists() and (dst / PARTIAL_NAME).exists()
    assert not list(dst.glob("*.tmp"))
    done = [r["name"] for r in json.loads((dst / PARTIAL_NAME).read_text())["files"]]
    assert done == calls[:6]
    with pytest.raises(CheckpointError, match="incomplete"):
        Model.load(dst, cache_dir=tmp_path)
    # One finished file is damaged meanwhile (same size): resume must redo it.
    victim = next(n for n in done if n.endswith(".safetensors"))
    _flip_byte(dst / victim)
    r = pack(src, dst, buffer_bytes=4096, progress=False)
    assert sorted(r.reused) == sorted(n for n in done if n != victim)
    assert victim in r.written and calls[6] in r.written
    want = {x["name"]: x["sha256"] for x in json.loads((ref / MANIFEST_NAME).read_text())["files"]}
    got = {x["name"]: x["sha256"] for x in json.loads((dst / MANIFEST_NAME).read_text())["files"]}
    assert got == want and not (dst / PARTIAL_NAME).exists()
    # Running again over a complete pack rewrites nothing.
    again = pack(src, dst, progress=False)
    assert again.written == [] and len(again.reused) == len(want)


def test_refusals(packs, tmp_path, monkeypatch):
    src, dst = packs["official"]
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not empty"):
        pack(src, busy, progress=False)
    with pytest.raises(CheckpointError, match="already a strata pack"):
        pack(dst, tmp_path / "again", progress=False)
    with pytest.raises(CheckpointError, match="this is a strata pack"):
        CheckpointFolder(dst)
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config"):
        pack(broken, tmp_path / "never", progress=False)
    assert not (tmp_path / "never").exists()
    monkeypatch.setattr(pack_mod.shutil, "disk_usage",
                        lambda p: type("Usage", (), {"free": 1000})())
    with pytest.raises(CheckpointError, match="disk space"):
        pack(src, tmp_path / "full", progress=False)


@pytest.mark.parametrize("fmt", ["official", "exl3"])
def test_a_checkpoint_the_engine_cannot_load_is_refused_before_packing(packs, tmp_path, fmt,
                                                                       capsys):
    """Before any file is written the model is built on the meta device from the source's
    headers (pack.check_loadable): a tensor missing, or one of the wrong shape, is named —
    and `strata inspect` reports the same check."""
    from safetensors.torch import load_file, save_file
    src = packs[fmt][0]
    index = json.loads((src / INDEX_NAME).read_text())
    name = sorted(n for n in index["weight_map"] if n.startswith("layers.1.attn."))[0]
    for case in ("missing", "shape"):
        bad = tmp_path / f"{case}-src"
        shutil.copytree(src, bad)
        shard = bad / index["weight_map"][name]
        tensors = load_file(shard)
        if case == "missing":
            del tensors[name]
            idx = json.loads((bad / INDEX_NAME).read_text())
            del idx["weight_map"][name]
            (bad / INDEX_NAME).write_text(json.dumps(idx))
        else:
            tensors[name] = torch.cat([tensors[name], tensors[name][:1]])
        save_file(tensors, shard)
        with pytest.raises(CheckpointError, match=re.escape(name)):
            pack(bad, tmp_path / f"{case}-pack", progress=False)
        assert not (tmp_path / f"{case}-pack").exists()
        capsys.readouterr()
        assert main(["inspect", str(bad)]) == 0
        assert f"engine check: FAILED: tensor {name}" in capsys.readouterr().out


def test_a_changed_source_is_packed_again_and_another_ones_pack_is_kept(packs, tmp_path):
    """Resuming keeps only files made from the same bytes: a shard replaced by another of the
    same size (a re-download) gets its files written again, and the pack then equals a fresh
    pack of the new shard's model. A pack of another source is refused, not overwritten."""
    src0, _ = packs["official"]
    src = tmp_path / "src"
    shutil.copytree(src0, src)
    dst = tmp_path / "pack"
    pack(src, dst, progress=False)
    other = make_tiny(tmp_path / "seed1", "tiny", seed=1, fmt="official")
    shard = sorted(p.name for p in src.glob("model-*.safetensors"))[1]
    assert (other / shard).stat().st_size == (src / shard).stat().st_size
    shutil.copyfile(other / shard, src / shard)
    os.utime(src / shard, ns=(1, 1))  # (a different time, whatever this machine's clock does)
    r = pack(src, dst, progress=False)
    assert r.written and r.reused
    fresh = pack(src, tmp_path / "fresh", progress=False).path
    sums = lambda d: {x["name"]: x["sha256"]
                      for x in json.loads((d / MANIFEST_NAME).read_text())["files"]}
    assert sums(dst) == sums(fresh)
    before = sums(dst)
    with pytest.raises(CheckpointError, match="holds a pack of"):
        pack(other, dst, progress=False)
    assert sums(dst) == before and verify_pack(dst, restamp=False) is not None


def test_verify_names_every_bad_file(packs, tmp_path):
    _, ref = packs["official"]
    dst = tmp_path / "copy"
    shutil.copytree(ref, dst)
    names = [r["name"] for r in json.loads((ref / MANIFEST_NAME).read_text())["files"]
             if r["name"].endswith(".safetensors")]
    _flip_byte(dst / names[0])
    (dst / names[1]).unlink()
    with pytest.raises(CheckpointError, match="2 pack files are bad") as e:
        verify_pack(dst, restamp=False)
    assert names[0] in str(e.value) and "checksum mismatch" in str(e.value)
    assert names[1] in str(e.value) and "missing from the pack" in str(e.value)


def test_verifying_a_read_only_pack_reports_the_check(packs, tmp_path, monkeypatch):
    """--verify of a pack it cannot write (a read-only mount; mocked: the manifest's write
    fails as such a mount fails it) still verifies and says what it could not record."""
    _, ref = packs["official"]
    dst = tmp_path / "copy"
    shutil.copytree(ref, dst, copy_function=shutil.copyfile)  # (new times: to record)

    def read_only(path, data):
        raise OSError(30, "Read-only file system", str(path))
    monkeypatch.setattr(pack_mod, "_write_json", read_only)
    with pytest.warns(UserWarning, match="Read-only file system"):
        files, nbytes, _ = verify_pack(dst)
    assert files == len(json.loads((ref / MANIFEST_NAME).read_text())["files"]) and nbytes > 0


# ---- command line --------------------------------------------------------------------------

def test_cli_pack_inspect_verify_generate(packs, tmp_path, capsys):
    src = packs["exl3"][0]
    dst = tmp_path / "p"
    assert main(["inspect", str(src)]) == 0
    out = capsys.readouterr().out
    assert ": EXL3;" in out and "format: EXL3 full" in out and "disk needed to pack it" in out
    assert main(["pack", str(src), str(dst), "--quiet", "--buffer-mb", "1"]) == 0
    assert "18 written" in capsys.readouterr().out
    assert main(["inspect", str(dst)]) == 0
    out = capsys.readouterr().out
    assert "strata pack of EXL3 full" in out and "every file present" in out
    experts = next(line for line in out.splitlines() if "routed experts" in line)
    assert "2.5: 192" in experts  # K per group, read through the stacked tensors
    assert main(["pack", "--verify", str(dst), "--quiet"]) == 0
    assert "checksums match" in capsys.readouterr().out
    gen = ["generate", "--tokens", "5,6,7", "--max-tokens", "3", "--json", "--quiet"]
    assert main(gen + ["--model", str(src)]) == 0
    want = json.loads(capsys.readouterr().out)["tokens"]
    assert main(gen + ["--model", str(dst)]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == want
    _flip_byte(dst / "layer-001.safetensors")
    assert main(["inspect", str(dst)]) == 0
    assert "MISMATCH" in capsys.readouterr().out
    assert main(["pack", "--verify", str(dst), "--quiet"]) == 2
    assert "layer-001.safetensors: checksum mismatch" in capsys.readouterr().err
    assert main(["pack", str(src)]) == 2


# ---- host memory --------------------------------------------------------------------------

BUFFER_BYTES = 4 * MiB
N_BUFFERS = 4
# Beyond the pool: one buffer of Engram scratch (pack) or of record chunk (load), allocator
# rounding, thread stacks, page-granular RSS. Holding one shard (~150 MB) or a second copy of
# the weights exceeds this many times.
MARGIN_BYTES = 24 * MiB

CHILD = textwrap.dedent("""
    import sys
    import torch
    from strata.bench.memory import PeakRss
    from strata.checkpoint.loader import TensorLoader
    from strata.checkpoint.pack import open_checkpoint, pack
    from strata.checkpoint.weights import WeightReader

    mode, src, dst, buffer_bytes, n_buffers = sys.argv[1:4] + [int(a) for a in sys.argv[4:6]]
    if mode != "pack":
        folder = open_checkpoint(dst)
        names = folder.names()
    torch.empty(1) + 1
    kept = []
    with PeakRss() as rss:
        if mode == "pack":
            pack(src, dst, buffer_bytes=buffer_bytes, n_buffers=n_buffers, progress=False)
        else:
            with TensorLoader("cpu", buffer_bytes=buffer_bytes, n_buffers=n_buffers) as loader:
                w = WeightReader(folder, "cpu", loader)
                for name in names:
                    kept.append(w.tensor(name))
    kept_bytes = sum(t.numel() * t.element_size() for t in kept)
    print(rss.over - kept_bytes, kept_bytes)
""")



@pytest.fixture(scope="module")
def big_ckpt(tmp_path_factory) -> Path:
    """~290 MB in two shards: 2 layers × 8 experts × 3 fp4 linears of 3 MiB (+ scales), a
    64 MiB embedding and a 64 MiB Engram table (+ 2 MiB of scales)."""
    folder = tmp_path_factory.mktemp("bigsrc")
    weight_map: dict[str, str] = {}

    def shard(name: str, tensors: dict, dtypes: dict) -> None:
        write_safetensors(folder / name, tensors, dtypes)
        weight_map.update({t: name for t in tensors})

    for layer in range(2):
        tensors, dtypes = {}, {}
        if layer == 0:
            tensors["embed.weight"] = torch.full((16384, 2048), 0.5, dtype=torch.bfloat16)
        for e in range(8):
            for i, proj in enumerate(("w1", "w2", "w3")):
                p = f"layers.{layer}.ffn.experts.{e}.{proj}"
                tensors[f"{p}.weight"] = torch.full((1536, 2048), e * 3 + i, dtype=torch.int8)
                tensors[f"{p}.scale"] = torch.full((1536, 128), 127, dtype=torch.uint8)
                dtypes[f"{p}.weight"], dtypes[f"{p}.scale"] = "I8", "F8_E8M0"
        if layer == 1:
            rows = 1 << 18
            tensors["layers.1.engram.embed.weight"] = torch.full(
                (rows, 256), 7, dtype=torch.uint8).view(torch.float8_e4m3fn)
            tensors["layers.1.engram.embed.scale"] = torch.full((rows, 8), 127, dtype=torch.uint8)
            dtypes["layers.1.engram.embed.scale"] = "F8_E8M0"
        shard(f"model-{layer:05d}.safetensors", tensors, dtypes)
        del tensors
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def _overhead(mode: str, src: Path, dst: Path) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(src), str(dst),
                          str(BUFFER_BYTES), str(N_BUFFERS)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    over, kept = out.stdout.split()
    return int(over), int(kept)


def test_host_memory_is_bounded_when_packing_and_loading_a_pack(big_ckpt, tmp_path):
    dst = tmp_path / "bigpack"
    pack_over, _ = _overhead("pack", big_ckpt, dst)
    bound = BUFFER_BYTES * (N_BUFFERS + 1) + MARGIN_BYTES
    assert pack_over <= bound, (
        f"packing used {pack_over / MiB:.1f} MiB; allowed {bound / MiB:.0f} MiB")
    with PackFolder(dst) as folder:
        total = folder.total_bytes()
        assert len(folder.stacked_names()) == 12 and folder.engram_tables
    load_over, kept = _overhead("load", big_ckpt, dst)
    assert kept == total > 280 * MiB
    assert load_over <= bound, (
        f"loading the pack used {load_over / MiB:.1f} MiB beyond the {kept / MiB:.0f} MiB of "
        f"weights it keeps; allowed {bound / MiB:.0f} MiB")
