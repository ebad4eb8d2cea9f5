"""Constrained decoding (strata.runtime.constraint): the real-vocabulary fixture model, whose
random weights would never write JSON on their own, answers under a grammar — and the answer
parses and fits the schema, greedy and sampled; DSpark windows under a grammar pick what plain
constrained steps pick; the decode bench prices a grammar."""
from __future__ import annotations

import json
import re

import pytest
import torch

from strata.model.model import Model
from strata.runtime.constraint import GrammarError, Grammars, grammar, json_answer, regex_answer
from strata.runtime.engine import Engine, Finished, GenRequest, Token
from strata.runtime.sampling import Logprobs, SamplingParams
from strata.runtime.session import Session
from strata.runtime.speculative import SpecConfig
from strata.tokenizer import load_tokenizer

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["city", "days", "sunny", "note"],
          "properties": {"city": {"enum": ["Paris", "Rome"]},
                         "days": {"type": "integer", "minimum": 1, "maximum": 9},
                         "sunny": {"type": "boolean"},
                         "note": {"type": "string", "maxLength": 12}}}


def fits(text: str) -> bool:
    v = json.loads(text)
    return (set(v) == {"city", "days", "sunny", "note"} and v["city"] in ("Paris", "Rome")
            and type(v["days"]) is int and 1 <= v["days"] <= 9
            and type(v["sunny"]) is bool and isinstance(v["note"], str)
            and len(v["note"]) <= 12)


@pytest.fixture(scope="module")
def model(real_vocab_dir):
    return Model.load(real_vocab_dir)


@pytest.fixture(scope="module")
def tok(real_vocab_dir):
    return load_tokenizer(real_vocab_dir)


@pytest.fixture(scope="module")
def grammars(model, tok):
    return Grammars(tok.to_str(), model.cfg.vocab_size, [model.cfg.eos_token_id])


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def test_the_mask_allows_exactly_the_continuations(grammars, tok, model):
    """Masked logits keep the raw values where the grammar allows a token and are -inf
    elsewhere: an object opens with '{', and once the text is complete only EOS remains."""
    V, eos = model.cfg.vocab_size, model.cfg.eos_token_id
    c = grammars.constraint(grammar(json_answer(SCHEMA)))
    logits = torch.randn(1, V)
    m = c.mask(logits)
    allowed = torch.isfinite(m).view(-1).nonzero().view(-1).tolist()
    assert allowed and all(tok.decode([i]).lstrip(" \n\t\r")[:1] in ("{", "") for i in allowed)
    assert torch.equal(m[torch.isfinite(m)], logits[torch.isfinite(m)])
    assert eos not in allowed
    for t in ids(tok, '{"city": "Rome", "days": 3, "sunny": true, "note": "ok"}'):
        c.advance(t)
    assert torch.isfinite(c.mask(logits)).view(-1).nonzero().view(-1).tolist() == [eos]
    c.advance(eos)
    c2 = grammars.constraint(grammar(json_answer(SCHEMA)))
    with pytest.raises(GrammarError, match="does not continue"):
        c2.advance(ids(tok, "hello")[0])


def test_a_window_is_masked_row_by_row_and_the_state_kept(grammars, tok, model):
    """mask_window: row i as the grammar stands after drafts[:i]; from the first draft the
    grammar refuses on, rows are left as they are, and so is the row past an EOS draft (no
    answer follows it); the grammar's own state does not move."""
    V, eos = model.cfg.vocab_size, model.cfg.eos_token_id
    text = ids(tok, '{"city": "Rome", "days": 3, "sunny": true, "note": "ok"}')
    c = grammars.constraint(grammar(json_answer(SCHEMA)))
    for t in text[:-2]:
        c.advance(t)
    ref = grammars.constraint(grammar(json_answer(SCHEMA)))
    for t in text[:-2]:
        ref.advance(t)
    drafts = text[-2:] + [eos]
    logits = torch.randn(len(drafts) + 2, V)
    out = c.mask_window(logits, drafts + [ids(tok, "x")[0]])
    for i in range(len(drafts)):  # (each row as plain steps would mask it)
        assert torch.equal(out[i], ref.mask(logits[i]))
        ref.advance(drafts[i])
    assert torch.equal(out[len(drafts):], logits[len(drafts):])  # past the EOS
    refused = int(torch.isinf(out[1]).nonzero()[0])  # (a draft the grammar refuses there)
    bad = c.mask_window(logits[:3], [text[-2], refused])
    assert torch.equal(bad[1], out[1]) and torch.equal(bad[2], logits[2])
    for t in drafts:  # (the window left the state where it was)
        c.advance(t)
    c.advance(ids(tok, "anything")[0])  # (after the EOS: ignored)


