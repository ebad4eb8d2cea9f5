"""The passkey harness: exact prompt lengths, the key where asked, chunked runs, reporting.
(Retrieval itself needs real weights; on the random fixture the answer is noise.)"""
from __future__ import annotations

import json

import pytest

from strata.bench.passkey import PromptBuilder, found_key, parse_length, run_passkey
from strata.cli import main
from strata.tokenizer import load_tokenizer


def test_parse_length():
    assert parse_length("32K") == 32768 and parse_length("1M") == 1 << 20
    assert parse_length(" 300 ") == 300
    for bad in ("", "12x", "-3", "0"):
        with pytest.raises(Exception, match="context length"):
            parse_length(bad)


def test_found_key():
    assert found_key("The pass key is 12345.", "12345")
    assert found_key("1 2 3 4 5", "12345")
    assert not found_key("1234", "12345") and not found_key("", "12345")


@pytest.mark.parametrize("n,depth", [(200, 0.0), (700, 0.5), (1500, 1.0)])
def test_prompt_has_the_length_and_the_key_where_asked(real_vocab_dir, n, depth):
    b = PromptBuilder(real_vocab_dir / "tokenizer.json")
    tokens = b.build(n, "48213", depth)
    assert n - 40 <= len(tokens) <= n  # whole filler sentences: within one of the target
    text = load_tokenizer(real_vocab_dir).decode(tokens, skip_special_tokens=False)
    assert text.count("48213") == 2 and text.rstrip().endswith("</think>")
    key_at, unit = text.index("48213"), "The grass is green."
    before = text[:key_at].count(unit) / text.count(unit)  # share of filler before the key
    assert abs(before - depth) < 0.05, before
    assert text.index("What is the pass key?") > text.rindex("48213")


def test_too_short_is_an_error(real_vocab_dir):
    with pytest.raises(Exception, match="at least"):
        PromptBuilder(real_vocab_dir / "tokenizer.json").build(20, "48213")


def test_run_reports_each_length(real_vocab_dir):
    from strata.model.model import Model
    model = Model.load(real_vocab_dir, "cpu")
    res = run_passkey(model, real_vocab_dir / "tokenizer.json", [150, 260], chunk=64,
                      max_tokens=3)
    assert [r.target_tokens for r in res] == [150, 260]
    for r in res:
        assert r.prompt_tokens <= r.target_tokens and r.prefill_tok_per_s > 0
        assert r.found == found_key(r.answer, r.key) and r.peak_rss_bytes > 0
    assert res[0].key != res[1].key


def test_cli(real_vocab_dir, tmp_path, capsys):
    out = tmp_path / "pk.json"
    assert main(["passkey", "--model", str(real_vocab_dir), "--lengths", "140",
                 "--max-tokens", "2", "--chunk", "50", "--json", str(out)]) == 0
    assert "| 140 |" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["results"][0]["target_tokens"] == 140 and data["meta"]["prefill_chunk"] == 50
    # (the default chunk is auto: measured on CUDA; here the base chunk, and said why)
    assert main(["passkey", "--model", str(real_vocab_dir), "--lengths", "140",
                 "--max-tokens", "2", "--json", str(out)]) == 0
    assert "strata: prefill chunk 4096 rows (not measured off CUDA)" in capsys.readouterr().err
    assert json.loads(out.read_text())["meta"]["prefill_chunk"] == 4096
    assert main(["passkey", "--model", str(real_vocab_dir), "--lengths", "12q"]) == 2
    assert "context length '12q'" in capsys.readouterr().err
