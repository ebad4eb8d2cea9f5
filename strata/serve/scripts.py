"""Test hook: make the engine emit given outputs through the real decode path.

A random fixture model never writes a DSML tool call by itself, so tests (and the OpenCode end
to end run) give the server a list of rules; the first rule whose `match` string occurs in the
rendered prompt decides the request's output text, which is encoded with the tokenizer and fed
to the engine as `scripted` tokens: the model still runs every forward and the stream parser
sees real token ids. Off unless `strata serve --script FILE` (or `create_app(scripts=...)`).

FILE is JSON: [{"match": "<tool_result>", "text": "Done.<｜end▁of▁sentence｜>"}, ...];
`match` "" matches every prompt; `tokens` (ids) may replace `text`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import deepseek_recipe as dr

from strata.errors import ConfigError


@dataclass(frozen=True)
class ScriptRule:
    match: str
    tokens: tuple[int, ...]


class Scripts:
    def __init__(self, rules: list[dict], tokenizer: dr.Tokenizer) -> None:
        self.rules: list[ScriptRule] = []
        for i, r in enumerate(rules):
            if not isinstance(r, dict) or not isinstance(r.get("match"), str) \
                    or ("text" in r) == ("tokens" in r):
                raise ConfigError(f"script rule {i}: expected {{'match': str, and 'text': str "
                                  f"or 'tokens': [int]}}, got {r!r}")
            toks = r["tokens"] if "tokens" in r else tokenizer.encode(r["text"])
            self.rules.append(ScriptRule(r["match"], tuple(int(t) for t in toks)))

    def pick(self, prompt_text: str) -> tuple[int, ...] | None:
        for rule in self.rules:
            if rule.match in prompt_text:
                return rule.tokens
        return None


def load_rules(path: str | Path) -> list[dict]:
    try:
        rules = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"--script {path}: {e}") from None
    if not isinstance(rules, list):
        raise ConfigError(f"--script {path}: expected a JSON list of rules")
    return rules
