"""Long-context passkey retrieval: the harness users run on real weights.

A five-digit pass key is stated near the start of a long user message (at `depth`, the
fraction of the filler before it), repetitive filler follows up to the target length, and the
message ends by asking for the key. The prompt is rendered with the V4.1 chat format
(non-thinking), prefilled in bounded chunks, and a short greedy answer is decoded; the run
passes when the key's digits appear in the answer. Each length reports the prompt's exact
token count, prefill and decode tok/s, and peak host RSS and device memory, so the same run
shows whether a context length fits the memory plan and how fast it prefills.

On the random-weight fixtures the answers are noise (retrieval fails by construction); the
harness itself — exact lengths, key placement, chunked prefill, reporting — is what CI tests.
"""
from __future__ import annotations

import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from strata.bench.memory import proc_status
from strata.errors import StrataError

INTRO = ("There is an important pass key hidden inside a lot of irrelevant text. Find it and "
         "memorize it; I will ask you for it at the end.\n\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "\n\nWhat is the pass key? Answer with the five digits only."


def key_sentence(key: str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key. "


def parse_length(text: str) -> int:
    """'32K' → 32768, '524288' → 524288 (K = 1024, M = 1048576)."""
    t = text.strip().upper()
    mult = 1
    if t.endswith("K"):
        mult, t = 1024, t[:-1]
    elif t.endswith("M"):
        mult, t = 1 << 20, t[:-1]
    try:
        n = int(t) * mult
    except ValueError:
        raise StrataError(f"context length {text!r}: expected a number with an optional K or M "
                         "suffix (e.g. 32K)") from None
    if n <= 0:
        raise StrataError(f"context length {text!r} must be positive")
    return n


class PromptBuilder:
    """Renders passkey prompts of a requested token length with the V4.1 chat format."""

    def __init__(self, tokenizer_json: str | Path) -> None:
        import deepseek_recipe as dr
        self._dr = dr
        self._tok = dr.Tokenizer.from_file(str(tokenizer_json))
        self._enc = dr.DeepseekV41Encoding().with_tokenizer(self._tok)

    def render(self, text: str) -> list[int]:
        dr = self._dr
        conv = dr.Conversation([dr.UserMessage(text)], thinking_mode=False)
        return list(self._enc.encode(conv))

    def text(self, reps: int, key: str, depth: float) -> str:
        before = int(round(reps * depth))
        return INTRO + FILLER * before + key_sentence(key) + FILLER * (reps - before) + QUESTION

    def build(self, n_tokens: int, key: str, depth: float = 0.0) -> list[int]:
        """The longest prompt with at most n_tokens tokens (filler repeated whole)."""
        if not 0.0 <= depth <= 1.0:
            raise StrataError(f"depth {depth}: expected a fraction in 0..1")
        base = len(self.render(self.text(0, key, depth)))
        if base > n_tokens:
            raise StrataError(f"a passkey prompt needs at least {base} tokens; {n_tokens} asked")
        unit = len(self.render(self.text(64, key, depth))) - base
        reps = max(0, (n_tokens - base) * 64 // unit)
        tokens = self.render(self.text(reps, key, depth))
        while len(tokens) > n_tokens and reps > 0:  # tokenization is not exactly additive
            reps -= 1
            tokens = self.render(self.text(reps, key, depth))
        return tokens


def found_key(answer: str, key: str) -> bool:
    return key in re.sub(r"\D", "", answer) if answer else False


@dataclass
class PasskeyResult:
    target_tokens: int
    prompt_tokens: int
    key: str
    depth: float
    answer: str
    found: bool
    prefill_s: float
    prefill_tok_per_s: float
    decode_tok_per_s: float
    peak_rss_bytes: int
    peak_device_bytes: int | None


def run_passkey(model, tokenizer_json: str | Path, lengths: list[int], depth: float = 0.0,
                chunk: int | None = None, max_tokens: int = 16,
                seed: int = 0) -> list[PasskeyResult]:
    from strata.runtime.session import PREFILL_CHUNK, Session
    from strata.tokenizer import load_tokenizer
    builder = PromptBuilder(tokenizer_json)
    tok = load_tokenizer(Path(tokenizer_json).parent)
    rng = random.Random(seed)
    dev = model.device
    results = []
    for n in lengths:
        key = f"{rng.randrange(10000, 100000)}"
        prompt = builder.build(n, key, depth)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        # The state is not reused after the answer: the exact decoder-skipping prefill applies.
        session = Session(model, len(prompt) + max_tokens,
                          prefill_chunk=PREFILL_CHUNK if chunk is None else chunk,
                          decoder_skip=True)
        out, t0 = [], time.perf_counter()
        t_first = None
        for t in session.generate(prompt, max_tokens):  # greedy (temperature 0)
            if t_first is None:
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t_first = time.perf_counter()
            out.append(t)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t_end = time.perf_counter()
        prefill_s = t_first - t0
        answer = tok.decode(out, skip_special_tokens=True)
        results.append(PasskeyResult(
            target_tokens=n, prompt_tokens=len(prompt), key=key, depth=depth, answer=answer,
            found=found_key(answer, key), prefill_s=prefill_s,
            prefill_tok_per_s=len(prompt) / prefill_s,
            decode_tok_per_s=(len(out) - 1) / (t_end - t_first) if len(out) > 1 else 0.0,
            peak_rss_bytes=proc_status("VmHWM"),
            peak_device_bytes=torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None))
        del session
    return results


def report(results: list[PasskeyResult]) -> str:
    lines = ["| target | prompt tokens | found | prefill tok/s | decode tok/s | peak RSS GiB | "
             "peak device GiB | answer |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        dev = f"{r.peak_device_bytes / 2**30:.2f}" if r.peak_device_bytes is not None else "-"
        lines.append(f"| {r.target_tokens} | {r.prompt_tokens} | {'yes' if r.found else 'no'} | "
                     f"{r.prefill_tok_per_s:.1f} | {r.decode_tok_per_s:.1f} | "
                     f"{r.peak_rss_bytes / 2**30:.2f} | {dev} | {r.answer[:40]!r} |")
    return "\n".join(lines)


def as_json(results: list[PasskeyResult]) -> list[dict]:
    return [asdict(r) for r in results]
