"""Constrained decoding: an answer held to a grammar — a JSON schema, a regular expression, or a
Lark grammar built from them — by masking, before each pick, every token that cannot continue it.

llguidance compiles the grammar against the tokenizer and, at each step, gives the tokens that
keep the text a prefix of some sentence of the grammar, as a bitmask over the vocabulary (the
EOS token allowed once the text is complete, and alone once nothing can follow). The sampler
then picks among those only, so the answer parses whatever the weights say; the reported
logprobs stay those of the model's own distribution (sampling.Logprobs).

A constraint can start after trigger tokens (`after`, e.g. `</think>`): the reasoning before
is free text, the answer after is held to the grammar. Its mask is computed on the host when
the pick asks for it — after the step's forward is launched, so it overlaps the GPU's work — and
a constrained generation picks each token on the host before the next step runs (no run-ahead).
A DSpark verify window masks each row as the grammar stands after the drafts before it
(`mask_window`), so the window accepts exactly the tokens plain constrained steps would pick.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from strata.errors import StrataError

# Whitespace the JSON grammar allows at each place JSON allows it: any, as JSON does, but at most
# this many characters in one place, so a model cannot loop on newlines forever; and before the
# value (a model may open its answer with a newline).
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{1,64}"
JSON_LEAD = r"[\x20\x0A\x0D\x09]{0,8}"


class GrammarError(StrataError):
    """A grammar (JSON schema, regex) that does not compile, or a text it cannot continue."""


# An answer: a Lark expression over the sub-grammar it names `answer`.
Answer = tuple[str, dict]
# What the model may write instead of the answer: a Lark expression and the rules it uses.
Alternative = tuple[str, str]


def json_answer(schema: dict | None) -> Answer:
    """JSON valid under `schema` (None: any JSON object)."""
    try:
        g = _llg().LLMatcher.grammar_from_json_schema(
            {"type": "object"} if schema is None else schema,
            overrides={"whitespace_pattern": JSON_WHITESPACE})
    except ValueError as e:
        raise GrammarError(f"invalid JSON schema: {e}") from None
    return f"/{JSON_LEAD}/ @answer", _named(g)


def regex_answer(regex: str) -> Answer:
    """Text matching `regex`, whole."""
    return "@answer", _named(_llg().LLMatcher.grammar_from_regex(regex))


def grammar(answer: Answer | None, other: Alternative | None = None) -> str:
    """The grammar of `answer`, or of `other` instead, or of either: a request offering tools
    and a response format gets the formatted answer or a tool-call block."""
    if answer is None and other is None:
        raise ValueError("a grammar needs an answer or an alternative")
    start = " | ".join(x[0] for x in (answer, other) if x is not None)
    lark = f"start: {start}\n" + (other[1] if other is not None else "")
    return json.dumps({"grammars": [{"lark_grammar": lark}]
                       + ([answer[1]] if answer is not None else [])})


def _named(grammar_json: str) -> dict:
    return dict(json.loads(grammar_json)["grammars"][0], name="answer")


def _llg():
    import llguidance  # (on first use: the engine and its benchmarks run without it)
    return llguidance


class Grammars:
    """Compiles grammars against one tokenizer and hands out a fresh Constraint per request.

    `tokenizer_json`: the tokenizer.json text the model's ids come from; `vocab_size`: the
    logits' width (ids past the tokenizer's are never allowed); `eos_ids`: what ends an answer.
    Building the tokenizer's index takes ~0.5 s (`vocabulary`); compiled grammars are kept
    (the last `keep`), so a client sending the same schema each turn compiles it once.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Iterable[int],
                 keep: int = 64) -> None:
        self._json, self.vocab_size, self.eos_ids = tokenizer_json, vocab_size, list(eos_ids)
        self.keep = keep
        self._tokenizer = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def vocabulary(self):
        """llguidance's index of the tokenizer (built once; a server builds it at start)."""
        with self._lock:
            if self._tokenizer is None:
                try:
                    self._tokenizer = _llg().LLTokenizer(self._json, n_vocab=self.vocab_size,
                                                         eos_token=self.eos_ids)
                except ValueError as e:  # (e.g. a model with fewer logits than the tokenizer)
                    raise GrammarError(f"the tokenizer cannot serve a grammar for this "
                                       f"model's {self.vocab_size} logits: {e}") from None
            return self._tokenizer

    def compile(self, grammar: str):
        """A pristine matcher of `grammar` (a copy of the kept one); GrammarError naming what
        does not compile."""
        vocabulary = self.vocabulary()
        with self._lock:
            matcher = self._compiled.get(grammar)
            if matcher is not None:
                self._compiled.move_to_end(grammar)
                return matcher.deep_copy()
            matcher = _llg().LLMatcher(vocabulary, grammar, log_level=0)
            if matcher.is_error():  # (e.g. JSON-schema keywords it does not implement)
                raise GrammarError(f"cannot be enforced: {matcher.get_error()}")
            self._compiled[grammar] = matcher
            if len(self._compiled) > self.keep:
                self._compiled.popitem(last=False)
            return matcher.deep_copy()

    def constraint(self, grammar: str, after: Sequence[Iterable[int]] = (),
                   prefix: Iterable[int] = ()) -> Constraint:
        """A request's constraint: active from the start, or once one token of each set in
        `after` has been picked, in order (e.g. `</think>`, then the token that opens a
        tool-call block); `prefix`: tokens of the answer the prompt already holds (a continued
        final message), consumed first — GrammarError if the grammar cannot start with them."""
        c = Constraint(self.compile(grammar), self.eos_ids, after)
        prefix = list(prefix)
        if prefix:
            if not c.active:
                raise GrammarError("a constraint that starts after a token cannot take a prefix")
            if not c.matcher.consume_tokens(prefix):
                raise GrammarError("the answer's given start does not fit the response format: "
                                   + c.matcher.get_error())
        return c


