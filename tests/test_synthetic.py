"""The synthetic model (strata.bench.synthetic): real config and stored formats, random weights."""
from __future__ import annotations

import os

import pytest
import torch

from strata.bench.synthetic import build_synthetic, exl3_group
from strata.config import ModelConfig
from strata.errors import StrataError
from strata.runtime.graphs import EagerReplay, GraphedForward
from strata.runtime.session import Session
from strata.runtime.speculative import SpecConfig


@pytest.fixture(scope="module")
def cfg(tiny_dir):
    return ModelConfig.from_model_dir(tiny_dir)


def test_groups():
    assert exl3_group("head") == "head"
    assert exl3_group("layers.3.ffn.experts.17.w2") == "experts.w2"
    assert exl3_group("mtp.1.ffn.experts.4.w1") == "mtp_experts"
    assert exl3_group("layers.3.ffn.shared_experts.w1") == "other"


@pytest.mark.parametrize("fmt", ["exl3", "official"])
def test_forward_and_speculative_decode(cfg, fmt):
    model, w = build_synthetic(cfg, "cpu", fmt=fmt, engram_rows=64)
    prompt = torch.arange(3, 14)
    run = dict(max_tokens=8, stop_ids=frozenset())
    plain = Session(model, 64).run(prompt, **run).tokens
    spec = Session(model, 64, speculative=SpecConfig(length=3)).run(prompt, mode="dspark", **run)
    assert spec.tokens == plain and len(plain) == 8
    logits, _ = model.forward(prompt, model.new_state(32))
    assert torch.isfinite(logits).all() and logits.std() > 0.01  # signal survives the layers
    assert set(w.stored_bytes) >= {"experts.w1", "experts.w2", "head", "other", "dense"}
    assert w.bits_per_weight() > 0


def test_step_traffic_reads_each_selected_expert_once(cfg):
    """The roofline's bytes and weights per forward: everything a decode reads once, the routed
    experts only as many as the rows select (at most all of them); never the embedding table,
    the Engram tables or the DSpark stages."""
    from strata.bench.synthetic import step_traffic
    _, w = build_synthetic(cfg, "meta")
    k, n = cfg.num_experts_per_tok, cfg.n_routed_experts
    routed = lambda name: name.startswith("layers.") and ".ffn.experts." in name
    skipped = lambda name: (name.startswith("mtp.") or name == "embed.weight"
                            or ".engram.embed." in name)
    experts = sum(v for name, v in w.tensor_bytes.items() if routed(name))
    rest = sum(v for name, v in w.tensor_bytes.items() if not routed(name) and not skipped(name))
    expert_weights = sum(v for name, v in w.linear_weights.items() if routed(name + "."))
    assert experts > 0 and rest > 0 and expert_weights > 0
    one, everything = step_traffic(w, 1), step_traffic(w, n)  # n rows select every expert
    assert one[0] == round(rest + experts * k / n)
    assert everything[0] == rest + experts
    assert everything[1] - one[1] == round(expert_weights * (1 - k / n))
    assert step_traffic(w, 2 * n) == everything
    # the head is read and decoded; the router (unquantized) is read, not decoded
    assert "head" in w.linear_weights and not any(p.endswith(".gate") for p in w.linear_weights)


def test_prefill_chunk_breakdown_runs_the_chunk_it_names(cfg):
    """A prefill chunk profiled after a context, rolled back after each run: encoder-only (the
    decoder skip's chunks: no head) or full (the head on the last row)."""
    from strata.bench.synthetic import prefill_breakdown
    model, _ = build_synthetic(cfg, "cpu", engram_rows=32)
    assert model.decoder_start is not None
    enc = prefill_breakdown(model, 40, 24, decoder=False, seed=1, chunks=2)
    full = prefill_breakdown(model, 40, 24, decoder=True, seed=1)
    assert enc["unit"] == full["unit"] == "prefill chunks" and enc["steps"] == 2
    assert {"attention", "moe", "mhc"} <= set(enc["ms"]) and "head" not in enc["ms"]
    assert {"attention", "moe", "mhc", "head"} <= set(full["ms"])


