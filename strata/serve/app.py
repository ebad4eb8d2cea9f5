"""The HTTP app: OpenAI- and Anthropic-compatible endpoints over one engine.

  GET  /health                 liveness and queue depth
  GET  /metrics                Prometheus text format
  GET  /v1/models              the served model
  POST /v1/chat/completions    OpenAI Chat Completions (deepseek-recipe)
  POST /v1/messages            Anthropic Messages (deepseek-recipe)
  POST /v1/messages/count_tokens  the prompt tokens a Messages request would take
  POST /v1/responses           OpenAI Responses (deepseek-recipe)
  POST /v1/completions         raw prompt completions (serve/completions.py)

A chat request goes: size limit → JSON → model name → recipe conversion → V4.1 prompt
encoding → tool-call turns re-rendered as emitted (serve/replay.py) → context check with the
numbers → engine queue (429 when full) → streamed or collected answer. Every error is a JSON
body in the API's own shape; nothing a client sends stops the server.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import deepseek_recipe as dr
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from strata.errors import StrataError
from strata.runtime.constraint import (Constraint, GrammarError, Grammars, grammar,
                                      json_answer, regex_answer)
from strata.runtime.engine import Engine, GenRequest
from strata.runtime.sampling import SamplingParams
from strata.serve import completions
from strata.serve.errors import ApiError, from_conversion_error
from strata.serve.generation import KEEPALIVE, Generation, Output, RecipeOutput
from strata.serve.metrics import Metrics
from strata.serve.protocols import PROTOCOLS, Converted, Protocol
from strata.serve.replay import ToolTurns
from strata.serve.scripts import Scripts
from strata.serve.tool_grammar import calls_grammar
from strata.tokenizer import load_tokenizer, tokenizer_path

log = logging.getLogger("strata.serve")

MODEL_NAME = "DeepSeek-V4.1-Flash"


@dataclass(frozen=True)
class ServeConfig:
    model_name: str = MODEL_NAME
    api_key: str | None = None
    max_body_bytes: int = 16 << 20
    keepalive_s: float = 5.0        # SSE comment when nothing was sent for this long
    disconnect_poll_s: float = 0.25  # how often a non-streamed request checks its client


def _style(path: str) -> str:
    return "anthropic" if path.startswith("/v1/messages") else "openai"


# the endpoints whose requests /metrics counts, by path (the Generation's endpoint label)
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/messages": "messages",
             "/v1/responses": "responses", "/v1/completions": "completions",
             "/v1/messages/count_tokens": "count_tokens"}


class Server:
    """Everything the routes share: engine, tokenizers, recipe encoder, stores, metrics."""

    def __init__(self, engine: Engine, model_dir: str | Path, config: ServeConfig,
                 scripts: Scripts | list[dict] | None = None) -> None:
        self.engine, self.config = engine, config
        path = str(tokenizer_path(model_dir))
        self.rtok = dr.Tokenizer.from_file(path)          # recipe: prompt encoding, parsing
        self.htok = load_tokenizer(model_dir)             # raw completions: text in and out
        self.encoder = dr.DeepseekV41Encoding().with_tokenizer(self.rtok)
        # Prompts are encoded off the event loop (a long one takes seconds), one at a time.
        self._encoding = threading.Lock()
        # Only the model we serve; the recipe would also accept DeepSeek-V4-Pro.
        self.options = dr.ConversionOptions().with_model_versions_by_name(
            {config.model_name: dr.ModelVersion.DeepseekV41Flash})
        cfg = engine.model.cfg
        self.eos_id, self.vocab_size = cfg.eos_token_id, cfg.vocab_size
        self.tool_turns = ToolTurns(self.eos_id)
        self.grammars = Grammars(self.htok.to_str(), self.vocab_size, [self.eos_id])
        self.think_end = self.htok.token_to_id("</think>")
        self.dsml = self.htok.token_to_id("｜DSML｜")  # (opens each tag of a tool-call block)
        self.scripts = Scripts(scripts, self.rtok) if isinstance(scripts, list) else scripts
        self.metrics = Metrics(lambda: engine.queue_depth, engine.speculative is not None,
                               engine.model.engram_stores)

    # ---- request guards ----------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = [request.headers.get("x-api-key")]
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            given.append(auth[7:].strip())
        # (either header may carry it: clients set one and may leave the other empty)
        if not any(g is not None and hmac.compare_digest(g.encode(), key.encode())
                   for g in given):
            raise ApiError("authentication", "missing or invalid API key (send it as "
                           "'Authorization: Bearer KEY' or 'x-api-key: KEY')")

    async def read_json(self, request: Request) -> dict:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise ApiError("invalid_request", "malformed Content-Length header")
            if int(declared) > limit:
                raise ApiError("too_large", f"request body of {declared} bytes exceeds the "
                               f"limit of {limit} bytes")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise ApiError("too_large", f"request body exceeds the limit of {limit} bytes")
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as e:
            raise ApiError("invalid_request", f"malformed JSON in the request body: {e}") \
                from None
        if not isinstance(data, dict):
            raise ApiError("invalid_request", "the request body must be a JSON object")
        return data

    def check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.config.model_name:
            raise ApiError("not_found", f"the model {model!r} does not exist; this server "
                           f"serves {self.config.model_name!r}", param="model")

    def context_error(self, prompt: int, completion: int) -> ApiError:
        """A Completions prompt and max_tokens past the context (chat requests get the
        recipe's own error, in their API's terms)."""
        cap = self.engine.capacity
        return ApiError("invalid_request", f"This model's maximum context length is {cap} "
                        f"tokens. However, you requested {prompt + completion} tokens "
                        f"({prompt} in the prompt, {completion} in the completion). Please "
                        "reduce the length of the prompt or completion.", param="prompt",
                        code="context_length_exceeded")

    # ---- running a generation ------------------------------------------------------------------
    async def respond(self, request: Request, gen: Generation, stream: bool,
                      after=None) -> Response:
        gen.submit()
        if stream:
            return StreamingResponse(self._sse(gen, after), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})

        async def watch() -> None:  # a non-streamed request has no writes to fail on
            while not await request.is_disconnected():
                await asyncio.sleep(self.config.disconnect_poll_s)
            gen.cancel()

        watcher = asyncio.create_task(watch())
        try:
            async for _ in gen.events():
                pass
        finally:
            watcher.cancel()
        if gen.started is None:  # cancelled before it ran: only a gone client gets here
            raise ApiError("unavailable", "the request was cancelled before it started",
                           counted=True)
        self._after(after, gen)
        return JSONResponse(gen.output.result())

    @staticmethod
    def _after(after, gen: Generation) -> None:
        """The bookkeeping after a finished generation (remembering a tool-call turn): its
        failure costs only that, never the response the client is owed."""
        if after is None:
            return
        try:
            after(gen)
        except Exception:
            log.exception("after the response: bookkeeping failed")

    async def _sse(self, gen: Generation, after) -> AsyncIterator[bytes]:
        try:
            async for ev in gen.events():
                yield KEEPALIVE if ev is None else ev.encode()
        except ApiError as e:
            yield gen.output.error(e).encode()
            return
        except Exception as e:  # the status line is sent: report in the stream, then end it
            log.exception("streaming failed")
            yield gen.output.error(ApiError("server", f"internal error: {type(e).__name__}: "
                                                      f"{e}")).encode()
            return
        self._after(after, gen)
        done = gen.output.done_data()
        if done is not None:
            yield f"data: {done}\n\n".encode()

    def _encode(self, conversation) -> list[int]:
        with self._encoding:
            return list(self.encoder.encode(conversation))

    async def prompt(self, body: dict, protocol: Protocol):
        """(the converted request, its prompt ids) of a chat request body, or the ApiError
        that names what is wrong with it."""
        self.check_model(body)
        try:
            conv = protocol.convert(body, self.options, self.config.model_name)
        except dr.ConversionError as e:
            raise from_conversion_error(e) from None
        except (ValueError, TypeError, OverflowError, RecursionError) as e:
            raise ApiError("invalid_request", str(e)) from None
        creq = conv.request
        opts = creq.inference_options
        if any(m.image_sources for m in conv.conversation.messages):
            raise ApiError("invalid_request", "image inputs are not supported by this server "
                           "(the vision tower is not implemented)",
                           param=protocol.field("messages"))
        try:
            ids = await asyncio.to_thread(self._encode, conv.conversation)
        except (RuntimeError, ValueError) as e:
            raise ApiError("invalid_request", f"cannot encode the conversation: {e}") from None
        ids, _ = self.tool_turns.apply(conv.conversation, ids)
        if conv.prefill:
            ids += self.htok.encode(conv.prefill, add_special_tokens=False).ids
        return conv, ids

    def constraint(self, conv: Converted) -> Constraint | None:
        """The grammar the answer is held to, if any: the response format (JSON under the
        schema, any JSON object, the regex) — or, when tools may be called instead, that or a
        tool-call block (serve/tool_grammar.py: calls of the request's tools, a strict tool's
        arguments fitting its schema). Without a format, strict tools alone hold the
        calls block and leave the text before it free; a forced call (tool_choice required,
        a named tool, Anthropic's "any" or "tool") is held to the calls block of the tools it
        may call. The reasoning is always free (thinking mode: the grammar starts after
        `</think>`); a continued answer (a prefix message, Anthropic's prefill) must fit the
        format as given."""
        # (the recipe's output constraint gives the tools that may be called; Messages' format
        # is set on the conversation after it, so the format is read from the conversation)
        oc = conv.request.inference_options.output_constraint
        c = conv.conversation
        tools = json.loads(oc.schema) if oc is not None and oc.kind.startswith("tool_call") \
            else []
        strict = conv.strict_tools & {t["function"]["name"] for t in tools}
        if conv.parsing.starts_in_tool_calls or (oc is not None
                                                 and oc.kind == "tool_call_required"):
            # the prompt opened the calls block: the answer is calls alone — of the tools the
            # choice allows (a named one: that one), whatever the strictness, so a forced call
            # always parses
            return self.grammars.constraint(grammar(None, calls_grammar(tools, strict, "")))
        fmt = str(c.response_format)
        if fmt == "json_schema":
            answer = json_answer(c.response_schema)
        elif fmt == "json_object":
            answer = json_answer(None)
        elif fmt == "regex":
            answer = regex_answer(c.response_regex)
        else:
            answer = None
        stage = conv.parsing.thinking_initial_stage
        thinks = [] if stage in (None, dr.ThinkingInitialStage.ContentContinuation) \
            else [{self.think_end}]
        if answer is None:
            if not strict:
                return None  # (a text answer, calls as the model writes them)
            # free text, then a calls block from its `｜DSML｜` token on
            g = grammar(None, calls_grammar(tools, strict, " calls>\n"))
            return self.grammars.constraint(g, after=thinks + [{self.dsml}])
        g = grammar(answer, calls_grammar(tools, strict, "\n\n<｜DSML｜ calls>\n")
                    if tools else None)
        if thinks:
            return self.grammars.constraint(g, after=thinks)
        prefix = conv.prefill or (c.messages[-1].content if c.messages and c.messages[-1].prefix
                                  else "")  # (a prefix message: the prompt ends with it)
        ids = self.htok.encode(prefix, add_special_tokens=False).ids if prefix else []
        return self.grammars.constraint(g, prefix=ids)

    async def count_tokens(self, request: Request) -> dict:
        """Anthropic's count_tokens: the prompt tokens the same Messages body would take
        (max_tokens is not part of it)."""
        self.authorize(request)
        body = await self.read_json(request)
        _, ids = await self.prompt(dict(body, max_tokens=body.get("max_tokens") or 1),
                                   PROTOCOLS["messages"])
        self.metrics.requests.labels("count_tokens", "ok").inc()
        return {"input_tokens": len(ids)}

    async def recipe_request(self, request: Request, protocol: Protocol) -> Response:
        arrived = time.perf_counter()
        self.authorize(request)
        body = await self.read_json(request)
        conv, ids = await self.prompt(body, protocol)
        creq, opts, model = conv.request, conv.request.inference_options, self.config.model_name
        try:
            max_tokens = creq.resolve_max_tokens(len(ids), self.engine.capacity)
        except dr.ConversionError as e:
            err = from_conversion_error(e)
            err.code = "context_length_exceeded"
            raise err from None
        try:
            params = SamplingParams(
                temperature=opts.temperature if opts.temperature is not None else 1.0,
                top_p=opts.top_p if opts.top_p is not None else 1.0,
                seed=opts.seed if opts.seed is not None else secrets.randbits(63))
        except StrataError as e:
            raise ApiError("invalid_request", str(e)) from None
        try:
            constraint = await asyncio.to_thread(self.constraint, conv)
        except GrammarError as e:
            raise ApiError("invalid_request", f"response format: {e}",
                           param=protocol.field("response_format")) from None
        scripted = None
        if self.scripts is not None:
            scripted = self.scripts.pick(
                dr.DeepseekV41Encoding().render_conversation(conv.conversation).prompt)
        output = RecipeOutput(protocol, conv, self.rtok, model, self.eos_id, self.think_end,
                              lambda ids: self.htok.decode(ids, skip_special_tokens=False))
        gen = Generation(self.engine, self.metrics, output,
                         GenRequest(ids, max_tokens, params, scripted=scripted,
                                    # (top_logprobs: the recipe checks 0..20)
                                    logprobs=(opts.top_logprobs or 0) if opts.logprobs
                                    else None, constraint=constraint),
                         protocol.name, arrived, self.config.keepalive_s)

        def remember(g: Generation) -> None:
            # (a prefilled turn's text began in the prompt: its emitted tokens are not the turn)
            if g.finished is not None and g.finished.reason == "stop" and not conv.prefill:
                self.tool_turns.remember(ids, g.emitted, protocol.turn(g.output.result()))

        return await self.respond(request, gen, creq.stream, remember)

    async def completion_request(self, request: Request) -> Response:
        arrived = time.perf_counter()
        self.authorize(request)
        body = await self.read_json(request)
        if "model" not in body:
            raise ApiError("invalid_request", "'model' is required", param="model")
        self.check_model(body)
        req = await asyncio.to_thread(completions.parse, body, self.htok, self.vocab_size)
        if len(req.prompt) + req.max_tokens > self.engine.capacity:
            raise self.context_error(len(req.prompt), req.max_tokens)
        try:
            params = SamplingParams(req.temperature, req.top_p,
                                    req.seed if req.seed is not None else secrets.randbits(63))
        except StrataError as e:
            raise ApiError("invalid_request", str(e)) from None
        output: Output = completions.TextOutput(req, self.htok, self.config.model_name,
                                                self.eos_id)
        gen = Generation(self.engine, self.metrics, output,
                         GenRequest(req.prompt, req.max_tokens, params,
                                    logprobs=req.logprobs), "completions",
                         arrived, self.config.keepalive_s)
        return await self.respond(request, gen, req.stream)


def create_app(engine: Engine, model_dir: str | Path, config: ServeConfig = ServeConfig(),
               scripts: Scripts | list[dict] | None = None) -> FastAPI:
    """The app; its lifespan starts the engine and, on shutdown, drains and stops it."""
    server = Server(engine, model_dir, config, scripts)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            # uvicorn has already waited for in-flight requests; nothing is queued.
            await asyncio.to_thread(engine.stop, True)

    app = FastAPI(title="strata", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = server

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        endpoint = ENDPOINTS.get(request.url.path)
        if endpoint is not None and not e.counted:  # (by its kind: invalid_request, …)
            server.metrics.requests.labels(endpoint, e.kind).inc()
        return JSONResponse(e.body(_style(request.url.path)), status_code=e.status_code,
                            headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = {401: "authentication", 404: "not_found", 413: "too_large",
                429: "rate_limit"}.get(e.status_code, "invalid_request")
        err = ApiError(kind, str(e.detail), status=e.status_code)
        if e.status_code == 404:
            err.code = "not_found"
        return JSONResponse(err.body(_style(request.url.path)), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error in %s", request.url.path)
        err = ApiError("server", f"internal error: {type(e).__name__}: {e}")
        return JSONResponse(err.body(_style(request.url.path)), status_code=500)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": config.model_name, "queue_depth": engine.queue_depth}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        server.authorize(request)
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        server.authorize(request)
        return {"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": 0, "owned_by": "strata",
            "context_length": engine.capacity}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await server.recipe_request(request, PROTOCOLS["chat"])

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await server.recipe_request(request, PROTOCOLS["messages"])

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict:
        return await server.count_tokens(request)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await server.recipe_request(request, PROTOCOLS["responses"])

    @app.post("/v1/completions")
    async def completion(request: Request) -> Response:
        return await server.completion_request(request)

    return app
