"""The command line, run in-process (strata.cli.main) and once as a real subprocess."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from strata.cli import main


def test_generate_tokens_json(tiny_dir, capsys):
    assert main(["generate", "--model", str(tiny_dir), "--tokens", "5,6,7,8", "--max-tokens", "6",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_tokens"] == [5, 6, 7, 8] and len(out["tokens"]) <= 6
    assert out["finish_reason"] in ("stop", "length")


def test_the_prefill_chunk_reaches_the_session_and_the_engine(tiny_dir, capsys, monkeypatch):
    """--prefill-chunk: generate's session (default PREFILL_CHUNK) and the server's engine
    (default auto) take it, and the tokens do not depend on it; --warmup warms the engine up."""
    import signal

    import uvicorn

    from strata.runtime.session import PREFILL_CHUNK, Session
    from strata.serve import app
    chunks = []
    init = Session.__init__

    def spy_init(self, *a, **k):
        init(self, *a, **k)
        chunks.append(self.prefill_chunk)
    monkeypatch.setattr(Session, "__init__", spy_init)
    outs = []
    for extra in ([], ["--prefill-chunk", "3"]):
        assert main(["generate", "--model", str(tiny_dir), "--tokens", "5,6,7,8,9,10,11,12",
                     "--max-tokens", "4", "--json"] + extra) == 0
        outs.append(json.loads(capsys.readouterr().out)["tokens"])
    assert chunks == [PREFILL_CHUNK, 3] and outs[0] == outs[1]

    engines = []
    create = app.create_app
    monkeypatch.setattr(app, "create_app", lambda engine, *a, **k: (
        engines.append(engine.prefill_chunk), create(engine, *a, **k))[1])
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)  # (no server: the wiring only)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # (keep pytest's handlers)
    from strata.runtime.engine import Engine
    warmed = []
    monkeypatch.setattr(Engine, "warm_up", lambda self: warmed.append(self) or 0.0)
    for extra in ([], ["--prefill-chunk", "7"], ["--warmup"], ["--prefill-chunk", "auto"]):
        assert main(["serve", "--model", str(tiny_dir), "--port", "0"] + extra) == 0
    assert engines == [PREFILL_CHUNK, 7, PREFILL_CHUNK, PREFILL_CHUNK]
    assert len(warmed) == 1  # (asked for; by default only on CUDA)
    # (auto, by default or asked for: measured on CUDA; here the base chunk, and said why)
    assert capsys.readouterr().err.count(
        f"strata: prefill chunk {PREFILL_CHUNK} rows (not measured off CUDA)") == 3

    def broken(self):  # (a stand-in for a GPU that cannot run the kernels: none here)
        raise RuntimeError("CUDA error: no kernel image is available")
    monkeypatch.setattr(Engine, "warm_up", broken)
    assert main(["serve", "--model", str(tiny_dir), "--port", "0", "--warmup"]) == 2
    assert "the warm-up request failed: RuntimeError: CUDA error" in capsys.readouterr().err


def test_the_defaults_take_the_fast_path(tiny_dir, capsys, monkeypatch):
    """CUDA graphs are on unless --no-graphs; --device defaults to CUDA where there is one
    (here there is none: the run is on the CPU; with CUDA claimed, the load asks for it)."""
    from strata.cli import build_parser
    for cmd in (["serve"], ["generate", "--tokens", "1"]):
        assert build_parser().parse_args(cmd).graphs is True
        assert build_parser().parse_args(cmd + ["--no-graphs"]).graphs is False
    argv = ["generate", "--model", str(tiny_dir), "--tokens", "5,6", "--max-tokens", "2"]
    assert main(argv) == 0
    capsys.readouterr()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(argv) == 2
    assert "--device cuda: CUDA is not available" in capsys.readouterr().err


def test_generate_with_engram_on_disk(tiny_dir, capsys, monkeypatch):
    from strata import engram_store
    args = ["generate", "--model", str(tiny_dir), "--tokens", "5,6,7,8", "--max-tokens", "6",
            "--json"]
    assert main(args) == 0
    want = json.loads(capsys.readouterr().out)["tokens"]
    assert main(args + ["--engram", "disk", "--engram-cache-mb", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == want
    threads = []
    real = engram_store.EngramStore.__init__

    def spy(self, *a, **kw):
        real(self, *a, **kw)
        threads.append(self.io_threads)
    monkeypatch.setattr(engram_store.EngramStore, "__init__", spy)
    assert main(args + ["--engram", "disk", "--engram-io-threads", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == want
    assert threads and set(threads) == {3}


def test_generate_prompt_is_rendered_with_the_chat_format(tiny_dir, capsys):
    assert main(["generate", "--model", str(tiny_dir), "--prompt", "hi", "--max-tokens", "2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    assert tok.decode(out["prompt_tokens"], skip_special_tokens=False) == \
        "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>"


def test_score_modes_agree(tiny_dir, tmp_path):
    ids = " ".join(str(i) for i in range(3, 43))
    paths = {}
    for mode in ("prefill", "decode", "chunk:7"):
        paths[mode] = tmp_path / f"{mode.replace(':', '')}.npz"
        assert main(["score", "--model", str(tiny_dir), "--tokens", ids, "--mode", mode,
                     "--start", "5", "--save", str(paths[mode])]) == 0
    a = np.load(paths["prefill"])
    assert a["logits"].shape == (35, 320) and list(a["positions"]) == list(range(5, 40))
    for mode in ("decode", "chunk:7"):
        assert np.array_equal(np.load(paths[mode])["logits"], a["logits"])


def test_inspect(tiny_dir, capsys):
    assert main(["inspect", str(tiny_dir)]) == 0
    out = capsys.readouterr().out
    assert "official (fp8 dense, fp4 experts, fp8 Engram)" in out
    assert "routed experts" in out and "engram tables" in out and "dspark" in out
    assert "engine check: the model builds" in out


@pytest.mark.parametrize("argv,needle", [
    (["score", "--tokens", "1,x", "--save", "o.npz"], "expected integers"),
    (["score", "--tokens", "1 2", "--mode", "chunk:0", "--save", "o.npz"], "--mode"),
    (["generate", "--tokens", "1", "--device", "cuda:99"], "CUDA"),
    (["generate", "--tokens", "1", "--device", "tpu"], "--device"),
    (["generate", "--tokens", "1", "--engram", "disk", "--engram-cache-mb", "0"],
     "--engram-cache-mb"),
    (["generate", "--tokens", "1", "--engram", "disk", "--engram-io-threads", "0"],
     "--engram-io-threads"),
])
def test_bad_arguments_are_reported(tiny_dir, capsys, argv, needle):
    assert main(argv[:1] + ["--model", str(tiny_dir)] + argv[1:]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--tokens", "1,-5"], "-5 is not a token id of this model (0..319)"),
    (["generate", "--tokens", "1,320"], "320 is not a token id"),
    (["generate", "--tokens", "1", "--capacity", "-3"], "--capacity: must be ≥ 2, got -3"),
    (["generate", "--tokens", "1", "--capacity", "0"], "--capacity: must be ≥ 2, got 0"),
    (["generate", "--tokens", "1", "--capacity", "99999999999"], "context is at most"),
    (["generate", "--tokens", "1", "--load-buffer-mb", "0"], "--load-buffer-mb: must be ≥ 1"),
    (["score", "--tokens", "1,2", "--save", "/nonexistent_dir/x.npz"], "does not exist"),
    (["bench", "decode", "--tokens", "0"], "--tokens: must be ≥ 1, got 0"),
    (["bench", "decode", "--runs", "0"], "--runs: must be ≥ 1, got 0"),
    (["bench", "decode", "--modes", ","], "no mode named"),
    (["bench", "decode", "--tokens", "4", "--json", "/nonexistent_dir/r.json"],
     "does not exist"),
    (["serve", "--port", "70000"], "--port: must be in 0..65535, got 70000"),
    (["serve", "--max-queue", "-1"], "--max-queue: must be ≥ 0, got -1"),
    (["serve", "--prefill-chunk", "0"], "--prefill-chunk: must be ≥ 1, got 0 (or 'auto')"),
    (["serve", "--prefill-chunk", "lots"],
     "--prefill-chunk: expected an integer, got 'lots' (or 'auto')"),
    (["generate", "--tokens", "1", "--prefill-chunk", "auto"],
     "--prefill-chunk: expected an integer, got 'auto'"),
    (["generate", "--tokens", "1", "--prefill-chunk", "-2"], "--prefill-chunk: must be ≥ 1"),
    (["generate", "--tokens", "1", "--max-tokens", "0"], "--max-tokens: must be ≥ 1, got 0"),
    (["passkey", "--lengths", "100", "--chunk", "0"], "--chunk: must be ≥ 1, got 0"),
    (["serve", "--log-level", "bogus"], "--log-level: invalid choice"),
    (["generate", "--tokens", "1", "--devices", "cpu,cpu"], "add --parallel"),
    (["generate", "--tokens", "1", "--parallel", "layer", "--devices", "cuda:x,cuda:1"],
     "'cuda:x' is not a device"),
])
def test_bad_values_are_refused_before_the_work(tiny_dir, capsys, argv, needle):
    """Out-of-range numbers are usage errors (exit 2, before anything loads); token ids and
    capacities the model cannot take, and output paths that cannot be written, are named
    before the run whose result they would lose."""
    assert main(argv[:2 if argv[0] == "bench" else 1] + ["--model", str(tiny_dir)]
                + argv[2 if argv[0] == "bench" else 1:]) == 2
    assert needle in capsys.readouterr().err


def test_make_tiny_keeps_an_existing_folder(tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    assert main(["make-tiny", str(mine)]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert (mine / "config.json").read_text() == "{}"


def test_make_tiny_and_default_model_subprocess(tmp_path):
    """`strata generate` with no --model makes the real-vocab fixture in the cache first."""
    env = dict(os.environ, STRATA_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "strata.cli", "generate", "--prompt", "hello",
                        "--max-tokens", "3", "--json"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prompt_tokens"][:2] == [0, 128803] and len(out["tokens"]) == 3
    assert (tmp_path / "cache" / "fixtures" / "real-vocab-seed0" / "config.json").exists()


def test_bench_decode(tiny_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "decode", "--model", str(tiny_dir), "--tokens", "12", "--runs", "1",
                 "--warmup", "0", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "plain" in text and "oracle" in text and "identical" in text
    # each mode reported as soon as it is measured (kept if a time limit cuts the run)
    assert [l.split(":")[0] for l in captured.err.splitlines() if l.startswith("measured")] == \
        ["measured plain", "measured dspark", "measured oracle"]
    data = json.loads(out.read_text())
    rows = {r["mode"]: r for r in data["results"]}
    assert set(rows) == {"plain", "dspark", "oracle"}
    assert rows["oracle"]["accepted"] == rows["oracle"]["drafted"] > 0  # full acceptance
    assert all(r["median_tok_per_s"] > 0 for r in rows.values())


def test_bench_decode_with_draft_experts_in_a_cache(tiny_dir, capsys):
    """The DSpark stages' experts behind a 1 MB cache: the bench checks dspark == plain."""
    assert main(["bench", "decode", "--model", str(tiny_dir), "--tokens", "10", "--runs", "1",
                 "--warmup", "0", "--modes", "plain,dspark", "--draft-experts", "cache",
                 "--draft-cache-mb", "1"]) == 0
    assert "identical" in capsys.readouterr().out
    assert main(["generate", "--model", str(tiny_dir), "--tokens", "5", "--draft-cache-mb",
                 "0"]) == 2
    assert "--draft-cache-mb" in capsys.readouterr().err