def test_prefill_runs_report_their_median(cfg):
    """--prefill-runs: each prompt timed that many times, each on a new session; the row's
    seconds are the median of its runs, and the skip's exactness is still checked."""
    import statistics

    from strata.bench.synthetic import bench_prefill
    model, _ = build_synthetic(cfg, "cpu", engram_rows=32)
    lines = []
    rows = bench_prefill(model, [60], 24, "both", seed=2, progress=lines.append, runs=3)
    assert [r["decoder_skip"] for r in rows] == [False, True]
    for r in rows:
        assert len(r["runs_seconds"]) == 3
        assert r["seconds"] == statistics.median(r["runs_seconds"])
        assert r["tok_per_s"] == 60 / r["seconds"] and r["logits_equal_to_full"]
    assert sum("(median of 3: " in line for line in lines) == 2
    one = bench_prefill(model, [60], 24, "on", seed=2)[0]
    assert one["runs_seconds"] == [one["seconds"]]


def test_layer_subset(cfg):
    model, _ = build_synthetic(cfg, "cpu", layers=[0, 1, 2], engram_rows=16)
    assert [b.layer for b in model.layers] == [0, 1, 2]


def test_disk_tables_need_their_folder(tiny_dir, capsys):
    from strata.cli import main
    assert main(["bench", "synthetic", "--config", str(tiny_dir), "--device", "cpu",
                 "--engram", "disk"]) == 2
    assert "--engram disk needs --engram-dir" in capsys.readouterr().err


def test_a_subset_without_a_layers_index_source_is_refused_by_name(cfg):
    """Layer 4 attends with layer 3's top-k selection: holding 4 without 3 names both
    (the forward would otherwise fail deep inside attention)."""
    assert cfg.index_source_of(4) == 3
    with pytest.raises(StrataError, match="layer 4 attends with layer 3's top-k selection"):
        build_synthetic(cfg, "cpu", layers=[0, 1, 2, 4], engram_rows=16)
    # a re-indexing layer picks among its candidate source's blocks
    reindex = [l for l in range(cfg.n_layers) if cfg.is_reindex(l)]
    c = cfg.candidate_source_layer_id
    with pytest.raises(StrataError, match=f"picks among layer {c}'s candidate blocks"):
        build_synthetic(cfg, "cpu", layers=list(range(reindex[0], cfg.n_layers)),
                        engram_rows=16)


def test_folded_engram_on_disk_equals_on_device(cfg, tmp_path):
    """Same seed, same folded table: reading it through the disk store changes nothing."""
    dev, _ = build_synthetic(cfg, "cpu", engram_rows=50, seed=3)
    disk, _ = build_synthetic(cfg, "cpu", engram_rows=50, seed=3, engram="disk",
                              engram_dir=tmp_path, engram_io_threads=2)
    assert sorted(disk.engram_stores) == list(cfg.engram_layer_ids) and not dev.engram_stores
    assert {st.inner.io_threads for st in disk.engram_stores.values()} == {2}
    tokens = torch.arange(40, 60)
    a, _ = dev.forward(tokens, dev.new_state(32))
    b, _ = disk.forward(tokens, disk.new_state(32))
    assert torch.equal(a, b)
    # a graphed step reads the folded table's records on the host and rebuilds the rows from
    # them (StaticStep.prepare): the graph regions run here without CUDA (EagerReplay)
    want = Session(dev, 64).run(tokens, 6, mode="plain").tokens
    s = Session(disk, 64)
    s.graphed = GraphedForward(disk, s.state, EagerReplay())
    assert s.run(tokens, 6, mode="plain").tokens == want and s.graphed.replays > 0
    for store in disk.engram_stores.values():
        assert store.stats().rows_read > 0
        store.close()


