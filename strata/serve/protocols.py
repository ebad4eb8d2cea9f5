"""The three request protocols deepseek-recipe converts, behind one small interface.

Each protocol names its recipe request and response classes, how to build the stream
generator, its error shape and id prefix, and how to read an assistant turn (reasoning,
content, tool calls) back out of a finished response — the server keeps that to re-render
tool-call turns exactly (serve/replay.py).
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

import deepseek_recipe as dr

from strata.serve.errors import ApiError


@dataclass(frozen=True)
class ToolCallOut:
    id: str
    name: str
    arguments: Any  # the parsed JSON arguments (the text where it is not JSON)


def arguments(text: str | None) -> Any:
    """A tool call's arguments as parsed JSON; the text itself where the model wrote no valid
    JSON (the call is still returned to the client as written — it is not a server error)."""
    try:
        return json.loads(text or "{}")
    except ValueError:
        return text


def refuse_logit_bias(body: dict) -> None:
    """A logit_bias with entries is refused by name: the sampler does not bias tokens, and a
    bias that bans or forces tokens, dropped without a word, would change what the client gets
    (penalties are only ignored, as DeepSeek's own API ignores them; an empty bias is none)."""
    if body.get("logit_bias"):
        raise ApiError("invalid_request", "'logit_bias' is not supported: this server does "
                       "not bias the sampler", param="logit_bias")


def forces_a_tool(choice: Any) -> bool:
    """Whether a request's tool_choice asks for a tool call (in any protocol's spelling).

    The recipe renders a forced call only with thinking off, and refuses it otherwise, while
    thinking is on unless asked off: so a request that forces a call and says nothing of
    thinking gets it off (Anthropic's default anyway); one that asks for thinking as well is
    refused."""
    return choice == "required" or (isinstance(choice, dict)
                                    and choice.get("type") in ("function", "custom", "tool", "any"))


def rebuilt(c: dr.Conversation, **changes: Any) -> dr.Conversation:
    """The conversation with some of its settings changed (a Conversation is immutable; its
    constructor takes a schema or regex format as the schema or regex alone)."""
    fmt = str(c.response_format)
    kw = dict(thinking_mode=c.thinking_mode, tools=c.tools, tool_choice=c.tool_choice,
              reasoning_effort=c.reasoning_effort,
              response_format=fmt if fmt in ("text", "json_object") else "text",
              response_schema=c.response_schema, response_regex=c.response_regex)
    kw.update(changes)
    return dr.Conversation(c.messages, **kw)


@dataclass(frozen=True)
class TurnOut:
    reasoning: str
    content: str
    tool_calls: tuple[ToolCallOut, ...]


@dataclass
class Converted:
    """A converted request and everything needed to stream its response."""

    request: dr.ConversationRequest
    generator: Any  # a recipe chunk generator (consumed by one StreamProcessor)
    response_id: str
    prefill: str = ""  # the start of the answer, given by the client: the prompt ends with it
    # What the prompt is rendered from and how the output is parsed: the request's own,
    # unless the protocol had to adjust them (Messages: tool_choice "any")
    conversation: dr.Conversation | None = None
    parsing: dr.ParsingOptions | None = None
    one_call: bool = False  # the client takes at most one tool call a turn
    strict_tools: frozenset[str] = frozenset()  # tools whose calls must fit their schemas

    def __post_init__(self) -> None:
        if self.conversation is None:
            self.conversation = self.request.conversation
        if self.parsing is None:
            self.parsing = self.request.parsing_options


class Protocol:
    name: str
    error_style: str = "openai"
    id_prefix: str
    request_cls: Any
    response_cls: Any
    # Chat Completions' names of request fields → this API's, for the errors that name them
    fields: dict[str, str] = {}

    def field(self, chat_name: str) -> str:
        return self.fields.get(chat_name, chat_name)

    def prepare(self, body: dict) -> dict:
        """The body as the recipe should read it: fields clients send that it does not know
        mapped to the ones it does, and what this server cannot honour refused by name."""
        return body

    def convert(self, body: dict, options: dr.ConversionOptions, model: str) -> Converted:
        rid = self.id_prefix + secrets.token_hex(12)
        creq = self.request_cls(self.prepare(body)).convert(options)
        self.check_tools(body, creq.conversation)
        return Converted(creq, self.request_cls.chunk_generator(creq, rid, model), rid,
                         one_call=self.one_call(body), strict_tools=self.strict_tools(body))

    @staticmethod
    def one_call(body: dict) -> bool:
        """Whether the request allows at most one tool call (OpenAI's parallel_tool_calls
        false; the recipe renders the same prompt either way, so the server enforces it on the
        output: serve.generation.OneCall)."""
        return body.get("parallel_tool_calls") is False

    @staticmethod
    def strict_tools(body: dict) -> frozenset[str]:
        """The names of the request's tools marked `strict: true` (Chat: on the function;
        Responses, Messages: on the tool)."""
        tools = body.get("tools")
        names = set()
        for t in tools if isinstance(tools, list) else []:
            fn = t.get("function") if isinstance(t, dict) and isinstance(t.get("function"),
                                                                          dict) else t
            if isinstance(fn, dict) and fn.get("strict") is True and isinstance(fn.get("name"),
                                                                                str):
                names.add(fn["name"])
        return frozenset(names)

    @staticmethod
    def check_tools(body: dict, conversation: dr.Conversation) -> None:
        # (the recipe would render a forced call of no tool as an ordinary answer)
        if forces_a_tool(body.get("tool_choice")) and not conversation.tools:
            raise ApiError("invalid_request", "tool_choice asks for a tool call, but the "
                           "request has no tools", param="tool_choice")

    def response(self, rid: str, model: str, created: int, prompt_tokens: int,
                 cached_tokens: int) -> Any:
        return self.response_cls(rid, model, created, prompt_tokens, cached_tokens)

    def sse_event_name(self, chunk: Any) -> str | None:
        return self.response_cls.sse_event_name(chunk)

    def sse_done_data(self) -> str | None:
        return self.response_cls.sse_done_data()

    def turn(self, response: dict) -> TurnOut:
        raise NotImplementedError


class ChatCompletions(Protocol):
    name, id_prefix = "chat", "chatcmpl-"
    request_cls, response_cls = dr.ChatCompletionRequest, dr.ChatCompletionResponse

    def prepare(self, body: dict) -> dict:
        # max_completion_tokens: the current name of max_tokens (which wins if both are sent);
        # the developer role: the system role of OpenAI's newer models
        refuse_logit_bias(body)
        body = dict(body)
        limit = body.pop("max_completion_tokens", None)
        if body.get("max_tokens") is None and limit is not None:
            body["max_tokens"] = limit
        if forces_a_tool(body.get("tool_choice")) and not ({"thinking", "reasoning_effort"}
                                                           & body.keys()):
            body["thinking"] = {"type": "disabled"}  # (forces_a_tool)
        msgs = body.get("messages")
        if isinstance(msgs, list):
            body["messages"] = [dict(m, role="system")
                                if isinstance(m, dict) and m.get("role") == "developer" else m
                                for m in msgs]
        return body

    def turn(self, response: dict) -> TurnOut:
        msg = response["choices"][0]["message"]
        calls = tuple(ToolCallOut(c["id"], c["function"]["name"],
                                  arguments(c["function"]["arguments"]))
                      for c in msg.get("tool_calls") or [])
        return TurnOut(msg.get("reasoning_content") or "", msg.get("content") or "", calls)


class Messages(Protocol):
    name, id_prefix, error_style = "messages", "msg_", "anthropic"
    request_cls, response_cls = dr.MessagesRequest, dr.MessagesResponse
    fields = {"response_format": "output_config.format"}

    def prepare(self, body: dict) -> dict:
        # Anthropic requires max_tokens; without it one request would hold the engine until
        # the context is full. A tool of type "custom" is a client tool, as one with no type.
        if body.get("max_tokens") is None:
            raise ApiError("invalid_request", "max_tokens: field required", param="max_tokens")
        tools = body.get("tools")
        if isinstance(tools, list) and any(isinstance(t, dict) and t.get("type") == "custom"
                                           for t in tools):
            body = dict(body, tools=[{k: v for k, v in t.items() if k != "type"}
                                     if isinstance(t, dict) and t.get("type") == "custom"
                                     else t for t in tools])
        return body

    @staticmethod
    def output_schema(body: dict) -> dict | None:
        """Anthropic's structured output, `output_config.format` (or the beta's
        `output_format`): {"type": "json_schema", "schema": {...}} — the schema, rendered into
        the prompt as Chat's json_schema format is and enforced the same way."""
        config = body.get("output_config")
        fmt = config.get("format") if isinstance(config, dict) else None
        if fmt is None:
            fmt = body.get("output_format")
        if fmt is None:
            return None
        if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema"
                and isinstance(fmt.get("schema"), dict)):
            raise ApiError("invalid_request", "output_config.format: expected {\"type\": "
                           "\"json_schema\", \"schema\": {...}}", param="output_config.format")
        return fmt["schema"]

    @staticmethod
    def one_call(body: dict) -> bool:
        choice = body.get("tool_choice")  # (Anthropic's spelling)
        return isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True

    def convert(self, body: dict, options: dr.ConversionOptions, model: str) -> Converted:
        body, prefill = self.split_prefill(body)
        choice = body.get("tool_choice")
        if forces_a_tool(choice) and "thinking" not in body:
            body = dict(body, thinking={"type": "disabled"})  # (forces_a_tool)
        any_tool = isinstance(choice, dict) and choice.get("type") == "any"
        if any_tool:  # the recipe reads "any" as "auto"; converted as auto, then made required
            body = dict(body, tool_choice=dict(choice, type="auto"))
        conv = super().convert(body, options, model)
        conv.prefill = prefill
        schema = self.output_schema(body)
        if schema is not None:  # (the recipe reads no Anthropic output format)
            conv.conversation = rebuilt(conv.conversation, response_format="text",
                                        response_schema=schema)
        if any_tool:
            self.check_tools({"tool_choice": choice}, conv.conversation)
            self.require_a_tool_call(conv)
        return conv

    @staticmethod
    def require_a_tool_call(conv: Converted) -> None:
        """tool_choice "any": the answer must be a call of one of the tools. The conversation
        becomes one with tool choice "required" (its prompt opens the tool-call block, as the
        recipe renders OpenAI's "required") and parsing starts inside that block. Anthropic
        refuses "any" with extended thinking, and so does this server (the recipe refuses
        "required" in thinking mode)."""
        c = conv.conversation
        if c.thinking_mode:
            raise ApiError("invalid_request", "tool_choice 'any' is not supported with thinking "
                           "enabled: disable thinking, or use tool_choice 'auto'",
                           param="tool_choice")
        if conv.prefill:
            raise ApiError("invalid_request", "tool_choice 'any' cannot continue a final "
                           "assistant message (the answer must be a tool call)",
                           param="tool_choice")
        conv.conversation = rebuilt(c, thinking_mode=False, tool_choice="required")
        conv.parsing.starts_in_tool_calls = True

    @staticmethod
    def split_prefill(body: dict) -> tuple[dict, str]:
        """A final assistant message of text is the start of the answer (Anthropic's prefill):
        the body without it, and its text — the prompt ends with it and the model continues
        it, instead of the turn closing. The answer is text, so thinking must be off (off
        unless asked for, as Anthropic's default)."""
        msgs = body.get("messages")
        if not (isinstance(msgs, list) and len(msgs) > 1 and isinstance(msgs[-1], dict)
                and msgs[-1].get("role") == "assistant"):
            return body, ""
        content = msgs[-1].get("content")
        if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                             for b in content):
            text = "".join(str(b.get("text", "")) for b in content)
        elif isinstance(content, str):
            text = content
        else:
            return body, ""  # (tool use or thinking blocks: the recipe's rules apply)
        thinking = body.get("thinking")
        if isinstance(thinking, dict) and thinking.get("type") == "enabled":
            raise ApiError("invalid_request", "a final assistant message (the start of the "
                           "answer) is continued only with thinking disabled", param="thinking")
        return dict(body, messages=msgs[:-1], thinking={"type": "disabled"}), text

    def turn(self, response: dict) -> TurnOut:
        blocks = response.get("content") or []
        reasoning = "".join(b.get("thinking", "") for b in blocks if b["type"] == "thinking")
        content = "".join(b.get("text", "") for b in blocks if b["type"] == "text")
        calls = tuple(ToolCallOut(b["id"], b["name"], b.get("input"))
                      for b in blocks if b["type"] == "tool_use")
        return TurnOut(reasoning, content, calls)