def test_bench_decode_oracle_at_a_target_acceptance(tiny_dir, tmp_path):
    """oracle:2.9 forces rejections so that verification commits 2.9 tokens per window on
    average, with the tokens still plain decoding's (the bench checks them)."""
    from strata.bench.decode import accepted_schedule
    s = accepted_schedule(2.9, 5)
    first = [next(s) for _ in range(100)]
    assert sum(first) == 190 and set(first) <= {1, 2}
    out = tmp_path / "b.json"
    assert main(["bench", "decode", "--model", str(tiny_dir), "--tokens", "40", "--runs", "1",
                 "--warmup", "0", "--modes", "plain,oracle:2.9", "--json", str(out)]) == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert abs(rows["oracle:2.9"]["mean_committed_per_window"] - 2.9) < 0.25
    assert main(["bench", "decode", "--model", str(tiny_dir), "--modes", "oracle:9"]) == 2


def test_bench_decode_oracle_per_draft_acceptance_at_a_length(tiny_dir, tmp_path):
    """oracle:pP accepts each position's draft with probability P from one fixed draw (every
    run and verify length meets the same easy and hard tokens); --length sets the oracle
    modes' windows too, a mode's own @L its own; the tokens stay plain decoding's (the bench
    checks them); bad modes are refused; the adaptive dspark modes, eager and graphed, report
    the window prices they chose by."""
    from strata.bench.decode import acceptable
    draw = acceptable(0.6, 2000)
    assert draw == acceptable(0.6, 2000) and 0.55 < sum(draw) / 2000 < 0.65
    out = tmp_path / "b.json"
    assert main(["bench", "decode", "--model", str(tiny_dir), "--tokens", "40", "--runs", "1",
                 "--warmup", "0", "--modes", "plain,oracle,oracle:p0.6,oracle:p0.6@1",
                 "--length", "2", "--json", str(out)]) == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    full, half = rows["oracle"], rows["oracle:p0.6"]
    assert full["drafted"] <= 2 * full["windows"] and full["accepted"] == full["drafted"]
    assert 2.5 < full["mean_committed_per_window"] <= 3
    assert half["drafted"] <= 2 * half["windows"] and 0 < half["accepted"] < half["drafted"]
    assert 1.3 < half["mean_committed_per_window"] < 2.6  # (1 + 0.6 + 0.36 expected)
    one = rows["oracle:p0.6@1"]  # ("@1": its own length, over the run's --length)
    assert one["drafted"] == one["windows"] and 0 < one["accepted"] < one["drafted"]
    for bad in ("oracle:p1.5", "oracle:px", "oracle:", "plain@2", "dspark@x", "oracle@-1"):
        assert main(["bench", "decode", "--model", str(tiny_dir), "--modes", bad]) == 2
    # the adaptive length, graphed too: its window prices measured that way and reported
    assert main(["bench", "decode", "--model", str(tiny_dir), "--tokens", "8", "--runs", "1",
                 "--warmup", "0", "--modes", "plain,dspark,dspark+graphs", "--json",
                 str(out)]) == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["plain"]["window_ms"] is None
    for mode in ("dspark", "dspark+graphs"):  # (rows 1 … block + 1, then a draft)
        assert len(rows[mode]["window_ms"]) == 7 and min(rows[mode]["window_ms"]) > 0
