"""DSML tool calls end to end: the scripted-token hook makes the fixture model emit a DSML call
through the real decode path; clients get tool_calls / tool_use blocks (streamed and not), and
the follow-up with the tool result renders as deepseek-recipe renders it, hitting the cache for
the whole previous turn — also when the client drops the reasoning, re-serialises the
arguments, or the model's tokens are not the canonical encoding of its text."""
from __future__ import annotations

import json

import anthropic
import deepseek_recipe as dr
import openai
import pytest

from strata.model.model import Model
from tests.serve_helpers import EOS, M, LiveServer, recipe_prompt_ids, recipe_tokenizer

CALL = ('Need it.</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
        '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n'
        '</｜DSML｜ invoke>\n</｜DSML｜ calls>' + EOS)
ANSWER = "Got it.</think>It is sunny in Paris." + EOS
RULES = [{"match": "<tool_result>", "text": ANSWER}, {"match": "", "text": CALL}]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}}}}}]
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def live(real_vocab_dir):
    with LiveServer(Model.load(real_vocab_dir), real_vocab_dir, capacity=4096,
                    scripts=RULES) as srv:
        yield srv


@pytest.fixture(autouse=True)
def fresh_cache(live):
    """Each test starts without retained conversations or tool-call turns."""
    live.wait_idle()
    live.engine.cache.clear()
    live.script(RULES)
    yield


@pytest.fixture(scope="module")
def oa(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tok(real_vocab_dir):
    return recipe_tokenizer(real_vocab_dir)


def _followup(msg: dict) -> list[dict]:
    return ASK + [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"],
                        "content": "sunny, 21 C"}]


def test_chat_tool_call_and_followup(oa, tok, real_vocab_dir):
    r = oa.chat.completions.create(model=M, messages=ASK, tools=TOOLS, seed=3, max_tokens=200)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.model_extra["reasoning_content"] == "Need it."
    call = ch.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    emitted = tok.encode(CALL)
    p1 = recipe_prompt_ids(real_vocab_dir, {"model": M, "messages": ASK, "tools": TOOLS})
    assert r.usage.prompt_tokens == len(p1)
    assert r.usage.completion_tokens == len(emitted) - 1  # the end-of-sentence is not output

    msg = ch.message.model_dump(exclude_none=True)
    body = {"model": M, "messages": _followup(msg), "tools": TOOLS}
    r2 = oa.chat.completions.create(**body, seed=3, max_tokens=200)
    # Rendered as the recipe renders it, and the whole first turn came from the cache.
    assert r2.usage.prompt_tokens == len(recipe_prompt_ids(real_vocab_dir, body))
    assert r2.usage.prompt_tokens_details.cached_tokens == len(p1) + len(emitted) - 1
    assert r2.choices[0].message.content == "It is sunny in Paris."
    assert r2.choices[0].message.model_extra["reasoning_content"] == "Got it."
    assert r2.choices[0].finish_reason == "stop"


def test_chat_tool_call_streamed(oa):
    plain = oa.chat.completions.create(model=M, messages=ASK, tools=TOOLS, max_tokens=200)
    chunks = list(oa.chat.completions.create(model=M, messages=ASK, tools=TOOLS, max_tokens=200,
                                             stream=True, stream_options={"include_usage": True}))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    first, rest = deltas[0], deltas[1:]
    assert first.id and first.function.name == "get_weather"  # id and name first ...
    assert rest and all(d.id is None and d.function.name is None for d in rest)  # ... then args
    args = (first.function.arguments or "") + "".join(d.function.arguments for d in rest)
    assert args == plain.choices[0].message.tool_calls[0].function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_followup_without_reasoning_and_compact_arguments_hits_the_cache(oa, tok,
                                                                         real_vocab_dir):
    """What agents (OpenCode) send back: no reasoning_content, arguments as compact JSON."""
    r = oa.chat.completions.create(model=M, messages=ASK, tools=TOOLS, max_tokens=200)
    call = r.choices[0].message.tool_calls[0]
    compact = json.dumps(json.loads(call.function.arguments), separators=(",", ":"))
    assert compact != call.function.arguments
    msg = {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.function.name, "arguments": compact}}]}
    r2 = oa.chat.completions.create(model=M, messages=_followup(msg), tools=TOOLS,
                                    max_tokens=200)
    p1 = recipe_prompt_ids(real_vocab_dir, {"model": M, "messages": ASK, "tools": TOOLS})
    full = dict(msg, reasoning_content="Need it.")
    oracle = recipe_prompt_ids(real_vocab_dir, {"model": M, "messages": _followup(full),
                                                "tools": TOOLS})
    assert r2.usage.prompt_tokens_details.cached_tokens == len(p1) + len(tok.encode(CALL)) - 1
    assert r2.usage.prompt_tokens == len(oracle)
    # Without the substitution the recipe renders an empty reasoning: a shorter prompt.
    bare = recipe_prompt_ids(real_vocab_dir, {"model": M, "messages": _followup(msg),
                                              "tools": TOOLS})
    assert len(bare) < len(oracle)