class Constraint:
    """One generation's grammar state: `mask` before a pick (or `mask_window` before a DSpark
    window's picks), `advance` with each token picked."""

    def __init__(self, matcher, eos_ids: Iterable[int],
                 after: Sequence[Iterable[int]] = ()) -> None:
        self.matcher, self.eos_ids = matcher, frozenset(eos_ids)
        self.waiting = [frozenset(ids) for ids in after]  # triggers still to see, in order
        self.ended = False  # an EOS consumed: what follows (a window's rows) is no answer's

    @property
    def active(self) -> bool:
        return not self.waiting

    def _words(self) -> torch.Tensor | None:
        """The next token's bitmask (int32 words, on the host), None while waiting."""
        if self.waiting or self.ended:
            return None
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)
        if not bool(words.any()):
            raise GrammarError("the response format allows no next token: "
                               + (self.matcher.get_error() or "the grammar is exhausted"))
        return words

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [V] or [1, V] with every token the grammar does not allow next at -inf (a
        new tensor; the raw logits stay for logprobs)."""
        words = self._words()
        return logits if words is None else _masked(logits.view(1, -1), [words]).view_as(logits)

    def mask_window(self, logits: torch.Tensor, drafts: Sequence[int]) -> torch.Tensor:
        """A verify window's logits [L+1, V] masked row by row: row i as the grammar stands
        after drafts[:i] — up to the first draft it refuses, past which no row's pick can be
        accepted (rows after it are left as they are). The state is left as it was."""
        waiting, ended, consumed, rows = list(self.waiting), self.ended, 0, []
        try:
            for i in range(len(drafts) + 1):
                rows.append(self._words())
                if i == len(drafts):
                    break
                d = int(drafts[i])
                if self.waiting or self.ended:
                    self.advance(d)
                    continue
                if self.matcher.validate_tokens([d]) != 1 or not self.matcher.consume_token(d):
                    break
                consumed += 1
                self.ended = d in self.eos_ids
        finally:
            self.matcher.rollback(consumed)
            self.waiting, self.ended = waiting, ended
        return _masked(logits, rows)

    def advance(self, token: int) -> None:
        """The token picked: consumed by the grammar (or, before the constraint starts,
        checked for the next token it waits for; after an EOS, ignored: a window's rows
        past the end of the answer)."""
        if self.ended:
            return
        if self.waiting:
            if token in self.waiting[0]:
                self.waiting.pop(0)
            return
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} does not continue the response format: "
                               + self.matcher.get_error())
        self.ended = token in self.eos_ids


def _masked(logits: torch.Tensor, rows: list[torch.Tensor | None]) -> torch.Tensor:
    """logits [R, V] with row i's disallowed tokens at -inf where rows[i] holds a bitmask
    (None: the row as it is; rows past the list too). The bits travel to the device packed
    (16 KB a row at V4's vocabulary) and are unpacked there."""
    if all(w is None for w in rows):
        return logits
    dev, V = logits.device, logits.shape[-1]
    full = torch.full_like(next(w for w in rows if w is not None), -1)  # (all allowed)
    words = torch.stack([full if w is None else w for w in rows]).to(dev)
    shifts = torch.arange(32, dtype=torch.int32, device=dev)
    allowed = ((words[:, :, None] >> shifts) & 1).view(len(rows), -1)[:, :V].bool()
    out = logits.clone()
    out[:len(rows)].masked_fill_(~allowed, float("-inf"))
    return out
