"""A generation session: one sequence's state, chunked prefill and the plain decode loop.

Prefill runs the prompt in bounded chunks (each a forward at the state's position) so
activation memory does not grow with the prompt; decode feeds one sampled token per forward.
The token picked at position p is `sample(logits of row p-1, p, params)`.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass

import torch

from strata.current_device import download, upload
from strata.errors import StrataError
from strata.model.model import Model
from strata.runtime.constraint import Constraint
from strata.runtime.graphs import GraphedForward
from strata.runtime.sampling import Logprobs, SamplingParams, sample
from strata.runtime.speculative import DraftOverride, DSparkDecoder, SpecConfig, SpecStats
from strata.runtime.state import State


# The graphed plain loop launches each step before it reads the token the step consumes
# (Session._plain_ahead); environment STRATA_RUN_AHEAD=0: off (the same tokens), for A/B.
RUN_AHEAD = os.environ.get("STRATA_RUN_AHEAD", "1") != "0"


@dataclass
class GenerationResult:
    tokens: list[int]
    finish_reason: str  # "stop" (a stop token) or "length"
    prompt_tokens: int


# Rows a prefill forward takes at once. Bigger chunks amortise decoding each routed expert over
# more of its rows (a 4,096-row chunk gives each of the 384 experts ~64): on one H200 a 32K
# prompt prefills at ~3,100 tok/s in 512-row chunks, ~11,000 in 2,048 and ~14,500 in 4,096 —
# bench/results/performance.md, session 32. A 4,096-row chunk's scratch (~1.9 GiB on a device)
# fits the memory plan's 4 GiB per-device reserve. 8,192 rows prefill ~5 % faster (session 57)
# but need ~3.9 GiB above the model, past that reserve beside the CUDA context and graphs:
# `--prefill-chunk auto` (runtime/chunk_size.py) measures whether a device has the room.
PREFILL_CHUNK = 4096


class Session:
    def __init__(self, model: Model, capacity: int, prefill_chunk: int = PREFILL_CHUNK,
                 speculative: SpecConfig | None = None, draft_override: DraftOverride | None = None,
                 costs: tuple[list[float], float] | None = None,
                 state: State | None = None, decoder_skip: bool = False,
                 graphs: bool = False) -> None:
        """`speculative` enables DSpark: the state then also keeps the draft stages' windows
        of every committed row (prefill included), and generate() can run mode 'dspark'.
        `costs` = (seconds per verify window of 1.. rows, seconds per draft) for the adaptive
        length (strata.runtime.speculative.measure_costs).
        `state`: continue an existing state (the server's prefix reuse) instead of a new one.
        `decoder_skip`: prefill with the decoder layers run only on the rows near the
        prompt's end (prefill; exact, and its window rings hold what a full prefill's would).
        `graphs`: decode steps, verify windows and DSpark drafts replay CUDA graphs
        (runtime/graphs.py; the same tokens)."""
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be ≥ 1")
        if speculative is not None and model.dspark is None:
            raise StrataError("speculative decoding needs a model with DSpark stages (mtp.*)")
        self.model = model
        self.state: State = state if state is not None else model.new_state(capacity)
        self.prefill_chunk = prefill_chunk
        self.speculative = speculative
        self.draft_override = draft_override
        self.costs = costs
        self.decoder_skip = decoder_skip
        self.stats: SpecStats | None = None  # of the last dspark generation
        self.graphed = model.graphed(self.state) if graphs else None

    @property
    def position(self) -> int:
        return self.state.position

    def prefill(self, tokens: torch.Tensor, rows_after: int = 0) -> torch.Tensor | None:
        """Consume tokens in chunks; return the last row's logits [V] fp32 (None where the
        decoder skip's last layer does not run that row: a window ring's rows or more before
        the prompt's end, `rows_after` counted).

        With `decoder_skip`, the decoder layers run only the rows near the prompt's end
        (Model.forward's decoder_from, the prompt's end minus `model.prefill_reach`): the
        same logits and the same state for everything that follows, at about half the work
        of a long prompt. `rows_after`: prompt tokens that later calls will prefill (a caller
        feeding a prompt in pieces), so the reach is counted from the prompt's real end.

        Truncating into the rows the decoder skipped is refused by State.can_truncate (its
        window rings do not hold them), so prefix reuse falls back to a bookmark there,
        exactly as it should."""
        tokens = tokens.view(-1)
        n = tokens.numel()
        self.state.check_room(n)
        model, decoder_from = self.model, None
        if self.decoder_skip and getattr(model, "decoder_start", None) is not None:
            decoder_from = self.state.position + n + rows_after - model.prefill_reach
        last = None
        for i in range(0, n, self.prefill_chunk):
            chunk = tokens[i:i + self.prefill_chunk]
            start, T = self.state.position, chunk.numel()
            runs_last = decoder_from is None or \
                model.rows_from(model.cfg.n_layers - 1, start, T, decoder_from) < T
            want = "last" if i + T == n and runs_last else "none"
            last, ctx = model.forward(chunk, self.state, logits=want, decoder_from=decoder_from)
            # The draft windows: the rows whose taps every target layer made (all of them
            # but in the decoder skip, which keeps more than a window's).
            if self.speculative is not None:
                hidden = model.dspark.main_hidden(ctx)
                if hidden.shape[0]:
                    model.dspark.commit_context(hidden, start + T - hidden.shape[0],
                                                self.state, model.numerics)
        return None if last is None else last[0]

    def generate(self, prompt: torch.Tensor | list[int], max_tokens: int,
                 params: SamplingParams = SamplingParams(),
                 stop_ids: frozenset[int] | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 mode: str | None = None,
                 scripted: Sequence[int] | None = None,
                 logprobs: Logprobs | None = None,
                 constraint: Constraint | None = None) -> Iterator[int]:
        """Yield up to max_tokens sampled tokens after the prompt (stops after a stop id).

        mode 'plain' runs one forward per token; 'dspark' (the default when the session is
        speculative) verifies drafted blocks — the tokens are the same either way.
        `scripted` is a test hook (plain mode only): the i-th token is scripted[i] instead of
        the sampled one while the script lasts; the model still runs every forward, on the
        scripted tokens. `logprobs`: each token's figures appended before it is yielded (the
        plain steps then do not run ahead of the host: each reads its own logits).
        `constraint`: each pick among the tokens it allows (constraint.Constraint), advanced
        with each token picked — the mask computed on the host while the step or window runs
        (so plain steps do not run ahead); the same tokens in either mode.
        """
        mode = mode or ("dspark" if self.speculative is not None else "plain")
        if mode not in ("plain", "dspark"):
            raise StrataError(f"decode mode {mode!r}: expected 'plain' or 'dspark'")
        if mode == "dspark" and self.speculative is None:
            raise StrataError("mode 'dspark' needs a session created with speculative=SpecConfig()")
        if scripted is not None and mode != "plain":
            raise StrataError("scripted tokens need mode 'plain'")
        prompt = torch.as_tensor(prompt, dtype=torch.long).view(-1)
        cfg = self.model.cfg
        stop_ids = frozenset({cfg.eos_token_id}) if stop_ids is None else stop_ids
        self.state.check_room(prompt.numel() + max(max_tokens - 1, 0))
        logits = self.prefill(prompt)
        tok = self._pick(logits, params, scripted, 0, logprobs, constraint)
        if mode == "dspark":
            decoder = DSparkDecoder(self, self.speculative, self.draft_override,
                                    *(self.costs or (None, 0.0)))
            self.stats = decoder.stats
        ahead = self._runs_ahead(scripted) and logprobs is None and constraint is None
        emitted = 0
        while True:
            # The next forward consumes tok: its Engram rows start reading from disk while
            # the caller handles the token (detokenize, stream).
            step = torch.tensor([tok])
            self.model.prefetch_engram(step, self.state)
            yield tok
            emitted += 1
            if tok in stop_ids or emitted >= max_tokens or (should_stop and should_stop()):
                return
            # plain steps: all of a plain request's, a DSpark decoder's plain run
            plain = max_tokens - emitted if mode == "plain" else decoder.plain_run()
            if plain and ahead:
                n = min(plain, max_tokens - emitted)
                if mode == "dspark":
                    decoder.took_plain(n)
                tok = yield from self._plain_ahead(tok, params, n, stop_ids, should_stop,
                                                   self.stats if mode == "dspark" else None)
                if tok is None:  # (a stop among the run's tokens)
                    return
                emitted += n - 1
                continue
            if mode == "plain":
                start = self.state.position
                logits, ctx = self.forward(step, "last")
                if self.speculative is not None:  # keep the draft windows complete
                    self.commit_context(ctx, 1, start)
                tok = self._pick(logits, params, scripted, emitted, logprobs, constraint)
                continue
            more = decoder.step(tok, params, max_tokens - emitted, logprobs, constraint)
            for t in more[:-1]:
                yield t
                emitted += 1
                if t in stop_ids or (should_stop and should_stop()):
                    return
            tok = more[-1]

    def forwards_device_tokens(self) -> bool:
        """Whether a forward can be launched on tokens the host has not read (on the device:
        StaticStep.prepare): graphed on one device (a group's graphs run through its
        driver), and on a GPU the Engram ids hashed there — or the tables on disk, whose
        reads wait for the tokens' host copy only before the first Engram layer
        (GraphedForward.launch)."""
        m = self.model
        return (type(self.graphed) is GraphedForward
                and (m.device.type == "cpu" or m.hasher is None or m.hashes_on_device
                     or bool(m.engram_stores)))

    def _runs_ahead(self, scripted: Sequence[int] | None) -> bool:
        """Whether plain steps run a step ahead of the host (`_plain_ahead`): no script, and
        forwards on device tokens (`forwards_device_tokens`) from graphs usable now."""
        return (RUN_AHEAD and scripted is None and self.forwards_device_tokens()
                and self.graphed.usable())

    def _plain_ahead(self, first: int, params: SamplingParams, steps: int,
                     stop_ids: frozenset[int], should_stop: Callable[[], bool] | None,
                     stats: SpecStats | None = None) -> Generator[int, None, int | None]:
        """`steps` plain forwards from the token `first` (at the state's position, already
        handed to the caller), each launched before the host reads the token it consumes:
        yields the tokens the forwards sample but the last, which it returns unconsumed —
        None when a stop ended the run (a stop id yielded, or should_stop).

        Each forward after the first is launched on the token its predecessor's sampler left
        on the device; that token's copy to the host is queued before the forward, so reading
        it waits only for the forward before, and the host handles it (yield, stop checks)
        while the GPU runs the forward that consumes it — on a graphed GPU step the host's
        ~0.5 ms between steps was GPU idle time (scripts/probe_host.py). With the Engram
        tables on disk the host reads the token inside the launch, after the parts before
        the first Engram layer, to hash it and read its rows (GraphedForward.launch). A
        DSpark session's
        draft windows are committed behind each forward (a graph replay on its taps). A stop
        abandons the forward already launched: the state is not advanced, and its writes lie
        at the state's position, where the next forward rewrites them — ring rows tagged with
        that position (the row each evicts is older than any window reaches: the rings keep
        spare rows for verify windows) and cache entries past the committed ones (tests: the
        same tokens, live state and next turn as the eager loop's). `stats`: a DSpark
        generation's, counting the forwards as plain steps."""
        g, state = self.graphed, self.state
        dev, read, tok = None, None, first
        for i in range(steps):
            if dev is not None:
                wait = download(dev)  # (queued before the forward that consumes it)
                read = functools.cache(lambda wait=wait: torch.tensor([int(wait()[0])]))
            P = state.position
            c, ctx = g.launch(torch.tensor([tok]) if dev is None else dev, "last", read)
            if self.speculative is not None:  # keep the draft windows complete
                g.commit_context(c.step.ctx, 1, P)
            if stats is not None:
                stats.plain_steps += 1
            dev = self._sample_at(c.step.logits.view(1, -1), P + 1, params)
            if i:
                tok = int(read()[0])  # (with disk tables, read already by the launch)
                yield tok
                if tok in stop_ids or (should_stop and should_stop()):
                    return None
            c.step.finish(ctx, torch.tensor([tok]))
        return int(dev[0])

    def _sample_at(self, logits: torch.Tensor, position: int,
                   params: SamplingParams) -> torch.Tensor:
        """sample() of one row at `position`, left on the device (the position uploaded
        through pinned memory: a pageable upload would wait for the queued step)."""
        return sample(logits, upload(torch.tensor([position]), logits.device), params)

    def forward(self, tokens: torch.Tensor, logits: str,
                host_tokens: Callable[[], torch.Tensor] | None = None):
        """A decode-time forward on the session's state (a step, a verify window): replayed
        from a CUDA graph when the session has them, else Model.forward. `tokens` on the
        device (`forwards_device_tokens`): `host_tokens()` gives their host copy, called
        once the forward is launched."""
        if self.graphed is not None:
            return self.graphed.forward(tokens, logits, host_tokens)
        return self.model.forward(tokens if host_tokens is None else host_tokens(), self.state,
                                  logits=logits)

    def commit_context(self, ctx, rows: int, start: int) -> None:
        """The draft windows for the first `rows` rows of a decode-time forward (`ctx`, from
        `forward`) at positions start..: replayed from a CUDA graph when the session has
        them, else DSparkHead.commit_context."""
        if self.graphed is not None:
            self.graphed.commit_context(ctx, rows, start)
            return
        dspark = self.model.dspark
        dspark.commit_context(dspark.main_hidden(ctx)[:rows], start, self.state,
                              self.model.numerics)

    def _pick(self, logits: torch.Tensor, params: SamplingParams,
              scripted: Sequence[int] | None, i: int, logprobs: Logprobs | None,
              constraint: Constraint | None = None) -> int:
        """The i-th token, at the state's position: sampled (among the tokens `constraint`
        allows), or the test script's; its figures added to `logprobs`."""
        if scripted is not None and i < len(scripted):
            tok = int(scripted[i])
        else:
            allowed = logits if constraint is None else constraint.mask(logits)
            tok = int(sample(allowed.view(1, -1), torch.tensor([self.state.position]),
                             params)[0])
        if constraint is not None:
            constraint.advance(tok)
        if logprobs is not None:
            logprobs.add(logits, [tok])
        return tok

    def run(self, prompt: torch.Tensor | list[int], max_tokens: int,
            params: SamplingParams = SamplingParams(),
            stop_ids: frozenset[int] | None = None, mode: str | None = None) -> GenerationResult:
        n_prompt = torch.as_tensor(prompt).numel()
        out = list(self.generate(prompt, max_tokens, params, stop_ids, mode=mode))
        stops = frozenset({self.model.cfg.eos_token_id}) if stop_ids is None else stop_ids
        reason = "stop" if out and out[-1] in stops else "length"
        return GenerationResult(out, reason, n_prompt)
