"""The server over real HTTP on loopback with the fixture model: the official openai and
anthropic SDKs as clients, the raw endpoints, errors in each API's shape, queueing."""
from __future__ import annotations

import json
import threading

import anthropic
import deepseek_recipe as dr
import httpx
import openai
import pytest

from strata.model.model import Model
from strata.runtime.sampling import SamplingParams
from strata.runtime.session import Session
from tests.serve_helpers import M, LiveServer, recipe_prompt_ids, recipe_tokenizer

CAP = 4096


@pytest.fixture(scope="module")
def model(real_vocab_dir):
    return Model.load(real_vocab_dir)


@pytest.fixture(scope="module")
def live(model, real_vocab_dir):
    with LiveServer(model, real_vocab_dir, capacity=CAP) as srv:
        yield srv


@pytest.fixture(scope="module")
def oa(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def an(live):
    return anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0)


def direct(model, prompt: list[int], n: int, params=SamplingParams()) -> list[int]:
    """What the engine must produce: a cold Session run of the same prompt."""
    return Session(model, CAP).run(prompt, n, params).tokens


CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime number."}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def test_health_and_models(live, oa):
    assert httpx.get(live.url + "/health").json()["status"] == "ok"
    assert [m.id for m in oa.models.list().data] == [M]


def test_openai_chat_plain_matches_a_direct_run(live, oa, model, real_vocab_dir):
    r = oa.chat.completions.create(model=M, messages=CHAT, max_tokens=6, temperature=0,
                                   reasoning_effort="none")
    body = {"model": M, "messages": CHAT, "reasoning_effort": "none"}
    prompt = recipe_prompt_ids(real_vocab_dir, body)
    want = direct(model, prompt, 6)
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == len(want) == 6
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content == live.server.htok.decode(want, skip_special_tokens=False)


def test_openai_chat_streamed_equals_plain(oa):
    kw = dict(model=M, messages=CHAT, max_tokens=6, seed=11)  # thinking mode: temperature 1
    plain = oa.chat.completions.create(**kw)
    chunks = list(oa.chat.completions.create(**kw, stream=True,
                                             stream_options={"include_usage": True}))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                        for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    msg = plain.choices[0].message
    assert reasoning == (msg.model_extra.get("reasoning_content") or "")
    assert content == (msg.content or "")
    assert reasoning + content  # the fixture model said something
    usage = [c.usage for c in chunks if c.usage]
    assert usage and usage[-1].completion_tokens == plain.usage.completion_tokens
    assert usage[-1].prompt_tokens == plain.usage.prompt_tokens


def test_openai_tools_render_into_the_prompt(oa, real_vocab_dir):
    r = oa.chat.completions.create(model=M, messages=CHAT, tools=TOOLS, tool_choice="auto",
                                   max_tokens=3, seed=1)
    want = recipe_prompt_ids(real_vocab_dir, {"model": M, "messages": CHAT, "tools": TOOLS})
    bare = recipe_prompt_ids(real_vocab_dir, {"model": M, "messages": CHAT})
    assert r.usage.prompt_tokens == len(want)
    assert len(want) > len(bare) + 200  # the V4.1 tool instructions and schemas are there


def test_openai_json_response_format_renders_into_the_prompt(oa, real_vocab_dir):
    msgs = CHAT[:1] + [{"role": "user", "content": "Name a prime number, as JSON."}]
    body = {"model": M, "messages": msgs, "response_format": {"type": "json_object"},
            "reasoning_effort": "none"}
    r = oa.chat.completions.create(**body, max_tokens=2, temperature=0)
    want = recipe_prompt_ids(real_vocab_dir, body)
    assert r.usage.prompt_tokens == len(want)
    assert len(want) > len(recipe_prompt_ids(real_vocab_dir, {**body, "response_format":
                                                              {"type": "text"}}))


