"""`strata bench decode`: the decode benchmark protocol users quote.

A fixed coding prompt (one user turn, "Write a thread-safe LRU cache in Python.", rendered in
V4.1 thinking mode by deepseek-recipe) is fed as tokens; prefill is excluded from decode time
(the clock starts when the first generated token is known); greedy; 96 tokens; 1 warm-up and
3 measured runs per mode, median reported. Modes:
- plain:  one forward per token;
- dspark: drafts from the DSpark head, one verify forward per window;
- oracle: drafts taken from the plain run's own continuation — full acceptance, so the verify
          machinery's cost is measured without a trained draft head.
The first 96 tokens must be identical across modes; otherwise the benchmark fails.
"""
from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from strata.errors import StrataError
from strata.runtime.constraint import Grammars, grammar, json_answer
from strata.runtime.sampling import SamplingParams
from strata.runtime.session import Session
from strata.runtime.speculative import SpecConfig, measure_costs

PROMPT = "Write a thread-safe LRU cache in Python."
# and "oracle:X": X committed tokens per window, "oracle:pP": each draft accepted with
# probability P; a DSpark or oracle mode + "@L": L drafts a window (else the run's --length);
# any mode + "+graphs": its forwards replayed from CUDA graphs (runtime/graphs.py), the
# captures' time not counted in tok/s (reported as capture_s); + "+json" (before "+graphs"):
# every pick held to a JSON-object grammar (runtime/constraint.py: the cost of a response
# format), its tokens checked against plain decoding's under the same grammar.
# E.g. "oracle:p0.7@2+graphs", "dspark+json+graphs".
MODES = ("plain", "dspark", "oracle")
GRAPHS = "+graphs"
JSON = "+json"


@dataclass(frozen=True)
class ModeSpec:
    base: str            # plain, dspark, oracle, oracle:X or oracle:pP
    length: int | None   # "@L": drafts a window; None: the run's length
    graphs: bool
    json: bool = False   # "+json": picks held to a JSON-object grammar


def parse_mode(mode: str) -> ModeSpec:
    """A decode mode's parts (checked: a known base, a length of ≥ 0 drafts where drafts are
    made)."""
    graphs = mode.endswith(GRAPHS)
    rest = mode.removesuffix(GRAPHS)
    json_ = rest.endswith(JSON)
    base, at, drafts = rest.removesuffix(JSON).partition("@")
    if base not in MODES and not base.startswith("oracle:"):
        raise StrataError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}, oracle:X, "
                          f"oracle:pP, each alone or with @L drafts a window, then {JSON} "
                          f"and/or {GRAPHS}")
    length = None
    if at:
        if base == "plain" or not drafts.isdigit():
            raise StrataError(f"mode {mode!r}: @L is a DSpark or oracle mode's number of "
                              "drafts a window (0 or more)")
        length = int(drafts)
    return ModeSpec(base, length, graphs, json_)


def oracle_target(mode: str, length: int) -> tuple[str, float] | None:
    """'oracle' → None (accept every draft); 'oracle:2.9' → ("committed", 2.9): 2.9 committed
    tokens per window on average (accepted drafts + the target's own token), checked against
    1..length+1; 'oracle:p0.7' → ("accept", 0.7): each position's draft accepted with
    probability 0.7, a window committing its drafts up to the first rejected one."""
    if mode == "oracle":
        return None
    arg = mode.split(":", 1)[1] if ":" in mode else ""
    kind = "accept" if arg.startswith("p") else "committed"
    try:
        x = float(arg.removeprefix("p"))
    except ValueError:
        raise StrataError(f"mode {mode!r}: expected oracle:X with X committed per window, or "
                          "oracle:pP with each draft accepted with probability P") from None
    if kind == "committed" and not 1.0 <= x <= length + 1:
        raise StrataError(f"mode {mode!r}: X must be in 1..{length + 1} (accepted drafts + 1)")
    if kind == "accept" and not 0.0 <= x <= 1.0:
        raise StrataError(f"mode {mode!r}: P must be in 0..1")
    return kind, x


def oracle_length(model, length: int | None) -> int:
    """Drafts an oracle mode's window verifies: `length` (at most the head's block), or the
    block."""
    block = model.cfg.dspark_block_size
    return block if length is None else min(length, block)


