"""Response formats over real HTTP: JSON schema, JSON object and regex answers decoded under the
grammar (strata.runtime.constraint) by the real-vocabulary fixture model, whose random weights
write no JSON unaided — Chat (streamed or not, thinking on or off, a continued prefix),
Responses, Messages' output_config.format, tools beside a format; strict tools' and forced
calls' arguments fitting their schemas; bad schemas and regexes refused by name."""
from __future__ import annotations

import json
import re

import openai
import pytest

from strata.model.model import Model
from tests.serve_helpers import EOS, M, LiveServer
from tests.test_constraint import SCHEMA, fits

ASK = [{"role": "user", "content": "Weather in Paris? Answer in JSON."}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
# a short answer, for the tests about where the format applies rather than what it holds
YES_NO = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
NO_THINKING = {"thinking": {"type": "disabled"}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]
CALL = ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
        '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
        '</｜DSML｜ invoke>\n</｜DSML｜ calls>' + EOS)


@pytest.fixture(scope="module")
def live(real_vocab_dir):
    with LiveServer(Model.load(real_vocab_dir), real_vocab_dir, capacity=4096) as srv:
        yield srv


@pytest.fixture(autouse=True)
def no_script(live):
    live.script(None)


def chat(live, **kw) -> dict:
    """A Chat answer, seeded: the random weights' picks under a grammar end when they end."""
    r = live.post("/v1/chat/completions", dict({"model": M, "messages": ASK,
                                                "max_tokens": 300, "seed": 0}, **kw))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_chat_json_schema_plain_and_streamed(live):
    ch = chat(live, response_format=FORMAT, temperature=0, **NO_THINKING)
    assert ch["finish_reason"] == "stop" and fits(ch["message"]["content"]), ch
    oa = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    small = {"type": "json_schema", "json_schema": {"name": "yes_no", "schema": YES_NO}}
    chunks = list(oa.chat.completions.create(model=M, messages=ASK, max_tokens=100, seed=3,
                                             response_format=small, stream=True,
                                             extra_body=NO_THINKING))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text)["ok"], bool), text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    # any object: the random weights may run a key to max_tokens, but the text is an object's
    obj = chat(live, response_format={"type": "json_object"}, max_tokens=40, **NO_THINKING)
    text = obj["message"]["content"]
    assert text.lstrip().startswith("{") and (obj["finish_reason"] == "length"
                                              or isinstance(json.loads(text), dict)), obj
    rx = chat(live, response_format={"type": "regex", "regex": r"(yes|no), [0-9]{1,3}"},
              **NO_THINKING)
    assert re.fullmatch(r"(yes|no), [0-9]{1,3}", rx["message"]["content"]), rx


def test_thinking_is_free_and_the_answer_after_it_is_held(live):
    """Thinking on: the reasoning is free text (here scripted, up to `</think>`), then the
    model's own sampled answer fits the schema."""
    live.script([{"match": "", "text": "Sunny, I guess.</think>"}])
    ch = chat(live, response_format=FORMAT, temperature=0)
    assert ch["message"]["reasoning_content"] == "Sunny, I guess."
    assert fits(ch["message"]["content"]), ch