def test_openai_stop_string_ends_the_answer(oa):
    kw = dict(model=M, messages=CHAT, max_tokens=8, temperature=0, reasoning_effort="none")
    full = oa.chat.completions.create(**kw).choices[0].message.content
    stop = full[3:6]
    assert stop and stop not in full[:5]
    r = oa.chat.completions.create(**kw, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[:full.index(stop)]


def test_anthropic_plain_and_streamed(an, real_vocab_dir):
    kw = dict(model=M, max_tokens=6, system="You are terse.",
              messages=[{"role": "user", "content": "Name a prime number."}],
              thinking={"type": "disabled"}, extra_body={"temperature": 0.0})
    msg = an.messages.create(**kw)
    assert msg.role == "assistant" and msg.stop_reason == "max_tokens"
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert text
    with an.messages.stream(**kw) as stream:
        deltas = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert deltas == text
    assert final.usage.output_tokens == msg.usage.output_tokens
    body = {k: v for k, v in kw.items() if k != "extra_body"}
    prompt = recipe_prompt_ids(real_vocab_dir, body, cls=dr.MessagesRequest)
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == len(prompt)


def test_anthropic_thinking_blocks(an):
    msg = an.messages.create(model=M, max_tokens=5, thinking={"type": "enabled", "budget_tokens": 1024},
                             messages=[{"role": "user", "content": "hi"}])
    assert msg.content and msg.content[0].type == "thinking"


def test_responses_api(oa):
    r = oa.responses.create(model=M, input="Name a prime number.", max_output_tokens=5,
                            reasoning={"effort": "none"}, temperature=0)
    assert r.status == "incomplete" and r.output_text
    assert r.usage.input_tokens > 0


def test_reasoning_tokens_are_the_models_own(live, oa, real_vocab_dir):
    """The usage counts the tokens the model reasoned with, also where it spelled the reasoning
    with other tokens than the tokenizer would and the answer ends inside it (the recipe alone
    counts that case by re-encoding the text: 3 here, not 4)."""
    tok = recipe_tokenizer(real_vocab_dir)
    odd = tok.encode(" Par") + tok.encode("is")  # the canonical " Paris" is one token
    assert len(tok.encode(" Paris")) == 1 and len(odd) == 2
    odd += tok.encode(" is near")
    n = len(odd)
    ask = [{"role": "user", "content": "Where?"}]
    try:
        live.script([{"match": "", "tokens": odd}])
        r = oa.chat.completions.create(model=M, messages=ask, max_tokens=n)
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == n
        assert r.usage.completion_tokens_details.reasoning_tokens == n
        last = list(oa.chat.completions.create(model=M, messages=ask, max_tokens=n, stream=True,
                                               stream_options={"include_usage": True}))[-1]
        assert last.usage.completion_tokens_details.reasoning_tokens == n
        resp = oa.responses.create(model=M, input="Where?", max_output_tokens=n)
        assert resp.usage.output_tokens == n
        assert resp.usage.output_tokens_details.reasoning_tokens == n
        # the reasoning closed: its tokens before `</think>`, not the answer's
        answer = tok.encode("</think>Here.<｜end▁of▁sentence｜>")
        live.script([{"match": "", "tokens": odd + answer}])
        r = oa.chat.completions.create(model=M, messages=ask, max_tokens=50)
        assert r.choices[0].message.content == "Here."
        assert r.usage.completion_tokens == n + len(answer) - 1  # (the end of sentence)
        assert r.usage.completion_tokens_details.reasoning_tokens == n
        # no reasoning: no count
        r = oa.chat.completions.create(model=M, messages=ask, max_tokens=50,
                                       extra_body={"thinking": {"type": "disabled"}})
        assert r.usage.completion_tokens_details is None
    finally:
        live.script(None)


def test_completions_raw_prompt(live, model):
    body = {"model": M, "prompt": "def fib(n):", "max_tokens": 5, "temperature": 0}
    r = live.post("/v1/completions", body).json()
    ids = live.server.htok.encode("def fib(n):", add_special_tokens=False).ids
    want = direct(model, ids, 5)
    assert r["choices"][0]["text"] == live.server.htok.decode(want, skip_special_tokens=False)
    assert r["usage"]["prompt_tokens"] == len(ids) and r["usage"]["completion_tokens"] == 5
    with httpx.stream("POST", live.url + "/v1/completions", json=dict(body, stream=True),
                      timeout=60) as s:
        datas = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    streamed = "".join(json.loads(d)["choices"][0]["text"] for d in datas[:-1])
    assert streamed == r["choices"][0]["text"]
    assert r["choices"][0]["logprobs"] is None


def test_completions_logprobs(live):
    """/v1/completions' logprobs (the legacy shape): a token's text, logprob, top
    alternatives and offset in the answer, for every token of the answer — a greedy token is
    its own top alternative; streamed, each chunk carries the tokens whose text it completes,
    together the same figures; cut at a stop string, the tokens through the cut."""
    body = {"model": M, "prompt": "def fib(n):", "max_tokens": 8, "temperature": 0,
            "logprobs": 3}
    r = live.post("/v1/completions", body).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) \
        == len(lp["text_offset"]) == r["usage"]["completion_tokens"] == 8
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    for tok, val, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        best = max(top, key=top.get)
        assert len(top) <= 3 and val <= 0 and top[best] == val and best == tok
    with httpx.stream("POST", live.url + "/v1/completions", json=dict(body, stream=True),
                      timeout=60) as s:
        datas = [json.loads(ln[6:]) for ln in s.iter_lines()
                 if ln.startswith("data: ") and ln != "data: [DONE]"]
    parts = [d["choices"][0]["logprobs"] for d in datas if d["choices"][0]["logprobs"]]
    assert [v for p in parts for v in p["token_logprobs"]] == lp["token_logprobs"]
    assert [t for p in parts for t in p["tokens"]] == lp["tokens"]
    text = r["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = live.post("/v1/completions", dict(body, stop=[stop])).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and len(cut["text"]) < len(text)
    n = len(cut["logprobs"]["tokens"])
    assert cut["logprobs"]["tokens"] == lp["tokens"][:n] and 0 < n < 8
    assert cut["logprobs"]["text_offset"][-1] <= len(cut["text"])


# ---- errors: each in the API's own shape, and the server keeps serving ---------------------------
def _oa_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err
    return err


def _an_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["message"]
    return body["error"]


def test_malformed_json(live):
    _oa_error(live.post("/v1/chat/completions", b'{"model": '), 400)
    _an_error(live.post("/v1/messages", b"[1, 2"), 400)
    _oa_error(live.post("/v1/chat/completions", b"[]"), 400)


def test_wrong_schema(live):
    err = _oa_error(live.post("/v1/chat/completions", {"model": M, "messages": "hi"}), 400)
    assert "messages" in err["message"] or "sequence" in err["message"]
    _oa_error(live.post("/v1/chat/completions", {"model": M, "messages": CHAT,
                                                  "temperature": "hot"}), 400)
    _an_error(live.post("/v1/messages", {"model": M, "messages": [{"role": "user"}],
                                         "max_tokens": 5}), 400)
    _oa_error(live.post("/v1/completions", {"model": M, "prompt": 5}), 400)
    _oa_error(live.post("/v1/completions", {"model": M, "prompt": "x", "max_tokens": -1}), 400)


def test_unknown_model(live, oa, an):
    with pytest.raises(openai.NotFoundError) as e:
        oa.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    assert "gpt-4o" in str(e.value)
    with pytest.raises(anthropic.NotFoundError) as e:
        an.messages.create(model="claude-x", max_tokens=2,
                           messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "not_found_error"
    # The recipe also knows DeepSeek-V4-Pro, which this server does not serve.
    _oa_error(live.post("/v1/chat/completions", {"model": "DeepSeek-V4-Pro", "messages": CHAT}), 404)


def test_oversized_body(live):
    big = {"model": M, "messages": [{"role": "user", "content": "x" * (17 << 20)}]}
    err = _oa_error(live.post("/v1/chat/completions", big), 413)
    assert "limit" in err["message"]
    _an_error(live.post("/v1/messages", dict(big, max_tokens=4)), 413)


def test_context_overflow_reports_the_numbers(live, real_vocab_dir):
    long = " ".join(["word"] * CAP)
    body = {"model": M, "messages": [{"role": "user", "content": long}], "max_tokens": 10,
            "reasoning_effort": "none"}
    n = len(recipe_prompt_ids(real_vocab_dir, body))
    err = _oa_error(live.post("/v1/chat/completions", body), 400)
    assert str(CAP) in err["message"] and str(n) in err["message"], err
    err = _an_error(live.post("/v1/messages", {"model": M, "max_tokens": 10, "messages":
                                              [{"role": "user", "content": long}]}), 400)
    assert str(CAP) in err["message"]
    err = _oa_error(live.post("/v1/completions", {"model": M, "prompt": long, "max_tokens": 10}),
                    400)
    assert str(CAP) in err["message"] and err["param"] == "prompt"


def test_unknown_route_and_unsupported_features(live):
    _oa_error(httpx.get(live.url + "/v1/nothing"), 404)
    err = _oa_error(live.post("/v1/chat/completions", {"model": M, "messages": CHAT,
                                                       "logprobs": True, "top_logprobs": 21}),
                    400)
    assert "top_logprobs" in err["message"]
    for bad in ({"echo": True}, {"logprobs": 21}, {"logprobs": True}):
        err = _oa_error(live.post("/v1/completions", dict({"model": M, "prompt": "hi"}, **bad)),
                        400)
        assert err["param"] == next(iter(bad)), err
    # a token bias would ban or force tokens: refused, not dropped; an empty one is no bias
    for path, body in (("/v1/chat/completions", {"model": M, "messages": CHAT}),
                       ("/v1/completions", {"model": M, "prompt": "hi"})):
        err = _oa_error(live.post(path, dict(body, logit_bias={"50256": -100})), 400)
        assert "logit_bias" in err["message"] and err["param"] == "logit_bias"
        assert live.post(path, dict(body, logit_bias={}, max_tokens=1)).status_code == 200
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    err = _oa_error(live.post("/v1/chat/completions", {"model": M, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}]}), 400)
    assert "image" in err["message"] and err["param"] == "messages"
    # the same refusals from the Responses API name its own fields
    image = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
    err = _oa_error(live.post("/v1/responses", {"model": M, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "what is this?"}, image]}]}),
        400)
    assert "image" in err["message"] and err["param"] == "input"
    schema = {"type": "json_schema", "name": "x", "schema": {"type": "array", "not": {}}}
    err = _oa_error(live.post("/v1/responses", {"model": M, "input": "hi",
                                                "text": {"format": schema}}), 400)
    assert "not" in err["message"] and err["param"] == "text.format"


