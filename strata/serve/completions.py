"""POST /v1/completions: a raw prompt in, raw text out (OpenAI's legacy Completions API).

deepseek-recipe has no conversion for this API (there is no chat format to apply), so the
request is read here: the prompt is a string (encoded with the full vocabulary, so special
tokens written in it count as special) or a list of token ids.
"""
from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass

from tokenizers import Tokenizer

from strata.runtime.sampling import TOP_LOGPROBS_MAX
from strata.serve.errors import ApiError
from strata.serve.generation import Sse
from strata.serve.protocols import refuse_logit_bias

MAX_STOPS = 4


@dataclass(frozen=True)
class CompletionRequest:
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None = None  # each token's logprob and this many alternatives, or None


def _number(body: dict, key: str, default, kind, lo=None, hi=None):
    v = body.get(key, default)
    if v is None:
        v = default
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) if kind is float \
        else isinstance(v, int) and not isinstance(v, bool)
    if not ok:
        raise ApiError("invalid_request", f"'{key}' must be {'a number' if kind is float else 'an integer'}",
                       param=key)
    if v != v or v in (float("inf"), float("-inf")):  # (NaN passes every comparison)
        raise ApiError("invalid_request", f"'{key}' must be a finite number, got {v}", param=key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f"≥ {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ApiError("invalid_request", f"'{key}' must be {bounds}, got {v}", param=key)
    return kind(v)


def _flag(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if v is not None and not isinstance(v, bool):
        raise ApiError("invalid_request", f"'{key}' must be true or false, got {v!r}", param=key)
    return bool(v)


def parse(body: dict, tokenizer: Tokenizer, vocab_size: int) -> CompletionRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise ApiError("invalid_request", f"token ids must be in 0..{vocab_size - 1}",
                           param="prompt")
        ids = list(prompt)
    else:
        raise ApiError("invalid_request", "'prompt' must be a string or a list of token ids "
                       "(one prompt per request)", param="prompt")
    if not ids:
        raise ApiError("invalid_request", "the prompt is empty", param="prompt")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOPS or \
            not all(isinstance(s, str) and s for s in stop):
        raise ApiError("invalid_request", f"'stop' must be a non-empty string or a list of up "
                       f"to {MAX_STOPS} of them", param="stop")
    for key in ("n", "best_of"):
        if body.get(key, 1) not in (1, None):
            raise ApiError("invalid_request", f"'{key}' other than 1 is not supported", param=key)
    refuse_logit_bias(body)
    if body.get("echo"):
        raise ApiError("invalid_request", "'echo' is not supported (the prompt is not "
                       "returned, nor its logprobs)", param="echo")
    logprobs = None if body.get("logprobs") is None else \
        _number(body, "logprobs", None, int, 0, TOP_LOGPROBS_MAX)
    opts = body.get("stream_options") or {}
    seed = body.get("seed")
    if seed is not None:
        seed = _number(body, "seed", None, int, 0, 2 ** 63 - 1)
    return CompletionRequest(
        prompt=ids,
        max_tokens=_number(body, "max_tokens", 16, int, 1),
        temperature=_number(body, "temperature", 1.0, float, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, float, 1e-6, 1.0),
        seed=seed, stop=tuple(stop), stream=_flag(body, "stream"),
        include_usage=bool(isinstance(opts, dict) and opts.get("include_usage")),
        logprobs=logprobs)


class TextOutput:
    """Incremental detokenisation with stop strings, as Completions chunks; with logprobs,
    each token's figures (the legacy shape: tokens, token_logprobs, top_logprobs, text_offset
    from the completion's start) in the chunk that sends the end of its text."""

    def __init__(self, req: CompletionRequest, tokenizer: Tokenizer, model: str,
                 eos_id: int) -> None:
        self.req, self.tok, self.model, self.eos_id = req, tokenizer, model, eos_id
        self.id = "cmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self.ids: list[int] = []
        self.sent = ""            # text already sent
        self.text = ""            # the whole answer so far (cut at a stop string)
        self.finish_reason: str | None = None
        self.usage: dict = {}
        self.figures: list = []   # each token's Token.logprob (with logprobs)
        self.ends: list[int] = []  # the answer's decoded length after each token
        self.reported = 0         # tokens whose figures have been sent (streamed)

    def _through(self, first: int, upto: int) -> int:
        """The end of the run of tokens from `first` whose text ends by `upto`."""
        n = first
        while n < len(self.ids) and self.ends[n] <= upto:
            n += 1
        return n

    def _logprobs(self, part: range) -> dict | None:
        """The legacy logprobs of tokens `part` (None without logprobs)."""
        if self.req.logprobs is None:
            return None
        text = self.tok.decode
        return {"tokens": [text([self.ids[i]], skip_special_tokens=False) for i in part],
                "token_logprobs": [self.figures[i][0] for i in part],
                "top_logprobs": [{text([t], skip_special_tokens=False): lp
                                  for t, lp in self.figures[i][1]} for i in part],
                "text_offset": [self.ends[i - 1] if i else 0 for i in part]}

    def _answer_tokens(self) -> int:
        """How many tokens a finished answer reports: the stop string's cut falls inside or
        after a token, which is reported whole."""
        n = next((i for i in range(len(self.ids)) if self.ends[i] >= len(self.text)), None)
        return len(self.ids) if n is None else self._through(n, self.ends[n])

    def _chunk(self, text: str, finish: str | None = None, usage: dict | None = None,
               logprobs: dict | None = None) -> Sse:
        body = {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": [{"index": 0, "text": text,
                                                  "logprobs": logprobs,
                                                  "finish_reason": finish}]}
        if usage is not None:
            body["usage"] = usage
        return Sse(None, json.dumps(body, ensure_ascii=False))

    def ready(self, prompt_tokens: int, cached_tokens: int) -> list[Sse]:
        self.usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 0,
                      "total_tokens": prompt_tokens,
                      "prompt_tokens_details": {"cached_tokens": cached_tokens}}
        return []

    def token(self, token_id: int, logprob=None) -> list[Sse]:
        if self.finish_reason is not None:
            return []
        self.usage["completion_tokens"] += 1
        self.usage["total_tokens"] += 1
        if token_id == self.eos_id:
            return []
        self.ids.append(token_id)
        self.figures.append(logprob)
        text = self.tok.decode(self.ids, skip_special_tokens=False)
        self.ends.append(len(text))
        hits = [text.find(s) for s in self.req.stop if s in text]
        if hits:
            text, self.finish_reason = text[:min(hits)], "stop"
        self.text = text
        # Hold back a partial UTF-8 sequence and anything that may begin a stop string.
        safe = len(text)
        if self.finish_reason is None:
            if text.endswith("\ufffd"):
                safe = len(text.rstrip("\ufffd"))
            for s in self.req.stop:
                for k in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:k]):
                        safe = min(safe, len(text) - k)
                        break
        delta, self.sent = text[len(self.sent):safe], text[:safe]
        if not (delta and self.req.stream):
            return []
        n = self._through(self.reported, len(self.sent))
        part, self.reported = range(self.reported, n), n
        return [self._chunk(delta, logprobs=self._logprobs(part))]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: str) -> list[Sse]:
        self.finish_reason = self.finish_reason or ("length" if reason == "length" else "stop")
        if not self.req.stream:
            return []
        n = self._answer_tokens()
        out = [self._chunk(self.text[len(self.sent):], self.finish_reason,
                           logprobs=self._logprobs(range(self.reported, n)))]
        self.reported = n
        self.sent = self.text
        if self.req.include_usage:
            body = {"id": self.id, "object": "text_completion", "created": self.created,
                    "model": self.model, "choices": [], "usage": self.usage}
            out.append(Sse(None, json.dumps(body)))
        return out

    def result(self) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": self.text,
                             "logprobs": self._logprobs(range(self._answer_tokens())),
                             "finish_reason": self.finish_reason}],
                "usage": self.usage}

    def error(self, err: ApiError) -> Sse:
        return Sse(None, json.dumps(err.body("openai")))

    def done_data(self) -> str | None:
        return "[DONE]"

    def close(self) -> None:
        pass