def test_a_continued_answer_must_start_the_format(live):
    """A prefix message (DeepSeek's continuation) is part of the answer: the grammar takes it
    first, and the continuation completes it; a prefix the format cannot start is refused."""
    start = '{"city": "Ro'
    msgs = ASK + [{"role": "assistant", "content": start, "prefix": True}]
    ch = chat(live, messages=msgs, response_format=FORMAT, **NO_THINKING)
    assert fits(start + ch["message"]["content"]), ch
    r = live.post("/v1/chat/completions", {"model": M, "max_tokens": 20, **NO_THINKING,
                                           "response_format": FORMAT, "messages": ASK + [
                                               {"role": "assistant", "content": "Sure",
                                                "prefix": True}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


def test_responses_text_format(live):
    r = live.post("/v1/responses", {"model": M, "input": ASK, "max_output_tokens": 100,
                                    "temperature": 0,
                                    "reasoning": {"effort": "none"}, "text": {"format": {
                                        "type": "json_schema", "name": "w", "schema": YES_NO}}})
    assert r.status_code == 200, r.text
    out = [p["text"] for o in r.json()["output"] if o["type"] == "message"
           for p in o["content"] if p["type"] == "output_text"]
    assert len(out) == 1 and isinstance(json.loads(out[0])["ok"], bool), r.json()


def test_anthropic_output_format(live):
    """Messages' structured output (output_config.format, or the beta's output_format): the
    text block fits the schema; a format that is no JSON schema is refused by name."""
    base = {"model": M, "max_tokens": 100, "messages": ASK, "thinking": {"type": "disabled"},
            "temperature": 0}
    small = {"type": "json_schema", "schema": YES_NO}
    for body in (dict(base, output_config={"format": small}), dict(base, output_format=small)):
        r = live.post("/v1/messages", body)
        assert r.status_code == 200, r.text
        text = "".join(b["text"] for b in r.json()["content"] if b["type"] == "text")
        assert isinstance(json.loads(text)["ok"], bool), r.json()
    r = live.post("/v1/messages", dict(base, output_config={"format": {"type": "xml"}}))
    assert r.status_code == 400 and "output_config.format" in r.json()["error"]["message"]


def test_tools_beside_a_format_the_model_may_call_instead(live):
    """With tools offered the answer is the format or a tool-call block: a scripted call
    passes the grammar and comes back as a tool call; the model's own answer fits."""
    live.script([{"match": "", "text": CALL}])
    ch = chat(live, response_format=FORMAT, tools=TOOLS, **NO_THINKING)
    assert ch["finish_reason"] == "tool_calls", ch
    assert json.loads(ch["message"]["tool_calls"][0]["function"]["arguments"]) == \
        {"city": "Paris"}
    live.script(None)  # (the random weights may open a call block and run to max_tokens)
    small = {"type": "json_schema", "json_schema": {"name": "yes_no", "schema": YES_NO}}
    ch = chat(live, response_format=small, tools=TOOLS, temperature=0, max_tokens=60,
              **NO_THINKING)
    assert (ch["finish_reason"] == "length" or ch["message"].get("tool_calls")
            or isinstance(json.loads(ch["message"]["content"])["ok"], bool)), ch


STRICT = {"type": "object", "additionalProperties": False, "required": ["city", "days", "ok"],
          "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                         "days": {"type": "integer", "minimum": 1, "maximum": 9},
                         "ok": {"type": "boolean"}}}


def strict_fits(args: dict) -> bool:
    return (set(args) == {"city", "days", "ok"} and args["city"] in ("Paris", "Rome")
            and type(args["days"]) is int and 1 <= args["days"] <= 9
            and type(args["ok"]) is bool)


def test_strict_tools_calls_fit_their_schemas(live):
    """`strict: true`: the random weights' own call fits the tool's schema — forced (Chat
    tool_choice required or a named tool, which the call then names; Anthropic "any"), or
    after the model opens a calls block (here scripted, after free reasoning and text). (One
    call a turn: the grammar allows any number, which random weights may not stop writing.)"""
    tool = {"type": "function", "function": {"name": "get_weather", "strict": True,
                                             "parameters": STRICT}}
    rain = {"type": "function", "function": dict(tool["function"], name="get_rain")}
    named = {"type": "function", "function": {"name": "get_rain"}}
    for tools, choice, name in (([tool], "required", "get_weather"),
                                ([tool, rain], named, "get_rain")):
        ch = chat(live, tools=tools, tool_choice=choice, max_tokens=150, seed=1,
                  parallel_tool_calls=False, **NO_THINKING)
        call = ch["message"]["tool_calls"][0]["function"]
        assert call["name"] == name and strict_fits(json.loads(call["arguments"])), ch
    # thinking on: the grammar starts at the `｜DSML｜` after `</think>`
    live.script([{"match": "", "text": "Hmm.</think>Let me look.\n\n<｜DSML｜ calls>"}])
    ch = chat(live, tools=[tool], max_tokens=150, seed=1, parallel_tool_calls=False)
    assert ch["message"]["content"] == "Let me look." and ch["finish_reason"] == "tool_calls"
    assert strict_fits(json.loads(ch["message"]["tool_calls"][0]["function"]["arguments"]))
    live.script(None)
    r = live.post("/v1/messages", {"model": M, "max_tokens": 150, "messages": ASK,
                                   "thinking": {"type": "disabled"}, "temperature": 0,
                                   "tool_choice": {"type": "any",
                                                   "disable_parallel_tool_use": True},
                                   "tools": [{
                                       "name": "get_weather", "strict": True,
                                       "input_schema": STRICT}]})
    assert r.status_code == 200, r.text
    uses = [b for b in r.json()["content"] if b["type"] == "tool_use"]
    assert uses and strict_fits(uses[0]["input"]), r.json()


def test_bad_formats_are_refused_by_name(live):
    """A schema the recipe finds invalid (a dangling $ref), one only the grammar compiler
    cannot enforce (a keyword it does not implement), a bad regex format: 400s naming them."""
    dangling = {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}
    broken = {"type": "array", "uniqueItems": True}
    for fmt, what, param in (
            ({"type": "json_schema", "json_schema": {"name": "x", "schema": dangling}},
             "nowhere", None),
            ({"type": "json_schema", "json_schema": {"name": "x", "schema": broken}},
             "uniqueItems", "response_format"),
            ({"type": "regex", "regex": "[a-"}, "unclosed character class", "response_format")):
        r = live.post("/v1/chat/completions", {"model": M, "messages": ASK, "max_tokens": 2,
                                               "response_format": fmt})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert what in err["message"] and err["param"] == param, err
    r = live.post("/v1/responses", {"model": M, "input": "json?", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": broken}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text
    assert chat(live, max_tokens=2)["finish_reason"] == "length"  # (still serving)