def test_request_shapes_clients_send(live, an, real_vocab_dir):
    """Fields the recipe does not read but clients send: OpenAI's max_completion_tokens (the
    newer name of max_tokens, which wins when both come) and developer role (a system
    message), an Anthropic tool of type "custom"; count_tokens; what this server cannot honour
    refused by name — a missing Anthropic max_tokens (it would run to the end of the
    context), a JSON schema or regex the grammar cannot enforce, chained Responses (no store),
    numbers out of JSON's range."""
    base = {"model": M, "messages": CHAT, "reasoning_effort": "none", "temperature": 0}
    r = live.post("/v1/chat/completions", dict(base, max_completion_tokens=3))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    r = live.post("/v1/chat/completions", dict(base, max_tokens=2, max_completion_tokens=5))
    assert r.json()["usage"]["completion_tokens"] == 2
    dev = [dict(CHAT[0], role="developer"), CHAT[1]]
    a = live.post("/v1/chat/completions", dict(base, messages=dev, max_tokens=1)).json()
    b = live.post("/v1/chat/completions", dict(base, max_tokens=1)).json()
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    tool = {"name": "get_weather", "description": "Weather of a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    plain = live.post("/v1/messages", {"model": M, "max_tokens": 1, "messages": msgs,
                                       "tools": [tool]})
    custom = live.post("/v1/messages", {"model": M, "max_tokens": 1, "messages": msgs,
                                        "tools": [dict(tool, type="custom")]})
    assert custom.status_code == 200, custom.text

    def prompt_tokens(r):  # (Anthropic's input_tokens leave out what the cache served)
        u = r.json()["usage"]
        return u["input_tokens"] + (u.get("cache_read_input_tokens") or 0)
    n = prompt_tokens(plain)
    assert prompt_tokens(custom) == n
    counted = live.post("/v1/messages/count_tokens", {"model": M, "messages": msgs,
                                                      "tools": [tool]})
    assert counted.json() == {"input_tokens": n}
    assert an.messages.count_tokens(model=M, messages=msgs, tools=[tool]).input_tokens == n
    err = _an_error(live.post("/v1/messages", {"model": M, "messages": msgs}), 400)
    assert "max_tokens" in err["message"]
    for fmt, what in (({"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "array", "not": {}}}}, "cannot be enforced"),
                      ({"type": "regex", "regex": "a+("}, "regex")):
        err = _oa_error(live.post("/v1/chat/completions", dict(base, response_format=fmt,
                                                               max_tokens=2)), 400)
        assert what in err["message"] and err["param"] == "response_format"
    err = _oa_error(live.post("/v1/responses", {"model": M, "input": "hi",
                                                "previous_response_id": "resp_x"}), 400)
    assert "previous_response_id" in err["message"]
    err = _oa_error(live.post("/v1/chat/completions", dict(base, seed=2 ** 64)), 400)
    err = _oa_error(live.post("/v1/completions", b'{"model": "%s", "prompt": "hi", '
                              b'"temperature": NaN}' % M.encode()), 400)
    assert "finite" in err["message"]
    err = _oa_error(live.post("/v1/completions", {"model": M, "prompt": "hi",
                                                  "stream": "false"}), 400)
    assert "stream" in err["message"]


def test_what_the_recipe_would_drop_is_refused_by_name(live):
    """Responses input items, content parts, tools and stored state the recipe does not
    convert (it would drop them without a word: a prompt missing part of the conversation) are
    refused, each naming the field; a forced tool call without tools and JSON nested past the
    parser's depth are 400s; the server keeps serving."""
    hi = [{"role": "user", "content": "hi"}]
    cases = [
        ({"input": hi + [{"type": "item_reference", "id": "msg_1"}]}, "input[1].type"),
        ({"input": hi + [{"type": "compaction", "encrypted_content": "x"}]}, "input[1].type"),
        ({"input": [{"type": "bogus"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [
            {"type": "input_text", "text": "read"},
            {"type": "input_file", "filename": "a.pdf", "file_data": "abc"}]}]},
         "input[0].content[1]"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "conversation": "conv_1"}, "conversation"),
        ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"input": "hi", "tool_choice": "required", "reasoning": {"effort": "none"}},
         "tool_choice"),
    ]
    for extra, param in cases:
        err = _oa_error(live.post("/v1/responses", dict({"model": M, "max_output_tokens": 2},
                                                        **extra)), 400)
        assert err["param"] == param, (extra, err)
    err = _oa_error(live.post("/v1/chat/completions", {
        "model": M, "messages": CHAT, "reasoning_effort": "none", "max_tokens": 2,
        "tool_choice": {"type": "function", "function": {"name": "f"}}}), 400)
    assert err["param"] == "tool_choice" and "no tools" in err["message"]
    deep = {"a": 1}
    for _ in range(200):
        deep = [deep]
    for path, body in (("/v1/responses", {"model": M, "input": "hi", "metadata": deep}),
                       ("/v1/chat/completions", {"model": M, "messages": CHAT,
                                                 "metadata": deep})):
        _oa_error(live.post(path, body), 400)
    _oa_error(live.post("/v1/chat/completions", b"[" * 5000 + b"]" * 5000), 400)
    r = live.post("/v1/responses", {"model": M, "input": hi + [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]}],
        "max_output_tokens": 2})
    assert r.status_code == 200, r.text