def test_cold_runs_read_every_row_from_disk(cfg, tmp_path):
    """bench_decode's before_run with the stores' drop_caches (`--engram-cache cold`): every
    run starts with an empty row cache, so each reads its rows from the files again — warm,
    the runs after the first find them cached. The tokens are the same either way."""
    from strata.bench.decode import bench_decode
    prompt = list(range(5, 17))
    read = {}
    for cache in ("warm", "cold"):
        model, _ = build_synthetic(cfg, "cpu", engram_rows=5000, seed=3, engram="disk",
                                   engram_dir=tmp_path / cache)
        stores = list(model.engram_stores.values())
        calls = []

        def cold():
            calls.append([store.drop_caches() for store in stores])
        r = bench_decode(model, prompt, ["plain"], n=6, runs=2, warmup=1,
                         before_run=cold if cache == "cold" else None)
        read[cache] = sum(store.stats().rows_read for store in stores)
        assert len(calls) == (3 if cache == "cold" else 0)
        assert all("posix_fadvise" in note or "not possible" in note
                   for notes in calls for note in notes)
        read[cache + " tokens"] = r["plain"].tokens
        for store in stores:
            store.close()
    assert read["cold tokens"] == read["warm tokens"]
    # warm: the reference run reads the rows, the three timed runs none; cold: all four
    assert read["cold"] >= 3 * read["warm"] > 0


def test_a_layer_subset_too_large_for_the_device_is_refused_before_a_weight_is_made():
    """check_fits on the published V4.1-Flash config (a meta build: nothing allocated):
    session 40's H100 (~85 GB free) ran 10 layers (0-4,20-24; peak 56.3 GB measured with a
    32K prefill) but ran out of memory deep inside the build of 20. Now 20 are refused by
    name, with the parts and how many layers fit; 10 pass, and their estimate brackets the
    measured peak."""
    from strata.bench.synthetic import check_fits, parse_layers
    from strata.config import v41_flash_config
    v41 = v41_flash_config()
    ten = check_fits(v41, parse_layers("0-4,20-24", 40), "cuda:0", int(84.9e9), context=33_000)
    assert 56.3e9 < ten < 56.3e9 + 4 * 2**30  # the peak, plus at most the reserve
    with pytest.raises(StrataError) as e:
        check_fits(v41, parse_layers("0-9,20-29", 40), "cuda:0", int(84.9e9), context=600)
    msg = str(e.value)
    assert msg.startswith("20 of 40 layers need 104.") and "84.90 GB is free" in msg
    assert "about 14 layers of ≤ 4.99 GB fit (--layers, or --layers fit)" in msg, msg
    # The folded Engram rows count only where they are kept on the device: here one table
    # (layer 1's) of 2^20 rows of 264 bytes (256 e4m3 values and their 8 scales).
    disk = check_fits(v41, parse_layers("0-4,20-24", 40), "cuda:0", int(84.9e9),
                      context=33_000, engram="disk")
    assert ten - disk == 264 * (1 << 20)


def test_layers_fit_takes_the_first_layers_of_each_half_as_memory_allows(tiny_dir, capsys):
    """`--layers fit` (fit_layers, V4.1 config on the meta device): the first k layers of each
    half, k as large as the free memory allows and each subset's index sources held — the 7 + 7
    that check_fits' hint counts on ~85 GB, 14 + 14 on an H200's ~149 GB, every layer on two
    H200s' worth, and a clear error where not even one layer of each half fits."""
    from strata.bench.synthetic import fit_layers, layers_text, parse_layers
    from strata.cli import main
    from strata.config import v41_flash_config
    v41 = v41_flash_config()
    got = {free: layers_text(fit_layers(v41, "cuda:0", int(free * 1e9), context=600))
           for free in (84.9, 149, 206)}
    assert got == {84.9: "0-6,20-26", 149: "0-13,20-33", 206: "all"}
    with pytest.raises(StrataError, match="not even layers 0 and 20 fit .2 of 40 layers need"):
        fit_layers(v41, "cuda:0", int(12e9), context=600)
    assert layers_text(parse_layers("0-4,7,9-10,20-24", 40)) == "0-4,7,9-10,20-24"
    assert main(["bench", "synthetic", "--config", str(tiny_dir), "--device", "cpu",
                 "--layers", "fit"]) == 2
    assert "--layers fit sizes the subset by a CUDA device's free memory" in \
        capsys.readouterr().err