class Responses(Protocol):
    name, id_prefix = "responses", "resp_"
    request_cls, response_cls = dr.ResponsesRequest, dr.ResponsesResponse
    fields = {"messages": "input", "response_format": "text.format"}

    # What the recipe converts; anything else it would drop without a word, so it is refused.
    ITEMS = ("message", "reasoning", "function_call", "function_call_output",
             "custom_tool_call", "custom_tool_call_output")
    TOOLS = ("function", "namespace", "custom")

    def prepare(self, body: dict) -> dict:
        # no response store: a chained request would silently lose its conversation
        for key, what in (("previous_response_id", "stored responses"),
                          ("conversation", "stored conversations"),
                          ("prompt", "stored prompts"),
                          ("background", "background responses")):
            if body.get(key) not in (None, False):
                raise ApiError("invalid_request", f"'{key}' is not supported: this server "
                               f"keeps no {what}; send the whole conversation as input",
                               param=key)
        if forces_a_tool(body.get("tool_choice")) and "reasoning" not in body:
            body = dict(body, reasoning={"effort": "none"})  # (forces_a_tool)
        items = body.get("input")
        for i, item in enumerate(items if isinstance(items, list) else []):
            if not isinstance(item, dict):
                continue  # (the recipe names a malformed item)
            kind = item.get("type", "message" if "role" in item else None)
            if kind not in self.ITEMS:
                raise ApiError("invalid_request", f"input item type {kind!r} is not supported "
                               f"(this server takes {', '.join(self.ITEMS)}; it keeps no "
                               "stored items)", param=f"input[{i}].type")
            parts = item.get("content")
            for j, part in enumerate(parts if kind == "message" and isinstance(parts, list)
                                     else []):
                if isinstance(part, dict) and part.get("type") == "input_file":
                    raise ApiError("invalid_request", "file inputs are not supported by this "
                                   "server", param=f"input[{i}].content[{j}]")
        tools = body.get("tools")
        for i, tool in enumerate(tools if isinstance(tools, list) else []):
            if isinstance(tool, dict) and tool.get("type") not in self.TOOLS:
                raise ApiError("invalid_request", f"tool type {tool.get('type')!r} is not "
                               "supported: this server runs no hosted tools (it takes "
                               f"{', '.join(self.TOOLS)} tools)", param=f"tools[{i}].type")
        return body

    def convert(self, body: dict, options: dr.ConversionOptions, model: str) -> Converted:
        rid = self.id_prefix + secrets.token_hex(12)
        req = self.request_cls(self.prepare(body))
        # Read before convert() consumes the request.
        echo, ns_map = req.echo(), req.namespace_tool_map(options)
        creq = req.convert(options)
        self.check_tools(body, creq.conversation)
        gen = self.request_cls.chunk_generator(creq, rid, model).with_namespace_tool_map(
            ns_map).with_echo(echo)
        return Converted(creq, gen, rid, one_call=self.one_call(body))

    def turn(self, response: dict) -> TurnOut:
        reasoning, content, calls = [], [], []
        for item in response.get("output") or []:
            if item["type"] == "reasoning":
                reasoning += [c.get("text", "") for c in item.get("content") or []]
            elif item["type"] == "message":
                content += [c.get("text", "") for c in item.get("content") or []
                            if c.get("type") == "output_text"]
            elif item["type"] == "function_call":
                calls.append(ToolCallOut(item["call_id"], item["name"],
                                         arguments(item.get("arguments"))))
        return TurnOut("".join(reasoning), "".join(content), tuple(calls))


PROTOCOLS = {p.name: p for p in (ChatCompletions(), Messages(), Responses())}