def test_anthropic_prefill_is_continued(live, model, real_vocab_dir):
    """A final assistant message of text starts the answer: the prompt ends with its tokens
    (no end-of-sentence, no new assistant turn) and the reply is what follows — the engine's
    own continuation of that prompt; thinking is off for it, refused if asked for."""
    msgs = [{"role": "user", "content": "Give me JSON."}]
    body = {"model": M, "max_tokens": 4, "temperature": 0, "messages": msgs,
            "thinking": {"type": "disabled"}}
    prompt = recipe_prompt_ids(real_vocab_dir, body, dr.MessagesRequest)
    prefill = live.server.htok.encode('{"a":', add_special_tokens=False).ids
    want = direct(model, prompt + prefill, 4)
    for last in ('{"a":', [{"type": "text", "text": '{"a":'}]):
        r = live.post("/v1/messages", dict(body, messages=msgs + [
            {"role": "assistant", "content": last}]))
        assert r.status_code == 200, r.text
        out = r.json()
        u = out["usage"]
        assert u["input_tokens"] + (u.get("cache_read_input_tokens") or 0) == len(
            prompt + prefill)
        text = "".join(b.get("text", "") for b in out["content"] if b["type"] == "text")
        assert text == live.server.htok.decode(want, skip_special_tokens=False)
    no_thinking = {k: v for k, v in body.items() if k != "thinking"}  # (off unless asked)
    r = live.post("/v1/messages", dict(no_thinking, messages=msgs + [
        {"role": "assistant", "content": '{"a":'}]))
    assert r.status_code == 200 and r.json()["content"][0]["type"] == "text", r.text
    err = _an_error(live.post("/v1/messages", dict(body, thinking={
        "type": "enabled", "budget_tokens": 1024}, messages=msgs + [
        {"role": "assistant", "content": '{"a":'}])), 400)
    assert "thinking" in err["message"]


