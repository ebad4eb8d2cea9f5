"""One request's generation, from engine events to protocol events.

`Generation` submits the job to the engine, moves the worker thread's events onto the
request's event loop, records metrics, emits keep-alive ticks while nothing else happens
(queue wait, long prefills) and cancels the job when the client goes away or the output
format says the answer is over (a stop sequence; a second tool call where the client takes
one). What the events look like on the wire is
the business of an `Output`:
- `RecipeOutput` feeds token ids to deepseek-recipe's StreamProcessor (Chat Completions,
  Messages, Responses: content / reasoning / DSML tool-call deltas, usage) and accumulates
  the final response object;
- `strata.serve.completions.TextOutput` writes raw-text completions.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol as Interface

import deepseek_recipe as dr

from strata.runtime.engine import (Engine, EngineStopped, Failed, Finished, GenRequest, Job,
                                   QueueFull, Started, Token)
from strata.serve.errors import ApiError
from strata.serve.metrics import Metrics
from strata.serve.protocols import Converted, Protocol


@dataclass(frozen=True)
class Sse:
    """One server-sent event: an optional event name and its data line."""

    event: str | None
    data: str

    def encode(self) -> bytes:
        head = f"event: {self.event}\n" if self.event else ""
        return f"{head}data: {self.data}\n\n".encode()


KEEPALIVE = b": keep-alive\n\n"
_TICK = object()  # the keep-alive timer's queue entry


class Output(Interface):
    """The wire format of one generation (see the module docstring)."""

    def ready(self, prompt_tokens: int, cached_tokens: int) -> list[Sse]: ...
    def token(self, token_id: int, logprob: Any = None) -> list[Sse]: ...  # (Token's)
    @property
    def done(self) -> bool: ...  # the format ended the answer (a stop sequence, OneCall)
    def finish(self, reason: str) -> list[Sse]: ...
    def result(self) -> dict: ...
    def error(self, err: ApiError) -> Sse: ...
    def done_data(self) -> str | None: ...
    def close(self) -> None: ...


# DSML's invoke tags (V4.1's spelling and V4's, which the recipe also parses)
INVOKE_CLOSES = ("</｜DSML｜ invoke>", "</｜DSML｜invoke>")
INVOKE_OPENS = ("<｜DSML｜ invoke", "<｜DSML｜invoke")


class OneCall:
    """At most one tool call a turn (Converted.one_call), on the model's tokens before the
    parser sees them: once the first invoke closes, the tokens after it are held until their
    text shows what follows — the close of the calls block (passed on, the turn ends as
    written) or a second invoke (dropped, and the answer is over: `cut`; finishing the parser
    then closes a block of one call, as if the model had written that)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.tail: list[int] = []        # the last tokens passed on (where the close shows)
        self.held: list[tuple[int, Any]] | None = None  # None: not holding
        self.settled = False             # the first call's successor is known to be no call
        self.cut = False

    def admit(self, token: tuple[int, Any]) -> list[tuple[int, Any]]:
        """The tokens (id, what comes with it) to pass on to the parser now, in order."""
        if self.cut:
            return []
        if self.settled:
            return [token]
        if self.held is None:
            self.tail = (self.tail + [token[0]])[-24:]
            # (the tail is decoded only where a tag can have closed: at a token with a ">")
            if ">" in self.decode(self.tail[-1:]) and \
                    self.decode(self.tail).rstrip().endswith(INVOKE_CLOSES):
                self.held = []
            return [token]
        self.held.append(token)
        text = self.decode([t for t, _ in self.held]).lstrip()
        if text.startswith(INVOKE_OPENS):
            self.cut, self.held = True, None
            return []
        if any(tag.startswith(text) for tag in INVOKE_OPENS):
            return []  # (whitespace, or the start of a tag: not known yet)
        out, self.held, self.settled = self.held, None, True
        return out

    def release(self) -> list[tuple[int, Any]]:
        """What is still held when the generation ends (a block cut short by length)."""
        out, self.held = self.held or [], None
        return out


# A usage's count of reasoning tokens, in the recipe's JSON (Chat's completion_tokens_details,
# Responses' output_tokens_details). A model text's quotes are escaped there, so its text never
# matches.
REASONING_COUNT = re.compile(r'"reasoning_tokens":\d+')


