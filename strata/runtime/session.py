"""A generation session: one sequence's state, chunked prefill and the plain decode loop.

Prefill runs the prompt in bounded chunks (each a forward at the state's position) so
activation memory does not grow with the prompt; decode feeds one sampled token per forward.
The token picked at position p is `sample(logits of row p-1, p, params)`.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from strata.model.model import Model
from strata.runtime.sampling import SamplingParams, sample
from strata.runtime.state import State


@dataclass
class GenerationResult:
    tokens: list[int]
    finish_reason: str  # "stop" (a stop token) or "length"
    prompt_tokens: int


class Session:
    def __init__(self, model: Model, capacity: int, prefill_chunk: int = 512) -> None:
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be ≥ 1")
        self.model = model
        self.state: State = model.new_state(capacity)
        self.prefill_chunk = prefill_chunk

    @property
    def position(self) -> int:
        return self.state.position

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """Consume tokens in chunks; return the last row's logits [V] fp32."""
        tokens = tokens.view(-1)
        self.state.check_room(tokens.numel())
        last = None
        for i in range(0, tokens.numel(), self.prefill_chunk):
            chunk = tokens[i:i + self.prefill_chunk]
            want = "last" if i + self.prefill_chunk >= tokens.numel() else "none"
            last, _ = self.model.forward(chunk, self.state, logits=want)
        return last[0]

    def generate(self, prompt: torch.Tensor | list[int], max_tokens: int,
                 params: SamplingParams = SamplingParams(),
                 stop_ids: frozenset[int] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> Iterator[int]:
        """Yield up to max_tokens sampled tokens after the prompt (stops after a stop id)."""
        prompt = torch.as_tensor(prompt, dtype=torch.long).view(-1)
        cfg = self.model.cfg
        stop_ids = frozenset({cfg.eos_token_id}) if stop_ids is None else stop_ids
        self.state.check_room(prompt.numel() + max(max_tokens - 1, 0))
        logits = self.prefill(prompt)
        for i in range(max_tokens):
            pos = torch.tensor([self.state.position], device=logits.device)
            tok = int(sample(logits[None], pos, params)[0])
            yield tok
            if tok in stop_ids or i == max_tokens - 1 or (should_stop and should_stop()):
                return
            logits, _ = self.model.forward(torch.tensor([tok]), self.state, logits="last")
            logits = logits[0]

    def run(self, prompt: torch.Tensor | list[int], max_tokens: int,
            params: SamplingParams = SamplingParams(),
            stop_ids: frozenset[int] | None = None) -> GenerationResult:
        n_prompt = torch.as_tensor(prompt).numel()
        out = list(self.generate(prompt, max_tokens, params, stop_ids))
        stops = frozenset({self.model.cfg.eos_token_id}) if stop_ids is None else stop_ids
        reason = "stop" if out and out[-1] in stops else "length"
        return GenerationResult(out, reason, n_prompt)