def test_bench_synthetic_checks_the_device_memory_first(tiny_dir, capsys, monkeypatch):
    """`strata bench synthetic --device cuda:0` asks the device's free memory before building:
    too little gives exit 2 and the check's message. (No GPU here: torch.cuda.mem_get_info
    is the one mocked part, and the run stops at the check, before any CUDA work.)"""
    from strata.cli import main
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * 10**9, 8 * 10**9))
    assert main(["bench", "synthetic", "--config", str(tiny_dir), "--device", "cuda:0",
                 "--prefill", "8K"]) == 2
    err = capsys.readouterr().err
    assert "layers need" in err and "2.00 GB is free; not one layer fits beside them" in err
    assert "caches at 12,296 tokens" in err  # the 8K prompt, a prefill chunk (4,096), 8


def test_cold_engram_needs_disk_tables(tiny_dir, capsys):
    from strata.cli import main
    assert main(["bench", "synthetic", "--config", str(tiny_dir), "--device", "cpu",
                 "--engram-cache", "cold"]) != 0
    assert "--engram-cache cold needs --engram disk" in capsys.readouterr().err
    assert main(["bench", "synthetic", "--config", str(tiny_dir), "--device", "cpu",
                 "--engram", "disk", "--engram-io-threads", "0"]) != 0
    assert "--engram-io-threads: must be in 1..1024, got 0" in capsys.readouterr().err


def test_disk_engram_scaling_names_the_engram_layers_held(tiny_dir, tmp_path, capsys):
    """With the tables on disk a step's reads grow with the Engram layers, not with the
    layers: a layer subset holding some of them says so beside its scaled figures."""
    from strata.cli import main
    for layers, note in (("0-3", "(Engram layers held: [1] of [1, 4]"), ("0-4", None)):
        assert main(["bench", "synthetic", "--config", str(tiny_dir), "--layers", layers,
                     "--device", "cpu", "--prompt-tokens", "8", "--tokens", "2", "--runs",
                     "1", "--warmup", "0", "--engram-rows", "32", "--modes", "plain",
                     "--engram", "disk", "--engram-dir", str(tmp_path / layers)]) == 0
        text = capsys.readouterr().out
        assert "scaled to all layers" in text
        assert (note in text) if note else "Engram layers held" not in text


def test_bench_synthetic_cli(tiny_dir, cfg, tmp_path, capsys, monkeypatch):
    import json

    from strata.cli import main
    from strata.kernels import exl3_mma
    monkeypatch.setattr(exl3_mma, "ENABLED", True)  # (both restored after the test)
    monkeypatch.delenv("STRATA_EXL3_MMA", raising=False)
    out = tmp_path / "syn.json"
    assert main(["bench", "synthetic", "--config", str(tiny_dir), "--layers", "0-3",
                 "--device", "cpu", "--prompt-tokens", "12", "--tokens", "4", "--runs", "1",
                 "--warmup", "0", "--engram-rows", "32", "--breakdown", "2",
                 "--modes", "plain,plain+graphs,oracle", "--prefill", "96",
                 "--prefill-chunk", "32", "--prefill-skip", "on", "--no-mma",
                 "--json", str(out)]) == 0
    # --no-mma: the Triton EXL3 kernels only, in this process and (environment) in any rank
    assert not exl3_mma.ENABLED and os.environ["STRATA_EXL3_MMA"] == "0"
    text = capsys.readouterr().out
    assert "4 of 8 layers held" in text and "scaled to all layers" in text
    assert "[plain] decode step breakdown (2 steps on cpu)" in text
    assert "[plain+graphs] decode step breakdown (2 steps on cpu)" in text  # (eager on CPU)
    # an oracle mode measured: its DSpark windows profiled too, per window
    assert "[oracle] decode step breakdown (2 verify windows on cpu)" in text
    assert "ms per window" in text
    data = json.loads(out.read_text())
    assert data["meta"]["exl3_mma"] is False
    assert set(data["results"]) == {"plain", "plain+graphs", "oracle"}
    assert data["results"]["plain+graphs"]["capture_s"] == 0.0  # (CPU: eager, no capture)
    assert data["meta"]["layers"] == [0, 1, 2, 3]
    assert set(data["breakdown"]) == {"plain", "plain+graphs", "oracle",
                                      "prefill chunk at 64, encoder only",
                                      "prefill chunk at 64, full"}
    assert {"attention", "moe", "mhc", "head"} <= set(data["breakdown"]["plain"]["ms"])
    assert {"draft", "attention", "moe"} <= set(data["breakdown"]["oracle"]["ms"])
    # with --prefill: a prefill chunk at the prompt's end, encoder-only and full, per chunk
    assert "[prefill chunk at 64, full] decode step breakdown (1 prefill chunks on cpu)" in text
    assert {"attention", "moe", "mhc", "head"} <= set(
        data["breakdown"]["prefill chunk at 64, full"]["ms"])
    assert data["breakdown"]["plain"]["unprofiled_ms"] > 0
    assert data["breakdown"]["plain"]["python_top"]
    # the roofline: per mode what a token read and decoded, against rates measured in the run
    assert "roofline per token" in text
    roof, rates = data["roofline"], data["rates"]
    assert rates["copy_gb_per_s"] > 0 and rates["linear_weights_per_s"] > 0
    # (a window's rows: its drafts' mean count + 1 — here 4 tokens, so the budget cuts them)
    o = data["results"]["oracle"]
    assert roof["plain"]["rows"] == 1 and o["drafted"] < o["windows"] * cfg.dspark_block_size
    assert roof["oracle"]["rows"] == round(1 + o["drafted"] / o["windows"]) > 1
    assert roof["plain"]["gb_per_token"] > 0 and roof["plain"]["gweights_per_token"] > 0
    r = data["results"]["plain"]
    assert roof["plain"]["gb_per_s"] == pytest.approx(roof["plain"]["gb_per_token"]
                                                      * r["median_tok_per_s"])
    assert main(["bench", "synthetic", "--config", str(tiny_dir), "--layers", "5-99",
                 "--device", "cpu"]) == 2
    assert "layers run 0..7" in capsys.readouterr().err