def test_still_serving_after_errors(oa):
    r = oa.chat.completions.create(model=M, messages=CHAT, max_tokens=2, temperature=0,
                                   reasoning_effort="none")
    assert r.usage.completion_tokens == 2


def test_concurrent_requests_queue_and_all_finish(oa, live):
    prompts = [f"Count to {i}." for i in range(5)]

    def ask(p):
        return oa.chat.completions.create(model=M, messages=[{"role": "user", "content": p}],
                                          max_tokens=4, temperature=0, reasoning_effort="none")

    alone = [ask(p).choices[0].message.content for p in prompts]
    results: dict[int, str] = {}

    def worker(i):
        results[i] = ask(prompts[i]).choices[0].message.content

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [results.get(i) for i in range(len(prompts))] == alone


def test_api_key_required_when_set(model, real_vocab_dir):
    with LiveServer(model, real_vocab_dir, capacity=512, api_key="sekrit") as srv:
        body = {"model": M, "messages": CHAT, "max_tokens": 1, "reasoning_effort": "none"}
        _oa_error(srv.post("/v1/chat/completions", body), 401)
        _an_error(srv.post("/v1/messages", dict(body, max_tokens=1), headers={"x-api-key": "no"}),
                  401)
        assert srv.post("/v1/chat/completions", body,
                        headers={"Authorization": "Bearer sekrit"}).status_code == 200
        assert srv.post("/v1/chat/completions", body,
                        headers={"x-api-key": "sekrit"}).status_code == 200
        # (a client may send the key in one header and leave the other empty)
        assert srv.post("/v1/chat/completions", body, headers={
            "x-api-key": "", "Authorization": "Bearer sekrit"}).status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200  # liveness stays open