def accepted_schedule(target: float, block: int):
    """Accepted drafts per window whose running mean tracks target - 1 (error diffusion):
    e.g. 2.9 → 2, 2, 2, 2, 2, 2, 2, 2, 2, 1, … (mean 1.9 accepted, 2.9 committed)."""
    k, done = 0, 0
    while True:
        k += 1
        a = min(block, max(0, round((target - 1) * k) - done))
        done += a
        yield a


def acceptable(p: float, n: int, seed: int = 0) -> list[bool]:
    """Whether the draft of each of n positions is accepted, each with probability p, from a
    fixed draw: every run and every verify length meets the same easy and hard tokens, as a
    trained draft head does in one text, so lengths compare on equal terms."""
    u = torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (u < p).tolist()


def prompt_tokens(tokenizer_json: Path) -> list[int]:
    import deepseek_recipe as dr
    conv = dr.Conversation([dr.UserMessage(PROMPT)], thinking_mode=True)
    tok = dr.Tokenizer.from_file(str(tokenizer_json))
    return list(dr.DeepseekV41Encoding().with_tokenizer(tok).encode(conv))


@dataclass
class ModeResult:
    mode: str
    tokens: list[int]
    tok_per_s: list[float]
    windows: int
    mean_committed: float
    accepted: int
    drafted: int
    draft_s: float
    verify_s: float
    capture_s: float = 0.0  # +graphs: warm-up and capture time in the last measured run
    # dspark with the adaptive length: the prices it chose by — ms of a window of 1, 2, …
    # rows, then of a draft (strata.runtime.speculative.measure_costs)
    window_ms: list[float] | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.tok_per_s)

    def as_dict(self) -> dict:
        return {"mode": self.mode, "median_tok_per_s": self.median, "runs_tok_per_s": self.tok_per_s,
                "windows": self.windows, "mean_committed_per_window": self.mean_committed,
                "accepted": self.accepted, "drafted": self.drafted,
                "draft_s": self.draft_s, "verify_s": self.verify_s,
                "capture_s": self.capture_s, "window_ms": self.window_ms}


def make_session(model, prompt: list[int], n: int, mode: str, reference: list[int] | None,
                 costs=None, length: int | None = None) -> Session:
    """The session a decode mode runs in (its graphs, speculative config and, for the oracle
    modes, drafts taken from `reference`, plain decoding's continuation of the prompt)."""
    ms = parse_mode(mode)
    mode, graphs = ms.base, ms.graphs
    length = ms.length if ms.length is not None else length
    plain = mode == "plain"
    spec = None if (plain or model.dspark is None) else SpecConfig(length=length)
    override = None
    if mode.startswith("oracle"):
        # Drafts = plain decoding's own continuation: all accepted, or one made wrong — with
        # "oracle:X" after a scheduled number of accepted ones, so verification commits X
        # tokens per window on average; with "oracle:pP" at the window's first position whose
        # draw rejects it (the tokens stay plain decoding's either way). Windows of `length`
        # drafts (the head's block without one).
        L = oracle_length(model, length)
        target = oracle_target(mode, L)
        schedule = accepted_schedule(target[1], L) \
            if target is not None and target[0] == "committed" else None
        accept = acceptable(target[1], n + L + 1) \
            if target is not None and target[0] == "accept" else None
        spec = SpecConfig(length=L, low_windows=10 ** 9)
        vocab = model.cfg.vocab_size

        def oracle_drafts(P, L):
            i = P - len(prompt)
            out = list(reference[i + 1:i + 1 + L])
            a = len(out)  # (the first rejected draft)
            if schedule is not None:
                a = next(schedule)
            elif accept is not None:
                a = next((j for j in range(len(out)) if not accept[i + 1 + j]), len(out))
            if a < len(out):
                out[a] = (out[a] + 1) % vocab  # differs from the target's pick: rejected
            return out
        override = oracle_drafts
    cap = len(prompt) + n + model.cfg.dspark_block_size + 2
    return Session(model, cap, speculative=spec, draft_override=override,
                   costs=costs if mode == "dspark" else None, graphs=graphs)