def test_values_depend_only_on_the_tensor_name(cfg):
    """Any process building a tensor gets the same values (what lets every rank of a parallel
    group build its own part of one synthetic model)."""
    a, _ = build_synthetic(cfg, "cpu", layers=[0, 1, 2], engram_rows=16, seed=4)
    b, _ = build_synthetic(cfg, "cpu", layers=[1, 2, 3], engram_rows=16, seed=4)
    c, _ = build_synthetic(cfg, "cpu", layers=[1, 2, 3], engram_rows=16, seed=5)
    la, lb, lc = a.layers[1], b.layers[0], c.layers[0]
    assert la.layer == lb.layer == 1
    assert torch.equal(la.hc_attn.fn, lb.hc_attn.fn)
    assert torch.equal(la.attn.wq_a.trellis, lb.attn.wq_a.trellis)
    assert not torch.equal(la.attn.wq_a.trellis, lc.attn.wq_a.trellis)  # the seed matters


@pytest.mark.parametrize("mode", ["layer", "tp"])
def test_parallel_synthetic_equals_one_device(tiny_dir, cfg, mode):
    """`strata bench synthetic --parallel`: two gloo ranks each build their part of the
    synthetic model; logits and greedy tokens are those of the whole model in one process."""
    from strata.model.numerics import Numerics
    from strata.runtime.parallel import ParallelSpec, launch
    options = {"fmt": "official", "seed": 7, "engram_rows": 32}
    one, _ = build_synthetic(cfg, "cpu", numerics=Numerics("reference"), **options)
    split = ((0, 3), (3, 8)) if mode == "layer" else None
    pm = launch(ParallelSpec(mode, ("cpu", "cpu"), "", numerics="reference", split=split,
                             peer_timeout=20.0,
                             synthetic={"config": str(tiny_dir), **options}))
    try:
        prompt = torch.arange(3, 30)
        a, _ = one.forward(prompt, one.new_state(64), logits="all")
        b, _ = pm.forward(prompt, pm.new_state(64), logits="all")
        assert torch.equal(a, b)
        run = dict(max_tokens=6, stop_ids=frozenset())
        assert Session(pm, 64).run(prompt, **run).tokens == Session(one, 64).run(prompt,
                                                                                  **run).tokens
    finally:
        pm.close()