def test_non_loopback_bind_needs_a_key():
    from strata.errors import StrataError
    from strata.serve.server import check_bind
    check_bind("127.0.0.1", None)
    check_bind("::1", None)
    check_bind("0.0.0.0", "k")
    with pytest.raises(StrataError, match="API key"):
        check_bind("0.0.0.0", None)


def test_logprobs_of_the_tokens_returned(live, oa):
    """Chat's logprobs / top_logprobs and Responses' top_logprobs: an entry a token returned,
    its alternatives likeliest first, the model's own distribution (a greedy answer's token
    is its top alternative); streamed, the same figures as unstreamed."""
    body = dict(model=M, messages=CHAT, max_tokens=6, temperature=0, reasoning_effort="none",
                logprobs=True, top_logprobs=3)
    r = oa.chat.completions.create(**body)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        vals = [t.logprob for t in e.top_logprobs]
        assert len(vals) == 3 and vals == sorted(vals, reverse=True) and vals[0] <= 0
        assert e.top_logprobs[0].token == e.token and e.logprob == vals[0]
    chunks = list(oa.chat.completions.create(**body, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")}
    assert oa.chat.completions.create(**plain).choices[0].logprobs is None
    rb = {"model": M, "input": CHAT, "max_output_tokens": 6, "temperature": 0,
          "reasoning": {"effort": "none"}, "top_logprobs": 2}
    out = live.post("/v1/responses", rb).json()["output"]
    text = [c for o in out if o["type"] == "message" for c in o["content"]][0]
    assert [e["token"] for e in text["logprobs"]] == [e.token for e in content]
    assert all(len(e["top_logprobs"]) == 2 for e in text["logprobs"])