def _run_once(model, prompt: list[int], n: int, mode: str, reference: list[int] | None,
              costs, length: int | None,
              grammars: Grammars | None = None) -> tuple[list[int], float, Session]:
    ms = parse_mode(mode)
    graphs, plain = ms.graphs, ms.base == "plain"
    s = make_session(model, prompt, n, mode, reference, costs, length)
    gen = s.generate(prompt, n, SamplingParams(), stop_ids=frozenset(),
                     mode="plain" if plain else "dspark",
                     constraint=grammars.constraint(grammar(json_answer(None)))
                     if ms.json else None)
    out = [next(gen)]
    captured = s.graphed.capture_s if graphs else 0.0
    t0 = time.perf_counter()
    out.extend(gen)
    if s.state.device.type == "cuda":
        torch.cuda.synchronize(s.state.device)
    dt = time.perf_counter() - t0
    if graphs:  # steady state: a graph is captured once per shape and entry bucket
        dt -= s.graphed.capture_s - captured
    return out, (len(out) - 1) / dt, s


def bench_decode(model, prompt: list[int], modes: list[str], n: int = 96, runs: int = 3,
                 warmup: int = 1, length: int | None = None,
                 progress=None, before_run=None,
                 tokenizer_json: Path | None = None) -> dict[str, ModeResult]:
    """Every mode's tok/s over `runs` measured runs (after `warmup`), tokens checked equal to
    plain decoding's (a +json mode's: plain decoding's under the same grammar, compiled
    against `tokenizer_json`). `progress(text)`: called with a line per mode as soon as it is
    measured (a run cut short by a time limit keeps what it printed). `before_run()`: called
    before each of a mode's runs, warm-ups included (e.g. to start every run with cold
    caches)."""
    specs = {mode: parse_mode(mode) for mode in modes}
    grammars = None
    if any(ms.json for ms in specs.values()):
        if tokenizer_json is None:
            raise StrataError(f"a {JSON} mode needs the model's tokenizer")
        grammars = Grammars(Path(tokenizer_json).read_text(encoding="utf-8"),
                            model.cfg.vocab_size, [model.cfg.eos_token_id])
    for mode, ms in specs.items():
        if ms.base.startswith("oracle:"):
            oracle_target(ms.base, oracle_length(model, ms.length if ms.length is not None
                                                 else length))
        if ms.base != "plain" and model.dspark is None:
            raise StrataError(f"mode {mode} needs a model with DSpark stages")
    references = {False: _run_once(model, prompt, n, "plain", None, None, None)[0]}
    if grammars is not None:
        references[True] = _run_once(model, prompt, n, "plain" + JSON, None, None, None,
                                     grammars)[0]
    # the adaptive length's window prices, measured the way each adaptive mode runs them
    adaptive = {ms.graphs for ms in specs.values() if ms.base == "dspark"
                and ms.length is None and length is None}
    costs = {graphed: measure_costs(model, model.cfg.dspark_block_size + 1, graphs=graphed)
             for graphed in adaptive}
    results = {}
    for mode in modes:
        speeds, last = [], None
        reference = references[specs[mode].json]
        for i in range(warmup + runs):
            if before_run is not None:
                before_run()
            toks, rate, sess = _run_once(model, prompt, n, mode, reference,
                                         costs.get(specs[mode].graphs), length, grammars)
            if toks != reference:
                first = next(j for j, (a, b) in enumerate(zip(toks, reference)) if a != b)
                raise StrataError(f"mode {mode}: tokens differ from plain decoding at index "
                                  f"{first} ({toks[first]} vs {reference[first]})")
            if i >= warmup:
                speeds.append(rate)
                last = sess
        st = last.stats
        priced = last.costs  # (the adaptive length's window prices, if it had them)
        results[mode] = ModeResult(
            mode, reference, speeds, st.windows if st else 0,
            st.mean_committed if st else 1.0, st.accepted if st else 0, st.drafted if st else 0,
            st.draft_s if st else 0.0, st.verify_s if st else 0.0,
            last.graphed.capture_s if last.graphed is not None else 0.0,
            [1e3 * c for c in (*priced[0], priced[1])] if priced is not None else None)
        if progress is not None:
            r = results[mode]
            prices = "" if r.window_ms is None else (
                "; window ms by rows " + ", ".join(f"{v:.2f}" for v in r.window_ms[:-1])
                + f", draft {r.window_ms[-1]:.2f}")
            progress(f"measured {mode}: {r.median:.1f} tok/s (runs "
                     f"{', '.join(f'{v:.1f}' for v in speeds)}), {r.mean_committed:.2f} "
                     f"tokens per step{prices}")
    return results


