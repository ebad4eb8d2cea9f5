"""Re-rendering assistant tool-call turns exactly as the model produced them.

A coding agent sends every tool-call turn back in its next request. deepseek-recipe renders
that turn again from its parts — reasoning (often dropped by clients), content and the tool
calls' JSON arguments (often re-serialised) — and the model's own tokens need not be the
canonical encoding of the text anyway. Any difference makes the prefix cache miss from that
turn on. So the server remembers each finished tool-call turn by its tool-call ids, with the
prompt it was generated from (length + digest) and the tokens emitted; when a request carries
the same calls back (same ids, names and argument values), the span the recipe rendered for
that turn — from the end of the original prompt to the turn's end-of-sentence token — is
replaced by the emitted tokens.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import deepseek_recipe as dr

from strata.serve.protocols import TurnOut, arguments


def digest(ids: Sequence[int]) -> bytes:
    return hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).digest()


@dataclass(frozen=True)
class EmittedTurn:
    prompt_len: int
    prompt_digest: bytes
    tokens: tuple[int, ...]  # as the model emitted them, ending with end-of-sentence
    turn: TurnOut


class ToolTurns:
    """Emitted tool-call turns by tool-call id (least recently stored first out)."""

    def __init__(self, eos_id: int, max_turns: int = 1024) -> None:
        self.eos_id = eos_id
        self.max_turns = max_turns
        self._by_id: OrderedDict[str, EmittedTurn] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_id)

    def remember(self, prompt: Sequence[int], emitted: Sequence[int], turn: TurnOut) -> None:
        """Keep a finished turn that made tool calls and ended with end-of-sentence."""
        if not turn.tool_calls or not emitted or emitted[-1] != self.eos_id:
            return
        entry = EmittedTurn(len(prompt), digest(prompt), tuple(emitted), turn)
        for call in turn.tool_calls:
            self._by_id[call.id] = entry
            self._by_id.move_to_end(call.id)
        while len(self._by_id) > self.max_turns:
            self._by_id.popitem(last=False)

    def apply(self, conversation: dr.Conversation, ids: list[int]) -> tuple[list[int], int]:
        """`ids` (the recipe's encoding of `conversation`) with every known tool-call turn
        replaced by the tokens the model emitted; also how many turns were replaced."""
        found = [t for m in conversation.messages if m.role == "assistant" and m.tool_calls
                 for t in [self._match(m)] if t is not None]
        replaced = 0
        # Earliest first: once a turn is substituted, the prompts of later turns match too.
        for t in sorted(found, key=lambda t: t.prompt_len):
            n = t.prompt_len
            if len(ids) <= n or digest(ids[:n]) != t.prompt_digest:
                continue
            try:
                end = ids.index(self.eos_id, n)
            except ValueError:
                continue
            if ids[n:end + 1] != list(t.tokens):
                ids = ids[:n] + list(t.tokens) + ids[end + 1:]
                replaced += 1
        return ids, replaced

    def _match(self, msg: dr.Message) -> EmittedTurn | None:
        """The stored turn this assistant message repeats, if it says the same thing."""
        calls = msg.tool_calls or []
        t = self._by_id.get(calls[0].id)
        if t is None or len(calls) != len(t.turn.tool_calls):
            return None
        for c, o in zip(calls, t.turn.tool_calls):
            if c.id != o.id or c.name != o.name:
                return None
            if arguments(c.arguments) != o.arguments:  # (values, whatever the spelling)
                return None
        # Clients commonly drop the reasoning and may drop the text; anything else they
        # send must be what the model said.
        if (msg.content or "").strip() not in ("", t.turn.content.strip()):
            return None
        if (msg.reasoning_content or "").strip() not in ("", t.turn.reasoning.strip()):
            return None
        return t
