"""The disk-resident Engram store returns exactly the rows of the in-memory table, whatever the
cache holds, with and without prefetch, from several threads, in both on-disk layouts."""
from __future__ import annotations

import os
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from strata.checkpoint.encodings import dequant_engram_rows
from strata.checkpoint.safetensors_io import SafetensorsFile, write_safetensors
from strata.engram_store import (INDEX_BYTES_PER_ROW, EngramStore, RowSource, pack_records,
                                 record_bytes)
from strata.errors import CheckpointError
from strata.model.model import Model
from strata.model.numerics import Numerics

N_ROWS, DIM = 700, 64  # 66-byte records; 700 rows span several 4 KiB pages in each part


def cache_bytes(rows: int) -> int:
    return rows * (record_bytes(DIM) + INDEX_BYTES_PER_ROW)


def random_table(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bytes, so every e4m3 and ue8m0 code (NaN included) is exercised."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 256, (N_ROWS, DIM), generator=g, dtype=torch.uint8)
    scale = torch.randint(0, 256, (N_ROWS, DIM // 32), generator=g, dtype=torch.uint8)
    return rows.view(torch.float8_e4m3fn), scale


def expected(rows: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    flat = ids.reshape(-1)
    return dequant_engram_rows(rows[flat], scale[flat]).view(*ids.shape, -1)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality (NaN rows included)."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def write_official(dirpath: Path, rows, scale, scale_dtype: str, split: bool) -> RowSource:
    """The checkpoint layout, with a filler tensor first so offsets are not trivial; `split`
    puts the scales in a second file, as the real shards often do."""
    filler = torch.zeros(37, dtype=torch.uint8)
    a, b = dirpath / "shard-a.safetensors", dirpath / "shard-b.safetensors"
    if split:
        write_safetensors(a, {"filler": filler, "t.weight": rows})
        write_safetensors(b, {"t.scale": scale}, dtypes={"t.scale": scale_dtype})
    else:
        write_safetensors(a, {"filler": filler, "t.weight": rows, "t.scale": scale},
                          dtypes={"t.scale": scale_dtype})
        b = a
    with SafetensorsFile(a) as fa, SafetensorsFile(b) as fb:
        return RowSource.official(fa.info("t.weight"), fb.info("t.scale"))


def write_packed(path: Path, rows, scale, offset: int = 100) -> RowSource:
    with open(path, "wb") as f:
        f.write(b"\xab" * offset)  # stands for a pack header
        f.write(pack_records(rows, scale).tobytes())
    return RowSource.packed(path, N_ROWS, DIM, offset)


def request_stream(seed: int, n: int):
    """Random [T, 24] id requests with repeats inside and across requests."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        T = int(torch.randint(1, 6, (1,), generator=g))
        yield torch.randint(0, N_ROWS, (T, 24), generator=g)


@pytest.fixture(scope="module")
def table():
    return random_table(1)


# The packed layout stores scales as raw bytes, so it has no scale dtype of its own.
@pytest.mark.parametrize("layout,scale_dtype", [("official", "F8_E8M0"), ("official", "U8"),
                                                ("official-split", "F8_E8M0"),
                                                ("official-split", "U8"), ("packed", None)])
@pytest.mark.parametrize("cache_rows", [0, 3, N_ROWS])
@pytest.mark.parametrize("prefetch", [False, True])
def test_random_access_exact(tmp_path, table, layout, scale_dtype, cache_rows, prefetch):
    rows, scale = table
    if layout == "packed":
        src = write_packed(tmp_path / "t.bin", rows, scale)
    else:
        src = write_official(tmp_path, rows, scale, scale_dtype, layout == "official-split")
    reqs = list(request_stream(seed=7, n=25))
    with EngramStore(src, cache_bytes=cache_bytes(cache_rows), io_threads=3) as store:
        for i, ids in enumerate(reqs):
            if prefetch and i + 1 < len(reqs):
                store.prefetch(reqs[i + 1])  # the next step's rows, while this one runs
            assert same_bits(store.lookup(ids), expected(rows, scale, ids))
            assert store.cached_rows <= cache_rows
        st = store.stats()
    assert st.lookups == len(reqs)
    assert st.cache_hits + st.prefetch_hits + st.misses == st.unique_rows
    if cache_rows == 0:
        assert st.cache_hits == 0
    if prefetch:
        assert st.prefetch_rows > 0
    else:
        assert st.prefetch_rows == 0 and st.prefetch_hits == 0
    if cache_rows == N_ROWS:
        assert st.rows_read <= N_ROWS  # each row read at most once when everything fits


def test_duplicates_in_one_request(tmp_path, table):
    rows, scale = table
    src = write_official(tmp_path, rows, scale, "F8_E8M0", split=False)
    ids = torch.tensor([[5, 5, 5, 9], [9, 5, 699, 0], [0, 0, 699, 5]])
    with EngramStore(src, cache_bytes=cache_bytes(1), io_threads=2) as store:
        assert same_bits(store.lookup(ids), expected(rows, scale, ids))
        st = store.stats()
        assert st.rows_requested == 12 and st.unique_rows == 4 and st.rows_read == 4
        one = torch.full((3, 2), 42)
        assert same_bits(store.lookup(one), expected(rows, scale, one))


def test_cache_serves_repeats_without_reads(tmp_path, table):
    rows, scale = table
    src = write_packed(tmp_path / "t.bin", rows, scale)
    ids = torch.randint(0, N_ROWS, (4, 24), generator=torch.Generator().manual_seed(3))
    with EngramStore(src, cache_bytes=cache_bytes(N_ROWS)) as store:
        first = store.lookup(ids)
        read = store.stats().rows_read
        second = store.lookup(ids)
        st = store.stats()
    assert same_bits(first, second)
    assert st.rows_read == read  # nothing read again
    assert st.cache_hits == ids.unique().numel()
    assert 0.4 < st.hit_rate <= 0.5  # half the unique lookups were hits


def test_a_cache_budget_above_the_table_holds_the_table(tmp_path, table):
    """Slots are never more than the table's rows: a budget of a petabyte is the table."""
    rows, scale = table
    src = write_packed(tmp_path / "t.bin", rows, scale)
    ids = torch.arange(N_ROWS).view(1, -1)
    with EngramStore(src, cache_bytes=1 << 50) as store:
        assert store.capacity == N_ROWS
        assert same_bits(store.lookup(ids), expected(rows, scale, ids))


def test_lru_keeps_recent_rows(tmp_path, table):
    rows, scale = table
    src = write_packed(tmp_path / "t.bin", rows, scale)
    with EngramStore(src, cache_bytes=cache_bytes(3), io_threads=1) as store:
        for r in (1, 2, 3, 1, 4):  # 1 is refreshed, so 2 is evicted by 4
            store.lookup(torch.tensor([r]))
        before = store.stats().rows_read
        store.lookup(torch.tensor([1, 3, 4]))
        assert store.stats().rows_read == before
        store.lookup(torch.tensor([2]))
        assert store.stats().rows_read == before + 1


def test_reads_per_row_by_layout(tmp_path, table):
    """The packed layout needs one read per row, the official one a weight and a scale read;
    adjacent rows are coalesced into one read."""
    rows, scale = table
    spread = torch.arange(0, N_ROWS, 140)  # 140·66 B apart: no two rows share a 4 KiB page
    packed = write_packed(tmp_path / "t.bin", rows, scale, offset=0)
    official = write_official(tmp_path, rows, scale, "F8_E8M0", split=True)
    opts = dict(cache_bytes=0, merge_gap_bytes=0, io_threads=1)
    with EngramStore(packed, **opts) as store:
        store.lookup(spread)
        assert store.stats().read_calls == spread.numel()
    with EngramStore(official, **opts) as store:
        store.lookup(spread)
        # weights: one read each; the 2-byte scale rows all sit in one page → fewer reads
        assert spread.numel() + 1 <= store.stats().read_calls <= 2 * spread.numel()
    with EngramStore(packed, **opts) as store:
        dense = torch.arange(100, 200)
        assert same_bits(store.lookup(dense), expected(rows, scale, dense))
        # One batch (io_threads=1) whose 100 adjacent rows (6.6 KB) are coalesced into one read.
        assert store.stats().read_calls == 1
        assert store.stats().rows_read == 100


def test_concurrent_threads(tmp_path, table):
    rows, scale = table
    src = write_official(tmp_path, rows, scale, "U8", split=True)
    errors: list[BaseException] = []
    with EngramStore(src, cache_bytes=cache_bytes(3), io_threads=4) as store:
        def worker(seed: int) -> None:
            try:
                reqs = list(request_stream(seed, 30))
                for i, ids in enumerate(reqs):
                    if seed % 2 and i + 1 < len(reqs):
                        store.prefetch(reqs[i + 1])
                    if not same_bits(store.lookup(ids), expected(rows, scale, ids)):
                        raise AssertionError(f"thread {seed}: wrong rows at request {i}")
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        st = store.stats()
    assert not errors, errors[0]
    assert st.lookups == 8 * 30
    assert st.cache_hits + st.prefetch_hits + st.misses == st.unique_rows


@pytest.mark.parametrize("refuses", ["open", "aligned read"])
def test_buffered_fallback_when_direct_is_refused(tmp_path, table, monkeypatch, refuses):
    """Filesystems refuse O_DIRECT at open (older tmpfs) or at the first read (some overlay
    setups): the store says why and reads buffered, with the same rows; direct=True fails."""
    rows, scale = table
    path = tmp_path / "t.bin"
    src = write_packed(path, rows, scale)
    real_open, real_preadv = os.open, os.preadv
    direct_fds: set[int] = set()

    def fake_open(p, flags, *a):
        if flags & os.O_DIRECT and refuses == "open":
            raise OSError(22, "Invalid argument")
        fd = real_open(p, flags, *a)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def fake_preadv(fd, bufs, off):
        if fd in direct_fds:
            raise OSError(22, "Invalid argument")
        return real_preadv(fd, bufs, off)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "preadv", fake_preadv)
    with EngramStore(src, direct=None) as store:
        assert store.io_mode == f"buffered (O_DIRECT unavailable: {refuses} failed: " \
                               "Invalid argument)"
        assert not store.direct
        ids = torch.arange(0, N_ROWS, 3)
        assert same_bits(store.lookup(ids), expected(rows, scale, ids))
    with pytest.raises(CheckpointError, match=f"{path}: O_DIRECT was required"):
        EngramStore(src, direct=True)


def test_tmpfs_file(table):
    """A table in /dev/shm (tmpfs: O_DIRECT refused before Linux 6.6, allowed after) reads the
    same rows on whichever path the running kernel allows."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.fail("/dev/shm (tmpfs) is needed for this test")
    rows, scale = table
    path = shm / f"strata-engram-test-{os.getpid()}.bin"
    try:
        src = write_packed(path, rows, scale)
        with EngramStore(src, direct=None, cache_bytes=0) as store:
            assert store.io_mode == "O_DIRECT" or store.io_mode.startswith("buffered (O_DIRECT")
            ids = torch.arange(0, N_ROWS, 3)
            assert same_bits(store.lookup(ids), expected(rows, scale, ids))
    finally:
        path.unlink(missing_ok=True)


def test_direct_and_buffered_paths_agree(tmp_path, table):
    """Whichever path the test filesystem allows runs under direct=None; buffered always."""
    rows, scale = table
    src = write_official(tmp_path, rows, scale, "F8_E8M0", split=True)
    ids = torch.randint(0, N_ROWS, (9, 24), generator=torch.Generator().manual_seed(5))
    with EngramStore(src, direct=None, cache_bytes=0) as a, \
            EngramStore(src, direct=False, cache_bytes=0) as b:
        assert b.io_mode == "buffered (O_DIRECT not requested)"
        assert a.io_mode == "O_DIRECT" or a.io_mode.startswith("buffered (O_DIRECT unavailable")
        ra, rb = a.lookup(ids), b.lookup(ids)
        assert same_bits(ra, rb) and same_bits(ra, expected(rows, scale, ids))
        if a.direct:  # whole aligned pages are read
            assert a.stats().bytes_read > b.stats().bytes_read


def test_truncated_packed_file_names_file(tmp_path, table):
    rows, scale = table
    path = tmp_path / "short.bin"
    src = write_packed(path, rows, scale)
    os.truncate(path, 100 + (N_ROWS - 1) * record_bytes(DIM))
    with pytest.raises(CheckpointError, match=f"{path}.*truncated"):
        EngramStore(src)


def test_wrong_offsets_name_file(tmp_path, table):
    rows, scale = table
    src = write_official(tmp_path, rows, scale, "F8_E8M0", split=True)
    bad_part = replace(src.parts[1], base=src.parts[1].base + 10_000)
    bad = replace(src, parts=(src.parts[0], bad_part))
    with pytest.raises(CheckpointError, match=f"{bad_part.path}.*wrong offsets"):
        EngramStore(bad)


def test_file_truncated_after_open_names_file(tmp_path, table):
    rows, scale = table
    path = tmp_path / "t.bin"
    src = write_packed(path, rows, scale)
    with EngramStore(src, cache_bytes=0) as store:
        os.truncate(path, 100 + 10 * record_bytes(DIM))
        assert same_bits(store.lookup(torch.tensor([3])), expected(rows, scale, torch.tensor([3])))
        with pytest.raises(CheckpointError, match=f"{path}: unexpected end of file"):
            store.lookup(torch.tensor([2, 600]))
        with pytest.raises(CheckpointError, match=str(path)):
            store.prefetch(torch.tensor([650]))  # the failure surfaces in the lookup
            store.lookup(torch.tensor([650]))


def test_bad_ids_and_layouts(tmp_path, table):
    rows, scale = table
    src = write_packed(tmp_path / "t.bin", rows, scale)
    with EngramStore(src) as store:
        with pytest.raises(IndexError, match="row id 700 out of range"):
            store.lookup(torch.tensor([1, 700]))
        with pytest.raises(IndexError, match="row id -1"):
            store.prefetch(torch.tensor([-1]))
    path = tmp_path / "x.safetensors"
    write_safetensors(path, {"w": rows, "s": scale[:, :1]})
    with SafetensorsFile(path) as f, pytest.raises(CheckpointError, match=f"{path}.*'s'"):
        RowSource.official(f.info("w"), f.info("s"))
    with pytest.raises(CheckpointError, match="cannot open"):
        EngramStore(RowSource.packed(tmp_path / "missing.bin", 4, DIM))


def test_model_with_disk_engram_is_bit_identical(tiny_dir, tiny_reference):
    """The whole model: disk store (tiny cache, prefetch for the decode steps) == in-memory."""
    disk = Model.load(tiny_dir, "cpu", Numerics(mode="reference"), engram="disk",
                      engram_cache_bytes=2 * cache_bytes(5), engram_options={"io_threads": 2})
    assert sorted(disk.engram_stores) == list(disk.cfg.engram_layer_ids)
    tokens = torch.randint(3, 320, (20,), generator=torch.Generator().manual_seed(11))
    s_mem, s_disk = tiny_reference.new_state(64), disk.new_state(64)
    want, _ = tiny_reference.forward(tokens[:16], s_mem)
    got, _ = disk.forward(tokens[:16], s_disk)
    assert torch.equal(want, got)
    hashes = []
    real = disk.hasher.ids
    disk.hasher.ids = lambda *a: (hashes.append(1), real(*a))[1]
    for t in tokens[16:]:
        disk.prefetch_engram(t.view(1), s_disk)
        want, _ = tiny_reference.forward(t.view(1), s_mem)
        got, _ = disk.forward(t.view(1), s_disk)
        assert torch.equal(want, got)
    assert len(hashes) == 4  # a step's token hashed once: the prefetch's ids reused
    for layer, store in disk.engram_stores.items():
        st = store.stats()
        assert st.rows_read > 0 and st.prefetch_rows > 0, (layer, st)
        assert store.cached_rows <= 5
    for store in disk.engram_stores.values():
        store.close()


@pytest.mark.parametrize("mode", ["plain", "dspark"])
def test_sessions_prefetch_every_row_before_it_is_needed(tiny_dir, tiny_reference, mode):
    """Generation over disk tables: same tokens as in-memory tables, and no lookup ever
    misses — each token's rows were requested (prefetch) before the layer asked for them:
    when the token was sampled, when drafts were known, or at the start of the forward."""
    from strata.runtime.session import Session
    from strata.runtime.speculative import SpecConfig
    disk = Model.load(tiny_dir, "cpu", Numerics(mode="reference"), engram="disk",
                      engram_cache_bytes=2 * cache_bytes(400), engram_options={"io_threads": 2})
    prompt = torch.randint(3, 320, (9,), generator=torch.Generator().manual_seed(5))
    spec = SpecConfig(length=3) if mode == "dspark" else None
    run = dict(max_tokens=12, stop_ids=frozenset(), mode=mode)  # no early stop
    want = Session(tiny_reference, 64, speculative=spec).run(prompt, **run).tokens
    got = Session(disk, 64, speculative=spec).run(prompt, **run).tokens
    assert got == want and len(got) == 12
    for layer, store in disk.engram_stores.items():
        st = store.stats()
        assert st.misses == 0 and st.prefetch_rows > 0 and st.rows_read > 0, (layer, st)
        store.close()


@pytest.mark.parametrize("layout", ["packed", "official"])
def test_bench_runs_small(tmp_path, layout):
    """The benchmark end to end at a CI size (its file's folder made for it): both layouts
    hold the same record count, and a bigger cache never hits less on the same Zipf stream."""
    from strata.bench.engram import format_report, run, zipf_ids
    r = run(tmp_path / "new" / "t.bin", 300_000, layout, io_threads=2, decode_steps=20,
            prefill_chunks=1, prefill_tokens=8, zipf_ids_count=2400,
            cache_fractions=(0.01, 0.1, 1.0))
    assert r["rows"] == 300_000 // 264
    assert r["cold_buffered_prefill"]["unique_rows"] > 0
    hits = list(r["zipf"]["hit_rate_by_cache_rows"].values())
    assert hits == sorted(hits) and 0 < hits[-1] < 1
    assert "rows/s" in format_report(r)
    ids = zipf_ids(np.random.default_rng(0), 1000, 5000, 1.2)
    assert ids.min() >= 0 and ids.max() < 1000
    assert np.bincount(ids).max() > 5000 / 1000 * 20  # skewed: the hottest row is far above mean