def test_a_constraint_after_a_token_leaves_the_reasoning_free(grammars, tok):
    end = tok.token_to_id("</think>")
    c = grammars.constraint(grammar(regex_answer("[a-z]{3}-[0-9]{2}")), after=[{end}])
    logits = torch.randn(1, 129280)
    for t in ids(tok, "Let me think 123 {}"):
        assert torch.equal(c.mask(logits), logits)
        c.advance(t)  # (free text: anything goes)
    c.advance(end)
    assert int(torch.isfinite(c.mask(logits)).sum()) < 129280 // 10
    with pytest.raises(GrammarError):
        c.advance(ids(tok, "ABC")[0])
    # triggers in order: a tool-call block's `｜DSML｜` inside the reasoning starts nothing
    dsml = tok.token_to_id("｜DSML｜")
    c = grammars.constraint(grammar(regex_answer(" calls>")), after=[{end}, {dsml}])
    for t in [dsml, end] + ids(tok, "Sure.\n\n<"):
        c.advance(t)
        assert not c.active
    c.advance(dsml)
    assert c.active


def test_bad_grammars_and_prefixes_are_named(grammars, tok):
    with pytest.raises(GrammarError, match="320 logits"):  # (a model narrower than its tokenizer)
        Grammars(tok.to_str(), 320, [1]).constraint(grammar(json_answer(None)))
    with pytest.raises(GrammarError):
        grammars.constraint(grammar(json_answer({"type": "no-such-type"})))
    with pytest.raises(GrammarError, match="regex"):
        grammars.constraint(grammar(regex_answer("[a-")))
    with pytest.raises(GrammarError, match="given start"):
        grammars.constraint(grammar(json_answer(SCHEMA)), prefix=ids(tok, '{"town"'))
    c = grammars.constraint(grammar(json_answer(SCHEMA)), prefix=ids(tok, '{"city": "Ro'))
    for t in ids(tok, 'me", "days": 3, "sunny": false, "note": ""}'):
        c.advance(t)
    assert c.matcher.is_accepting()


def test_tools_and_a_format_allow_a_call_block_instead(grammars, tok):
    """A response format beside tools: the answer, or a calls block of the request's tools
    (serve/tool_grammar.py) — not free text, not a call of another tool."""
    from strata.serve.tool_grammar import calls_grammar
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    g = grammar(json_answer(SCHEMA), calls_grammar(tools, set(), "\n\n<｜DSML｜ calls>\n"))
    call = ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="x" '
            'string="true">any text</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')
    for text in ('{"city": "Paris", "days": 1, "sunny": true, "note": "x"}', call):
        c = grammars.constraint(g)
        for t in ids(tok, text):
            c.advance(t)
        assert c.matcher.is_accepting(), text
    for text in ("Sure! Here it is", call.replace('"f"', '"g"')):
        c = grammars.constraint(g)
        with pytest.raises(GrammarError):
            for t in ids(tok, text):
                c.advance(t)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_random_model_answers_in_the_schema(model, tok, grammars, temperature):
    """The fixture's random weights, held to the schema: the answer parses and fits it, ends
    with EOS, and the logprobs reported are the raw distribution's (the mask shapes only the
    pick)."""
    s = Session(model, 1024)
    lps = Logprobs()
    params = SamplingParams(temperature=temperature, seed=7)
    out = list(s.generate(ids(tok, "Weather?"), 300, params, logprobs=lps,
                          constraint=grammars.constraint(grammar(json_answer(SCHEMA)))))
    assert out[-1] == model.cfg.eos_token_id, tok.decode(out)
    assert fits(tok.decode(out[:-1])), tok.decode(out)
    assert len(lps.items) == len(out) and all(lp <= 0.0 for lp, _ in lps.items)
    free = list(Session(model, 1024).generate(ids(tok, "Weather?"), 30, params))
    with pytest.raises(ValueError):  # (unconstrained, the same weights write no JSON)
        json.loads(tok.decode(free))