def report(results: dict[str, ModeResult], prompt_len: int) -> str:
    lines = [f"prompt {prompt_len} tokens; greedy; {len(next(iter(results.values())).tokens)} "
             "tokens per run; median of the measured runs; tokens identical across modes",
             f"{'mode':<18}{'tok/s':>10}{'vs plain':>10}{'windows':>9}{'committed/win':>15}"
             f"{'accepted':>10}{'capture s':>11}"]
    base = results["plain"].median if "plain" in results else None
    by_grammar = {}  # (a +json mode's tokens are those of the others under the grammar)
    for r in results.values():
        by_grammar.setdefault(parse_mode(r.mode).json, r.tokens)
    lines[0] += " (sha256 " + ", ".join(
        ("+json " if json_ else "") + hashlib.sha256(str(by_grammar[json_]).encode())
        .hexdigest()[:12] for json_ in sorted(by_grammar)) + ")"
    for r in results.values():
        ratio = f"{r.median / base:.2f}x" if base else "-"
        cap = f"{r.capture_s:.2f}" if r.mode.endswith(GRAPHS) else "-"
        lines.append(f"{r.mode:<18}{r.median:>10.1f}{ratio:>10}{r.windows:>9}"
                     f"{r.mean_committed:>15.2f}{r.accepted:>6}/{r.drafted:<4}{cap:>11}")
    return "\n".join(lines)


def write_json(path: str | Path, results: dict[str, ModeResult], meta: dict) -> None:
    Path(path).write_text(json.dumps({"meta": meta, "results": [r.as_dict() for r in
                                                                 results.values()]}, indent=1))


def parallel_split(model, prompt: list[int], modes: list[str], n: int = 96,
                   length: int | None = None) -> dict[str, dict]:
    """Per decode step of a multi-device model (runtime/parallel.py), on every rank: forward
    time, time inside collectives and the rest (compute), collectives and bytes per forward.

    One extra run per mode with the device synchronised around each collective (so comm time
    is the collectives' own; this costs some overlap, so the tok/s here is below the measured
    runs'), counting from the first generated token (prefill excluded). In layer mode a rank's
    comm time includes waiting for the ranks before it. (Oracle, +graphs and +json modes are
    left out.)"""
    out = {}
    for mode in modes:
        ms = parse_mode(mode)
        if ms.base.startswith("oracle") or ms.graphs or ms.json:
            continue
        drafts = ms.length if ms.length is not None else length
        spec = None if ms.base == "plain" else SpecConfig(
            length=drafts if drafts is not None else model.cfg.dspark_block_size)
        cap = len(prompt) + n + model.cfg.dspark_block_size + 2
        s = Session(model, cap, speculative=spec)
        model.set_timing(True)
        try:
            gen = s.generate(prompt, n, SamplingParams(), stop_ids=frozenset(), mode=ms.base)
            next(gen)
            model.stats(reset=True)
            t0 = time.perf_counter()
            steps = sum(1 for _ in gen)
            wall = time.perf_counter() - t0
            ranks = model.stats(reset=True)
        finally:
            model.set_timing(False)
        rows = []
        for r in ranks:
            f = max(1.0, r["forwards"])
            rows.append({"rank": r["rank"], "forwards": int(r["forwards"]),
                         "forward_ms": 1e3 * r["forward_s"] / f,
                         "comm_ms": 1e3 * r["comm_s"] / f,
                         "compute_ms": 1e3 * (r["forward_s"] - r["comm_s"]) / f,
                         "collectives_per_forward": r["collectives"] / f,
                         "kib_per_forward": r["bytes"] / f / 1024})
        out[mode] = {"parallel": model.mode, "world": model.world, "tokens": steps,
                     "tok_per_s": steps / wall, "ranks": rows}
    return out


def split_report(split: dict[str, dict]) -> str:
    lines = ["per decode forward, timed run (device synchronised around each collective):",
             f"{'mode':<8}{'rank':>5}{'fwd ms':>9}{'compute':>9}{'comm':>8}{'colls':>7}"
             f"{'KiB':>9}{'tok/s':>9}"]
    for mode, m in split.items():
        for r in m["ranks"]:
            lines.append(f"{mode:<8}{r['rank']:>5}{r['forward_ms']:>9.2f}{r['compute_ms']:>9.2f}"
                         f"{r['comm_ms']:>8.2f}{r['collectives_per_forward']:>7.1f}"
                         f"{r['kib_per_forward']:>9.1f}{m['tok_per_s']:>9.1f}")
    return "\n".join(lines)
