"""The streaming loader: exact bytes through a tiny staging pool, bounded host memory, clean errors.

The memory test runs the loader in a subprocess on a ~320 MB synthetic two-shard checkpoint and
compares peak RSS with the baseline plus the bytes of weights it keeps (on CPU the weights' home
IS host memory). The same subprocess can instead do a naive whole-shard read, and the test shows
that the measurement tells the two apart, so a loader that read whole shards or kept extra copies
would fail it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from strata.checkpoint.loader import TensorLoader
from strata.checkpoint.safetensors_io import (INDEX_NAME, CheckpointFolder, SafetensorsFile,
                                              write_safetensors)
from strata.errors import CheckpointError
from strata.model.model import Model

MiB = 1 << 20


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (compare bit for bit, whatever the dtype)."""
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else t.to(torch.uint8)


@pytest.fixture
def mixed(tmp_path) -> Path:
    """One file with every kind of tensor the loader must get right."""
    g = torch.Generator().manual_seed(1)
    tensors = {
        "scalar": torch.tensor(3.5, dtype=torch.float32),
        "empty": torch.empty((0, 7), dtype=torch.bfloat16),
        "mask": torch.rand(33, generator=g) > 0.5,
        "fp8": (torch.randn(64, 96, generator=g) * 10).to(torch.float8_e4m3fn),
        "scale": torch.randint(0, 255, (2, 3), generator=g, dtype=torch.uint8),
        # 3 × 4096 + 1000 bytes: three full pieces and a short one through 4 KiB buffers.
        "big": torch.randn(3 * 1024 + 250, generator=g),
        "exact": torch.randint(-100, 100, (4096,), generator=g, dtype=torch.int8),
        "bf16": torch.randn(17, 129, generator=g).to(torch.bfloat16),
    }
    path = tmp_path / "mixed.safetensors"
    write_safetensors(path, tensors, dtypes={"scale": "F8_E8M0"})
    return path


@pytest.mark.parametrize("n_buffers", [1, 2, 4])
def test_loader_gives_the_stored_bytes(mixed, n_buffers):
    with SafetensorsFile(mixed) as f, TensorLoader("cpu", buffer_bytes=4096,
                                                   n_buffers=n_buffers) as loader:
        for name in f.names():
            got = loader.load(f.info(name))
            want = f.read(name)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(_raw(got), _raw(want)), name
            assert len(loader._buffers) <= n_buffers
        assert loader.bytes_loaded == sum(f.info(n).nbytes for n in f.names())
        # The big tensor needed several pieces in flight, so the pool grew to its bound.
        assert len(loader._buffers) == n_buffers
    assert loader._buffers == [] and loader._reader is None


def test_load_into_checks_the_destination(mixed):
    with SafetensorsFile(mixed) as f, TensorLoader("cpu", buffer_bytes=4096) as loader:
        with pytest.raises(CheckpointError, match="'big'.*destination holds"):
            loader.load_into(f.info("big"), torch.empty(10))
        out = torch.empty(f.info("big").shape)
        loader.load_into(f.info("big"), out)
        assert torch.equal(out, f.read("big"))


def test_file_truncated_after_its_header_was_read(mixed):
    """A read error names the file and tensor, and the pool is whole again afterwards."""
    f = SafetensorsFile(mixed)
    infos = {n: f.info(n) for n in f.names()}
    f.close()
    big = infos["big"]
    os.truncate(mixed, big.offset + 5000)  # cut inside the second of big's 4 pieces
    with TensorLoader("cpu", buffer_bytes=4096, n_buffers=2) as loader:
        with pytest.raises(CheckpointError) as ei:
            loader.load(big)
        msg = str(ei.value)
        assert str(mixed) in msg and "'big'" in msg and "end of file" in msg
        assert len(loader._free) == len(loader._buffers)  # nothing left checked out
        # Tensors before the cut still load through the same loader (no deadlock).
        early = [n for n, i in infos.items() if i.offset + i.nbytes <= big.offset + 5000]
        assert early
        for n in early:
            loader.load(infos[n])


def test_model_load_streams_every_weight_through_the_loader(tiny_dir, tmp_path, monkeypatch):
    loader = TensorLoader("cpu", buffer_bytes=4096, n_buffers=3)
    seen = []
    real_load = loader.load
    monkeypatch.setattr(loader, "load", lambda info: seen.append(info) or real_load(info))
    model = Model.load(tiny_dir, "cpu", cache_dir=tmp_path, loader=loader)
    assert loader._buffers == [], "Model.load must free the staging pool"
    names = [i.name for i in seen]
    assert len(names) == len(set(names)), "a tensor was read twice"
    assert loader.bytes_loaded == sum(i.nbytes for i in seen)
    with CheckpointFolder(tiny_dir) as folder:
        assert torch.equal(model.embed, folder.read("embed.weight"))
        experts = [n for n in folder.names() if ".ffn.experts." in n]
        assert experts and set(experts) <= set(names)


