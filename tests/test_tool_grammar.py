"""Strict tools' grammar (serve/tool_grammar.py) against deepseek-recipe: every call the recipe
renders from arguments that fit the schemas is accepted whole; arguments that do not fit, an
unknown tool, or a call block left open are not."""
from __future__ import annotations

import json

import deepseek_recipe as dr
import pytest

from strata.runtime.constraint import GrammarError, Grammars, grammar
from strata.serve.protocols import PROTOCOLS
from strata.serve.tool_grammar import calls_grammar
from strata.tokenizer import load_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "additionalProperties": False,
    "required": ["city", "days", "note", "where", "units", "hours"],
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 9},
                   "note": {"type": "string", "description": "anything"},
                   "where": {"$ref": "#/$defs/place"},
                   "units": {"type": "string", "pattern": "^(C|F)$"},
                   "hours": {"type": "array", "items": {"type": "integer"}}},
    "$defs": {"place": {"type": "object", "required": ["lat"], "additionalProperties": False,
                        "properties": {"lat": {"type": "number"}}}}}}}
FREE = {"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}
NONE = {"type": "function", "function": {"name": "now", "strict": True,
                                         "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, FREE, NONE]
STRICT = {"get_weather", "now"}
GOOD = {"city": "Rome", "days": 3, "note": "a <b> </c> \"q\"\nline", "where": {"lat": 41.9},
        "units": "C", "hours": [9, 17]}


@pytest.fixture(scope="module")
def setup(real_vocab_dir):
    tok = load_tokenizer(real_vocab_dir)
    return tok, Grammars(tok.to_str(), 129280, [1])


def rendered(calls: list[tuple[str, dict]]) -> str:
    """The calls block as the recipe renders an assistant turn making these calls (the tools
    given without `strict`: the recipe, as OpenAI, refuses strict and loose tools together,
    and renders a call the same either way)."""
    msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(calls)]}] + [
        {"role": "tool", "tool_call_id": f"c{i}", "content": "ok"} for i in range(len(calls))]
    loose = [{"type": "function", "function": {k: v for k, v in t["function"].items()
                                                if k != "strict"}} for t in TOOLS]
    conv = PROTOCOLS["chat"].convert({"model": "DeepSeek-V4.1-Flash", "messages": msgs,
                                      "tools": loose, "reasoning_effort": "none"},
                                     dr.ConversionOptions(), "DeepSeek-V4.1-Flash")
    prompt = dr.DeepseekV41Encoding().render_conversation(conv.conversation).prompt
    start = prompt.index("<｜DSML｜ calls>", prompt.index("<｜User｜>go"))  # (not the system's)
    return prompt[start:prompt.index("</｜DSML｜ calls>", start) + len("</｜DSML｜ calls>")]


def accepts(setup, text: str, lead: str = "<｜DSML｜ calls>\n") -> bool:
    tok, grammars = setup
    assert text.startswith(lead)
    c = grammars.constraint(grammar(None, calls_grammar(TOOLS, STRICT, lead)))
    ids = tok.encode(text, add_special_tokens=False).ids
    return c.matcher.try_consume_tokens(ids) == len(ids) and c.matcher.is_accepting()


def test_what_the_recipe_renders_from_fitting_arguments_is_accepted(setup):
    text = rendered([("get_weather", GOOD), ("run", {"cmd": "ls -l", "n": [1, {"x": None}]}),
                     ("now", {}), ("get_weather", dict(GOOD, note=""))])
    assert accepts(setup, text)
    # after the `｜DSML｜` token (the free text before the block is not the grammar's), or
    # inside a block the prompt opened
    assert accepts(setup, text[len("<｜DSML｜"):], " calls>\n")
    assert accepts(setup, text[len("<｜DSML｜ calls>\n"):], "")


@pytest.mark.parametrize("bad", [
    {"days": 10}, {"days": "3"}, {"city": "Oslo"}, {"where": {"lat": "north"}},
    {"units": "K"}, {"hours": ["9"]}])
def test_arguments_that_do_not_fit_are_not(setup, bad):
    assert not accepts(setup, rendered([("get_weather", dict(GOOD, **bad))]))


def test_unknown_tools_missing_arguments_and_open_blocks_are_not(setup):
    assert not accepts(setup, rendered([("get_weather", GOOD)]).replace("get_weather", "nope"))
    assert not accepts(setup, rendered([("get_weather", {k: v for k, v in GOOD.items()
                                                         if k != "days"})]))
    assert not accepts(setup, rendered([("run", {})])[:-len("</｜DSML｜ calls>")])
    with pytest.raises(GrammarError):
        calls_grammar([{"type": "function", "function": {"name": 3}}], set(), "")