def test_bench_synthetic_cli_parallel(tiny_dir, tmp_path, capsys):
    import json

    from strata.cli import main
    out = tmp_path / "syn.json"
    assert main(["bench", "synthetic", "--config", str(tiny_dir), "--parallel", "tp",
                 "--devices", "cpu,cpu", "--prompt-tokens", "12", "--tokens", "3", "--runs", "1",
                 "--warmup", "0", "--engram-rows", "32", "--modes", "plain",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "8 of 8 layers held over cpu,cpu (tp)" in text and "fwd ms" in text
    data = json.loads(out.read_text())
    assert data["meta"]["parallel"] == "tp" and len(data["split_timing"]["plain"]["ranks"]) == 2
    assert main(["bench", "synthetic", "--config", str(tiny_dir), "--parallel", "layer",
                 "--devices", "cpu,cpu", "--layers", "0-3"]) == 2
    assert "--layers is for one device" in capsys.readouterr().err
    # --breakdown profiles rank 0 (its process and device) over a group, graphed steps too.
    assert main(["bench", "synthetic", "--config", str(tiny_dir), "--parallel", "layer",
                 "--devices", "cpu,cpu", "--prompt-tokens", "12", "--tokens", "3", "--runs", "1",
                 "--warmup", "0", "--engram-rows", "32", "--modes", "plain,plain+graphs",
                 "--breakdown", "2", "--json", str(out)]) == 0
    assert "[plain+graphs] decode step breakdown (2 steps on cpu)" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert {"attention", "moe", "mhc"} <= set(data["breakdown"]["plain"]["ms"])


def test_prefill_warmup_has_the_timed_prompts_chunk_forms():
    from strata.bench.synthetic import prefill_warmup_length
    # V4.1-like: reach 2,600 rows, chunks of 4,096 — two chunks, the skip's boundary in the
    # second as in the timed prompt's last two
    assert prefill_warmup_length(32768, 4096, 2600) == 8192
    assert prefill_warmup_length(32768 + 1000, 4096, 2600) == 8192 + 1000
    assert prefill_warmup_length(5000, 4096, 2600) == 5000  # short prompts: themselves
    assert prefill_warmup_length(100_000, 2048, 0) == 100_000 % 2048 + 2048  # no skip: 1 chunk


def test_bench_synthetic_prefill_with_and_without_the_decoder_skip(tiny_dir, tmp_path, capsys):
    """--prefill: chunked prefills timed with and without the decoder skip (the tiny config's
    reach is 896 rows, so 1,000 tokens skip the decoder on their first 104); the last logits
    must be bit-identical or the command fails. With --prefill-warmup an untimed prefill runs
    before each timed one."""
    import json

    from strata.cli import main
    out = tmp_path / "syn.json"
    assert main(["bench", "synthetic", "--config", str(tiny_dir), "--device", "cpu",
                 "--prompt-tokens", "8", "--tokens", "2", "--runs", "1", "--warmup", "0",
                 "--modes", "plain", "--engram-rows", "32", "--prefill", "1000",
                 "--prefill-chunk", "256", "--prefill-piece", "384", "--prefill-warmup",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["prefill"]
    assert [r["warmup_tokens"] for r in rows] == [1000, 1000]  # (the tiny reach: all of it)
    assert [(r["tokens"], r["decoder_skip"], r["skip_applied"]) for r in rows] == \
        [(1000, False, False), (1000, True, True)]
    assert all(r["logits_equal_to_full"] and r["tok_per_s"] > 0 for r in rows)
    assert all(r["base_device_bytes"] is None for r in rows)  # (device counters: CUDA only)
    captured = capsys.readouterr()
    assert "prefill" in captured.out
    # each prefill is reported as soon as it is timed (a run cut short keeps them)
    assert "measured prefill 1000 (decoder skip off)" in captured.err
    assert "measured prefill 1000 (decoder skip on)" in captured.err
    # fed in pieces of 384 tokens (a progress line after each but the last), still exact
    assert captured.err.count("prefill 1000: 384 tokens in") == 2
    assert captured.err.count("prefill 1000: 768 tokens in") == 2
    assert captured.err.count("prefill 1000: untimed warm-up of 1000 tokens took") == 2