class RecipeOutput:
    """deepseek-recipe's stream processing and response accumulation for one request.
    `decode` (token ids → text) is needed only for a request of one tool call at most.
    `think_end`: the id of `</think>`, which ends the reasoning.

    The usage's reasoning tokens are the model's own, counted here: the recipe counts a
    reasoning that the generation's end cuts short by re-encoding its text, which can give
    more reasoning tokens than the completion has where the model spelled it with other
    tokens than the tokenizer would (checked against deepseek-recipe 0.2.0)."""

    def __init__(self, protocol: Protocol, conv: Converted, tokenizer: dr.Tokenizer,
                 model: str, eos_id: int, think_end: int,
                 decode: Callable[[list[int]], str] | None = None) -> None:
        self.protocol, self.conv, self.model, self.eos_id = protocol, conv, model, eos_id
        self.think_end = think_end
        self.sp = dr.StreamProcessor(conv.generator, conv.parsing, tokenizer)
        stage = conv.parsing.thinking_initial_stage
        self.reasoning = stage is not None and stage.starts_in_reasoning()
        self.reasoning_tokens = 0  # the tokens given to the parser before `</think>`
        if conv.one_call and decode is None:
            raise ValueError("a request of one tool call at most needs decode")
        self.one_call = OneCall(decode) if conv.one_call else None
        self.response: Any = None
        self._final: dict | None = None
        self._last = ""  # the last event's JSON (a Responses error event continues its numbers)

    def _emit(self, chunks: list) -> list[Sse]:
        out = []
        for c in chunks:
            # to_json first: accumulate() consumes the chunk.
            self._last = self._counted(c.to_json())
            if self.one_call is not None:  # (the recipe echoes a Responses request's as true)
                self._last = self._last.replace('"parallel_tool_calls":true',
                                                '"parallel_tool_calls":false')
            out.append(Sse(self.protocol.sse_event_name(c), self._last))
            self.response.accumulate(c)
        return out

    def ready(self, prompt_tokens: int, cached_tokens: int) -> list[Sse]:
        self.response = self.protocol.response(self.conv.response_id, self.model,
                                               int(time.time()), prompt_tokens, cached_tokens)
        usage = dr.PromptUsage(prompt_tokens=prompt_tokens, prompt_cache_hit_tokens=cached_tokens)
        return self._emit(self.sp.push(dr.InferenceChunk.ready(prompt_usage=usage)))

    def token(self, token_id: int, logprob: Any = None) -> list[Sse]:
        # The end-of-sentence token ends the turn; the recipe would pass it on as text.
        if self.sp.finished or token_id == self.eos_id:
            return []
        pairs = [(token_id, logprob)] if self.one_call is None else \
            self.one_call.admit((token_id, logprob))
        return self._push(pairs)

    def _push(self, pairs: list[tuple[int, Any]]) -> list[Sse]:
        """The parser's events for tokens (id, its Token.logprob or None)."""
        if not pairs:
            return []
        ids = [t for t, _ in pairs]
        lps = [lp for _, lp in pairs]
        for t in ids:
            self.reasoning = self.reasoning and t != self.think_end
            if self.reasoning:
                self.reasoning_tokens += 1
        chunk = (dr.InferenceChunk.tokens(ids) if lps[0] is None
                 else dr.InferenceChunk.tokens(ids, logprobs=lps))
        return self._emit(self.sp.push(chunk))

    @property
    def done(self) -> bool:
        return self.sp.finished or (self.one_call is not None and self.one_call.cut)

    def finish(self, reason: str) -> list[Sse]:
        out = []
        if self.one_call is not None and not self.sp.finished:
            out = self._push(self.one_call.release())
        if not self.sp.finished:
            why = dr.InferenceFinishReason.Length if reason == "length" \
                else dr.InferenceFinishReason.Stop
            out += self._emit(self.sp.push(dr.InferenceChunk.finish(why)))
        out += self._emit(self.sp.finish())
        self._final = json.loads(self._counted(self.response.to_json()))
        if self.one_call is not None and "parallel_tool_calls" in self._final:
            self._final["parallel_tool_calls"] = False
        return out

    def _counted(self, text: str) -> str:
        """The recipe's JSON with the reasoning tokens counted here."""
        return REASONING_COUNT.sub(f'"reasoning_tokens":{self.reasoning_tokens}', text)

    def result(self) -> dict:
        assert self._final is not None, "result() before finish()"
        return self._final

    def error(self, err: ApiError) -> Sse:
        body = err.body(self.protocol.error_style)
        if self.protocol.name == "chat":
            return Sse(None, json.dumps(body))
        if self.protocol.name == "responses":
            e = body["error"]
            seq = json.loads(self._last).get("sequence_number", -1) + 1 if self._last else 0
            return Sse("error", json.dumps({"type": "error", "code": e["code"] or e["type"],
                                            "message": e["message"], "param": e["param"],
                                            "sequence_number": seq}))
        return Sse("error", json.dumps(body))

    def done_data(self) -> str | None:
        return self.protocol.sse_done_data()

    def close(self) -> None:
        if not self.sp.finished:
            self.sp.close()