def test_model_load_fails_cleanly_when_a_shard_shrinks_mid_load(tiny_dir, tmp_path, monkeypatch):
    """The headers were fine when validated; the file is cut while weights stream."""
    ckpt = Path(shutil.copytree(tiny_dir, tmp_path / "ckpt"))
    index = json.loads((ckpt / INDEX_NAME).read_text())
    victim = ckpt / index["weight_map"]["layers.6.attn.wq_a.weight"]
    loader = TensorLoader("cpu", buffer_bytes=4096)
    real_load = loader.load

    cut = []

    def load_then_cut(info):
        if info.name.startswith("layers.1.") and not cut:  # well before layer 6 is read
            cut.append(victim.stat().st_size)
            os.truncate(victim, cut[0] // 2)
        return real_load(info)

    monkeypatch.setattr(loader, "load", load_then_cut)
    with pytest.raises(CheckpointError) as ei:
        Model.load(ckpt, "cpu", cache_dir=tmp_path, loader=loader)
    assert victim.name in str(ei.value) and "end of file" in str(ei.value)
    assert loader._buffers == [] and loader._fds == {}


def test_bad_pool_settings():
    with pytest.raises(ValueError, match="staging pool"):
        TensorLoader("cpu", buffer_bytes=100)
    with pytest.raises(ValueError, match="staging pool"):
        TensorLoader("cpu", n_buffers=0)


# ---- host memory --------------------------------------------------------------------------

SHARD_MB = (160, 160)
BUFFER_BYTES = 4 * MiB
N_BUFFERS = 4
# Allowed overhead beyond the weights kept and the pool: allocator rounding, the reader
# thread's stack, torch's metadata for the ~30 tensors, page-granular RSS. A loader
# that held one shard (160 MB) or a second copy of the weights (320 MB) exceeds it many times.
MARGIN_BYTES = 24 * MiB

CHILD = textwrap.dedent("""
    import sys
    import torch
    from strata.bench.memory import PeakRss
    from strata.checkpoint.loader import TensorLoader
    from strata.checkpoint.safetensors_io import CheckpointFolder

    mode, folder_path, buffer_bytes, n_buffers = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    folder = CheckpointFolder(folder_path)
    folder.validate()
    names = folder.names()
    torch.empty(1) + 1  # let torch finish its lazy initialisation before the baseline
    kept = []
    with PeakRss() as rss:
        if mode == "loader":
            with TensorLoader("cpu", buffer_bytes=buffer_bytes, n_buffers=n_buffers) as loader:
                for name in names:
                    kept.append(loader.load(folder.info(name)))
        else:  # naive: read each shard whole, then cut tensors out of it
            for shard in folder.files():
                data = shard.read_bytes()
                for name in names:
                    info = folder.info(name)
                    if info.file == shard:
                        raw = torch.frombuffer(bytearray(data[info.offset:info.offset + info.nbytes]), dtype=torch.uint8)
                        kept.append(raw)
                del data
    kept_bytes = sum(t.numel() * t.element_size() for t in kept)
    print(rss.over - kept_bytes, kept_bytes)
""")



@pytest.fixture(scope="module")
def big_ckpt(tmp_path_factory) -> Path:
    """Two ~160 MB shards of fp32/bf16/uint8 tensors from 1 to 40 MB (some bigger than a buffer)."""
    folder = tmp_path_factory.mktemp("bigckpt")
    weight_map = {}
    for s, mb in enumerate(SHARD_MB):
        tensors, total, i = {}, 0, 0
        sizes = [40 * MiB, 1 * MiB, 9 * MiB + 12, 3 * MiB, 64 << 10]
        while total < mb * 1_000_000:
            nbytes = sizes[i % len(sizes)]
            name = f"shard{s}.t{i}"
            tensors[name] = torch.full((nbytes,), i % 251, dtype=torch.uint8)
            weight_map[name] = f"model-{s:05d}.safetensors"
            total += nbytes
            i += 1
        write_safetensors(folder / f"model-{s:05d}.safetensors", tensors)
        del tensors
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def _overhead(mode: str, folder: Path) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(folder), str(BUFFER_BYTES),
                          str(N_BUFFERS)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    over, kept = out.stdout.split()
    return int(over), int(kept)


def test_host_memory_is_bounded_by_the_pool(big_ckpt):
    total = sum(p.stat().st_size for p in big_ckpt.glob("*.safetensors"))
    loader_over, kept = _overhead("loader", big_ckpt)
    naive_over, naive_kept = _overhead("naive", big_ckpt)
    assert kept == naive_kept and kept > 0.99 * (total - 4096)
    bound = BUFFER_BYTES * N_BUFFERS + MARGIN_BYTES
    assert loader_over <= bound, (
        f"loader used {loader_over / MiB:.1f} MiB beyond the {kept / MiB:.0f} MiB of weights it "
        f"keeps; allowed: pool {BUFFER_BYTES * N_BUFFERS / MiB:.0f} MiB + margin "
        f"{MARGIN_BYTES / MiB:.0f} MiB")
    # The measurement can tell a whole-shard read from streaming: the naive reader's overhead
    # is about one shard, far above the loader's bound.
    assert naive_over > 100 * 1_000_000 > bound, (naive_over, loader_over)