def test_dspark_windows_pick_what_plain_constrained_steps_pick(model, tok, grammars):
    """DSpark windows under a constraint — drafts that are the constrained answer itself with
    one in each window made wrong (often one the grammar refuses), and the model's own
    drafts — give the plain constrained session's tokens: each row is masked as the grammar
    stands after the drafts before it, and the grammar advances by what was accepted. (Sampled:
    greedy picks are the same masks through argmax.)"""
    from tests.util import continuation_drafts
    prompt = ids(tok, "Weather?")
    params = SamplingParams(temperature=1.0, seed=11)

    def run(spec=None, override=None) -> list[int]:
        s = Session(model, 1024, speculative=spec, draft_override=override)
        out = list(s.generate(prompt, 120, params, mode="dspark" if spec else "plain",
                              constraint=grammars.constraint(grammar(json_answer(SCHEMA)))))
        assert spec is None or override is None or s.stats.accepted > 0
        return out
    want = run()
    assert fits(tok.decode(want[:-1]))
    override = continuation_drafts(want, len(prompt), model.cfg.vocab_size, wrong_at=2)
    assert run(SpecConfig(length=4, low_windows=10 ** 6), override) == want
    assert run(SpecConfig(length=3)) == want


def test_a_regex_answer_and_a_dspark_engine(model, tok, grammars):
    """A DSpark engine decodes a constrained request through its windows: the answer matches
    the regex whole; the next unconstrained request on the same engine decodes as before."""
    eng = Engine(model, 1024, prefill_chunk=64, speculative=SpecConfig(length=3))
    eng.start()
    events: list = []
    after: list = []
    c = grammars.constraint(grammar(regex_answer(r"(yes|no): [0-9]{2,4}")))
    eng.submit(GenRequest(ids(tok, "Answer?"), 40, constraint=c), events.append)
    eng.submit(GenRequest(ids(tok, "Answer?"), 20), after.append)
    eng.stop(drain=True)
    assert [e.id for e in after if isinstance(e, Token)] == \
        list(Session(model, 1024).generate(ids(tok, "Answer?"), 20))
    assert after[-1].drafted > 0  # (that one did run DSpark windows)
    toks = [e.id for e in events if isinstance(e, Token)]
    assert isinstance(events[-1], Finished) and events[-1].reason == "stop"
    assert toks[-1] == model.cfg.eos_token_id
    assert re.fullmatch(r"(yes|no): [0-9]{2,4}", tok.decode(toks[:-1])), tok.decode(toks)


def test_the_decode_bench_prices_a_grammar(model, tok, real_vocab_dir):
    """`strata bench decode` modes with +json: each run's tokens checked against plain
    decoding's under the same grammar (the bench raises otherwise), an answer that opens a
    JSON object where the free run does not."""
    from strata.bench.decode import ModeSpec, bench_decode, parse_mode, report
    from strata.tokenizer import tokenizer_path
    assert parse_mode("dspark@3+json+graphs") == ModeSpec("dspark", 3, True, True)
    with pytest.raises(Exception, match="unknown mode"):
        parse_mode("plain+graphs+json")
    prompt = ids(tok, "Weather?")
    res = bench_decode(model, prompt, ["plain", "plain+json", "oracle+json", "dspark+json"],
                       n=12, runs=1, warmup=0, tokenizer_json=tokenizer_path(real_vocab_dir))
    json_toks = res["plain+json"].tokens
    assert tok.decode(json_toks).lstrip().startswith("{")
    assert json_toks != res["plain"].tokens
    assert res["oracle+json"].accepted > 0
    head = report(res, len(prompt)).splitlines()[0]  # (each grammar's tokens hashed apart)
    assert head.count("sha256") == 1 and ", +json " in head