class Generation:
    def __init__(self, engine: Engine, metrics: Metrics, output: Output, request: GenRequest,
                 endpoint: str, arrived: float, keepalive_s: float) -> None:
        self.engine, self.metrics, self.output, self.request = engine, metrics, output, request
        self.endpoint, self.arrived, self.keepalive_s = endpoint, arrived, keepalive_s
        self.emitted: list[int] = []
        self.started: Started | None = None
        self.finished: Finished | None = None
        self.job: Job | None = None
        self._queue: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()

    def submit(self) -> None:
        """Queue the job (before any response byte is sent, so a full queue can be a 429)."""
        try:
            self.job = self.engine.submit(self.request, self._deliver)
        except QueueFull as e:
            self.metrics.requests.labels(self.endpoint, "rejected").inc()
            raise ApiError("rate_limit", f"the server is busy ({e}); retry shortly",
                           headers={"Retry-After": "1"}, counted=True) from None
        except EngineStopped as e:
            raise ApiError("unavailable", str(e)) from None

    def _deliver(self, ev: Any) -> None:  # on the engine's worker thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, ev)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.keepalive_s)
            self._queue.put_nowait(_TICK)

    def cancel(self) -> None:
        if self.job is not None and self.finished is None:
            self.engine.cancel(self.job)

    async def events(self) -> AsyncIterator[Sse | None]:
        """Wire events of the generation; None is a keep-alive tick. Raises ApiError if the
        engine fails the job. Cancels the job if the consumer stops early."""
        out = self.output
        ticker = asyncio.create_task(self._tick())
        quiet = True  # nothing sent since the last tick
        try:
            while True:
                ev = await self._queue.get()
                if ev is _TICK:
                    if quiet:
                        yield None
                    quiet = True
                    continue
                quiet = False
                if isinstance(ev, Token):
                    if not self.emitted:
                        self.metrics.ttft.observe(time.perf_counter() - self.arrived)
                    self.emitted.append(ev.id)
                    for s in out.token(ev.id, ev.logprob):
                        yield s
                    if out.done:  # (a stop sequence, a cut call): free the worker
                        self.cancel()
                elif isinstance(ev, Started):
                    self.started = ev
                    self.metrics.started(ev.prompt_tokens, ev.cached_tokens)
                    for s in out.ready(ev.prompt_tokens, ev.cached_tokens):
                        yield s
                elif isinstance(ev, Finished):
                    self.finished = ev
                    self.metrics.finished(ev)
                    # (a stop string or a cut call ends the answer by cancelling the rest:
                    # that is done)
                    gone = ev.reason == "cancelled" and not out.done
                    self.metrics.requests.labels(self.endpoint,
                                                 "cancelled" if gone else "ok").inc()
                    if self.started is None:  # cancelled while waiting
                        return
                    for s in out.finish(ev.reason):
                        yield s
                    return
                elif isinstance(ev, Failed):
                    self.finished = Finished("error", len(self.emitted), 0.0, 0.0)
                    self.metrics.requests.labels(self.endpoint, "error").inc()
                    # A request too long for the context is the client's to fix; the app
                    # checks that before queueing, so this is only a second line of defence.
                    kind = "invalid_request" if ev.error_type == "CapacityError" else "server"
                    raise ApiError(kind, f"generation failed: {ev.error_type}: {ev.message}",
                                   counted=True)
        finally:
            ticker.cancel()
            if self.finished is None:  # the consumer left (a closed stream)
                self.metrics.requests.labels(self.endpoint, "cancelled").inc()
                self.metrics.generated_tokens.inc(len(self.emitted))  # (its Finished unread)
                self.cancel()
            out.close()