def test_edited_tool_call_is_rendered_as_sent(oa, real_vocab_dir):
    """A client that changes the call's arguments gets its own message rendered."""
    r = oa.chat.completions.create(model=M, messages=ASK, tools=TOOLS, max_tokens=200)
    call = r.choices[0].message.tool_calls[0]
    msg = {"role": "assistant", "content": "", "reasoning_content": "Need it.", "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Lyon", "days": 3}'}}]}
    body = {"model": M, "messages": _followup(msg), "tools": TOOLS}
    r2 = oa.chat.completions.create(**body, max_tokens=200)
    assert r2.usage.prompt_tokens == len(recipe_prompt_ids(real_vocab_dir, body))


def test_non_canonical_model_tokens_are_replayed_exactly(live, oa, tok, real_vocab_dir):
    """The model may spell a text with other tokens than the tokenizer would; the next
    prompt must hold the model's own tokens, or the cache misses from there on."""
    canonical = tok.encode(CALL)
    at = CALL.index("Paris")
    odd = tok.encode(CALL[:at]) + tok.encode("Par") + tok.encode("is") + \
        tok.encode(CALL[at + len("Paris"):])
    assert odd != canonical and tok.encode("Paris") != tok.encode("Par") + tok.encode("is")
    live.script([{"match": "<tool_result>", "text": ANSWER}, {"match": "", "tokens": odd}])
    r = oa.chat.completions.create(model=M, messages=ASK, tools=TOOLS, max_tokens=200)
    msg = r.choices[0].message.model_dump(exclude_none=True)
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"])["city"] == "Paris"
    body = {"model": M, "messages": _followup(msg), "tools": TOOLS}
    r2 = oa.chat.completions.create(**body, max_tokens=200)
    p1 = recipe_prompt_ids(real_vocab_dir, {"model": M, "messages": ASK, "tools": TOOLS})
    oracle = recipe_prompt_ids(real_vocab_dir, body)  # canonical spelling of the same text
    assert r2.usage.prompt_tokens_details.cached_tokens == len(p1) + len(odd) - 1
    assert r2.usage.prompt_tokens == len(oracle) + len(odd) - len(canonical)


def test_anthropic_tool_use_round_trip(live, tok, real_vocab_dir):
    an = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0)
    tools = [{"name": "get_weather", "description": "Weather of a city",
              "input_schema": TOOLS[0]["function"]["parameters"]}]
    kw = dict(model=M, max_tokens=200, tools=tools,
              thinking={"type": "enabled", "budget_tokens": 1024}, messages=ASK)
    msg = an.messages.create(**kw)
    assert msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["thinking", "tool_use"]
    use = msg.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Paris", "days": 3}
    with an.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.content[1].input == use.input and final.stop_reason == "tool_use"

    history = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                       for b in msg.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": "sunny, 21 C"}]}]
    r2 = an.messages.create(**dict(kw, messages=history))
    body = {k: v for k, v in dict(kw, messages=history).items()}
    oracle = recipe_prompt_ids(real_vocab_dir, body, cls=dr.MessagesRequest)
    p1 = recipe_prompt_ids(real_vocab_dir, kw, cls=dr.MessagesRequest)
    assert r2.usage.cache_read_input_tokens == len(p1) + len(tok.encode(CALL)) - 1
    assert r2.usage.input_tokens + r2.usage.cache_read_input_tokens == len(oracle)
    assert [b.type for b in r2.content] == ["thinking", "text"]
    assert r2.content[1].text == "It is sunny in Paris."


def test_a_forced_tool_call_in_every_protocol(live):
    """Anthropic's tool_choice "any" (the recipe would read it as "auto"): the prompt opens the
    tool-call block, as OpenAI's "required" does, and the parser starts inside it — the
    scripted model output is only the invoke. Forcing a call turns thinking off unless the
    request asks for it (then: refused) — Anthropic, Chat ("required", a named function) and
    Responses alike; forcing a call without tools is refused."""
    forced = "<｜Assistant｜></think>\n\n<｜DSML｜ calls>\n"
    live.script([{"match": forced, "text": CALL[CALL.index("<｜DSML｜ invoke"):]},
                 {"match": "", "text": "Not forced.</think>No call." + EOS}])
    an = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0)
    tools = [{"name": "get_weather", "description": "Weather of a city",
              "input_schema": TOOLS[0]["function"]["parameters"]}]
    kw = dict(model=M, max_tokens=200, tools=tools, messages=ASK)
    auto = an.messages.create(**kw)
    assert auto.stop_reason == "end_turn"
    msg = an.messages.create(**kw, tool_choice={"type": "any"})
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use"]
    assert msg.content[0].name == "get_weather"
    assert msg.content[0].input == {"city": "Paris", "days": 3}
    with an.messages.stream(**kw, tool_choice={"type": "any"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].input == msg.content[0].input

    body = dict(kw, tool_choice={"type": "any"})
    r = live.post("/v1/messages", dict(body, thinking={"type": "enabled", "budget_tokens": 1024}))
    assert r.status_code == 400 and "thinking" in r.json()["error"]["message"]
    r = live.post("/v1/messages", {k: v for k, v in body.items() if k != "tools"})
    assert r.status_code == 400 and "no tools" in r.json()["error"]["message"]
    assert an.messages.create(**kw).stop_reason == "end_turn"  # still serving

    # OpenAI's "required" and a named function, Chat and Responses: thinking off unless asked
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = live.post("/v1/chat/completions", {"model": M, "messages": ASK, "tools": TOOLS,
                                               "tool_choice": choice, "max_tokens": 200})
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert msg["tool_calls"][0]["function"]["name"] == "get_weather"
        assert not msg.get("reasoning_content")
    r = live.post("/v1/chat/completions", {"model": M, "messages": ASK, "tools": TOOLS,
                                           "tool_choice": "required", "max_tokens": 200,
                                           "thinking": {"type": "enabled"}})
    assert r.status_code == 400, r.text
    r = live.post("/v1/responses", {"model": M, "input": ASK, "tool_choice": "required",
                                    "tools": [dict(TOOLS[0]["function"], type="function")],
                                    "max_output_tokens": 200})
    assert r.status_code == 200, r.text
    assert [o["type"] for o in r.json()["output"]] == ["function_call"]


def test_a_tool_call_whose_arguments_are_not_json_is_returned_not_a_500(live, oa):
    """The model may write a call whose values are not JSON (here days="three" typed as a
    number): the client gets the call as written, streamed or not, in Chat and Responses,
    and the stream still ends properly — remembering the turn for replay must not fail the
    response."""
    bad = ('No.</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
           '<｜DSML｜ parameter name="days" string="false">three</｜DSML｜ parameter>\n'
           '</｜DSML｜ invoke>\n</｜DSML｜ calls>' + EOS)
    live.script([{"match": "", "text": bad}])
    body = {"model": M, "messages": ASK, "tools": TOOLS, "max_tokens": 200}
    r = live.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and "three" in call["arguments"]
    with pytest.raises(ValueError):
        json.loads(call["arguments"])
    r = live.post("/v1/chat/completions", dict(body, stream=True))
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
    rb = {"model": M, "input": ASK, "max_output_tokens": 200,
          "tools": [dict(TOOLS[0]["function"], type="function")]}
    r = live.post("/v1/responses", rb)
    assert r.status_code == 200, r.text
    assert [o["type"] for o in r.json()["output"]][-1] == "function_call"
    r = live.post("/v1/responses", dict(rb, stream=True))
    assert r.status_code == 200 and "response.completed" in r.text
    live.script(RULES)
    assert oa.chat.completions.create(model=M, messages=ASK, tools=TOOLS,
                                      max_tokens=200).choices[0].finish_reason == "tool_calls"


def test_one_tool_call_a_turn_when_the_client_asks_for_it(live, oa, real_vocab_dir):
    """parallel_tool_calls false (Chat, Responses) and Anthropic's disable_parallel_tool_use:
    the model writes two calls, the client gets the first — streamed or not, the turn ending
    as a tool call — and the generation stops where the second begins. The cut turn is not
    remembered as the model's tokens: its follow-up renders as the recipe renders it."""
    second = CALL.replace("Paris", "Rome").split("</think>", 1)[1]
    second = second[second.index("<｜DSML｜ invoke"):]
    two = CALL[:CALL.index("</｜DSML｜ calls>")] + second
    live.script([{"match": "<tool_result>", "text": ANSWER}, {"match": "", "text": two}])
    body = {"model": M, "messages": ASK, "tools": TOOLS, "max_tokens": 300}
    both = live.post("/v1/chat/completions", body).json()
    assert [c["function"]["arguments"] for c in both["choices"][0]["message"]["tool_calls"]] \
        == ['{"city": "Paris", "days": 3}', '{"city": "Rome", "days": 3}']
    one = live.post("/v1/chat/completions", dict(body, parallel_tool_calls=False)).json()
    ch = one["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and len(ch["message"]["tool_calls"]) == 1
    assert ch["message"]["tool_calls"][0]["function"]["arguments"] == \
        '{"city": "Paris", "days": 3}'
    assert one["usage"]["completion_tokens"] < both["usage"]["completion_tokens"]
    chunks = list(oa.chat.completions.create(model=M, messages=ASK, tools=TOOLS, max_tokens=300,
                                             parallel_tool_calls=False, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas and {d.index for d in deltas} == {0}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    follow = {"model": M, "tools": TOOLS, "messages": ASK + [ch["message"], {
        "role": "tool", "tool_call_id": ch["message"]["tool_calls"][0]["id"],
        "content": "sunny"}]}
    r = live.post("/v1/chat/completions", dict(follow, max_tokens=50)).json()
    assert r["usage"]["prompt_tokens"] == len(recipe_prompt_ids(real_vocab_dir, follow))

    an = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0)
    kw = dict(model=M, max_tokens=300, messages=ASK, tools=[{
        "name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}])
    assert len([b for b in an.messages.create(**kw).content if b.type == "tool_use"]) == 2
    single = dict(kw, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    msg = an.messages.create(**single)
    assert msg.stop_reason == "tool_use"
    assert [b.input for b in msg.content if b.type == "tool_use"] == [{"city": "Paris", "days": 3}]
    with an.messages.stream(**single) as stream:
        final = stream.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == \
        [{"city": "Paris", "days": 3}]

    rb = {"model": M, "input": ASK, "max_output_tokens": 300,
          "tools": [dict(TOOLS[0]["function"], type="function")]}
    resp = live.post("/v1/responses", dict(rb, parallel_tool_calls=False)).json()
    calls = [o for o in resp["output"] if o["type"] == "function_call"]
    assert [c["arguments"] for c in calls] == ['{"city": "Paris", "days": 3}']
    assert resp["parallel_tool_calls"] is False  # (the request's, echoed)
    r = live.post("/v1/responses", dict(rb, parallel_tool_calls=False, stream=True))
    assert r.status_code == 200 and "response.completed" in r.text and "Rome" not in r.text
    assert '"parallel_tool_calls":false' in r.text and '"parallel_tool_calls":true' not in r.text


def test_one_call_holds_only_what_follows_the_first_invoke():
    """OneCall on tokens of one character each: before the first invoke closes every token
    passes; after it the tokens wait until their text shows the calls block closing (all of
    them passed on, in order) or a second invoke opening (dropped, the answer cut); what is
    still held when the generation ends is released."""
    from strata.serve.generation import OneCall

    def run(text: str) -> tuple[str, OneCall]:
        oc = OneCall(lambda ids: "".join(map(chr, ids)))
        return "".join(chr(i) for c in text for i, _ in oc.admit((ord(c), None))), oc

    first = '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">x</｜DSML｜ invoke>'
    out, oc = run(first + "\n</｜DSML｜ calls> after")
    assert out == first + "\n</｜DSML｜ calls> after" and not oc.cut
    out, oc = run(first + '\n<｜DSML｜invoke name="g">y</｜DSML｜ invoke>')  # (V4's spelling)
    assert out == first and oc.cut and oc.release() == []
    out, oc = run(first + "\n<｜DS")
    assert out == first and not oc.cut
    assert "".join(chr(i) for i, _ in oc.release()) == "\n<｜DS"
