"""DSpark speculative decoding: draft a block, verify it in one forward, commit the accepted
prefix and roll back the rest (issue 3; spec §2.11, dspark_engram.md §1.4).

One step, with the anchor a (sampled, not yet run) at position P:
  draft d1..dL for positions P+1..P+L                  (DSparkHead.draft)
  one main forward over [a, d1..dL] at P..P+L          (under state.begin())
  y_j = sample(row P+j, position P+j+1)   for j = 0..L (the target's own picks)
  accept d_{j+1} while it equals y_j; n = accepted count
  state.rollback(to=P+n+1)                              (keeps a and d1..dn, undoes the rest)
  write the draft windows for the n+1 committed rows    (from the verify forward's taps)
  emit d1..dn, y_n; the next anchor is y_n at P+n+1.

Sampling is a pure function of (seed, position, logits) and forwards are batch-invariant, so
the committed tokens are exactly the tokens plain decoding picks, at any temperature: the
draft only decides how many of them one forward yields. The draft picks with the same
position-keyed sampler, which couples it to the target's noise and raises acceptance.

Verification length: fixed, or adaptive — from the draft's confidences, the expected committed
tokens of each length are Σ_{i≤L} Π_{k≤i} c_k + 1, priced by a table of measured forward times
per window size; L = 0 means a plain step (its draft counted as a rejected one). Acceptance
below a floor for several windows switches to plain decoding for a while, then drafting is
tried again.
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from strata.current_device import download, made_current
from strata.errors import StrataError
from strata.model.dspark import Draft
from strata.runtime.constraint import Constraint
from strata.runtime.sampling import Logprobs, SamplingParams, sample

# (window position P, draft length L) -> the L drafts to verify instead of the head's (tests
# and the oracle benchmarks force accepts and rejects; the head still drafts, unread).
DraftOverride = Callable[[int, int], list[int]]

# A graphed session launches each window's draft as soon as the step before has committed
# (DSparkDecoder._draft_ahead); environment STRATA_DRAFT_AHEAD=0: off (the same tokens), for A/B.
DRAFT_AHEAD = os.environ.get("STRATA_DRAFT_AHEAD", "1") != "0"
# A window whose length needs no read of its draft (a fixed length) is launched on the draft's
# tokens on the device, read by the host while it runs (DSparkDecoder._step);
# environment STRATA_WINDOW_AHEAD=0: off (the same tokens), for A/B.
WINDOW_AHEAD = os.environ.get("STRATA_WINDOW_AHEAD", "1") != "0"


@dataclass(frozen=True)
class SpecConfig:
    length: int | None = None        # fixed verify length (drafts per window); None: adaptive
    low_acceptance: float = 0.2      # mean accepted/drafted below this ...
    low_windows: int = 8             # ... over this many windows switches to plain decoding
    plain_backoff: int = 16          # plain steps before drafting again, doubled each time
    max_plain_backoff: int = 1024    # the drafts are still not accepted, up to this
    probe_windows: int = 2           # windows after a plain run that judge the drafts again
                                     # (at most low_windows)

    def __post_init__(self) -> None:
        if self.length is not None and self.length < 0:
            raise StrataError(f"speculative length {self.length} must be ≥ 0")
        if (self.low_windows < 1 or self.probe_windows < 1
                or not 0 <= self.plain_backoff <= self.max_plain_backoff):
            raise StrataError(f"speculative fallback: low_windows {self.low_windows} and "
                              f"probe_windows {self.probe_windows} must be ≥ 1 and 0 ≤ "
                              f"plain_backoff {self.plain_backoff} ≤ max_plain_backoff "
                              f"{self.max_plain_backoff}")


@dataclass
class SpecStats:
    windows: int = 0                 # verify forwards
    committed: list[int] = field(default_factory=list)  # per window, incl. the y token
    drafted: int = 0
    accepted: int = 0
    plain_steps: int = 0
    backoffs: list[int] = field(default_factory=list)  # plain runs low acceptance began
    drafts: int = 0                  # drafts made (a window's, or one not worth verifying)
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def mean_committed(self) -> float:
        return sum(self.committed) / len(self.committed) if self.committed else 0.0

    def as_dict(self) -> dict:
        return {"windows": self.windows, "mean_committed_per_window": self.mean_committed,
                "drafted": self.drafted, "accepted": self.accepted,
                "plain_steps": self.plain_steps, "drafts": self.drafts,
                "draft_s": self.draft_s,
                "verify_s": self.verify_s}


def choose_length(confidence: Sequence[float] | torch.Tensor, costs: list[float],
                  draft_cost: float) -> int:
    """Verify length maximising expected committed tokens per second.

    costs[r] = seconds of a main forward over r+1 rows (r drafts); confidence[i] = P(draft i+1
    accepted | drafts 1..i were). L = 0 is a plain step (no draft cost counted: it is sunk
    either way once drafted, but a plain step is what we compare against).
    """
    best, best_rate = 0, 1.0 / costs[0]
    survive, expect = 1.0, 0.0
    for L in range(1, min(len(confidence), len(costs) - 1) + 1):
        survive *= float(confidence[L - 1])
        expect += survive
        rate = (1.0 + expect) / (costs[L] + draft_cost)
        if rate > best_rate:
            best, best_rate = L, rate
    return best


class DSparkDecoder:
    """Runs the speculative loop for a Session whose state tracks the draft context."""

    def __init__(self, session, config: SpecConfig, override: DraftOverride | None = None,
                 costs: list[float] | None = None, draft_cost: float = 0.0) -> None:
        model = session.model
        if model.dspark is None:
            raise StrataError("this model has no DSpark draft head (no mtp.* stages)")
        self.session, self.model, self.config, self.override = session, model, config, override
        self.costs, self.draft_cost = costs, draft_cost
        self.stats = SpecStats()
        self._recent: list[tuple[int, int]] = []  # (drafted, accepted) of recent windows
        self._plain_left = 0
        self._backoff = config.plain_backoff  # the next plain run's length
        self._probing = False  # after a plain run, until probe_windows windows pay
        # (anchor, position, sampler, draft) launched ahead for the next step (_draft_ahead,
        # _draft_behind)
        self._ahead: tuple[int, int, SamplingParams, Draft] | None = None

    def plain_run(self) -> int:
        """Plain steps the fallback has left to run (the session may run them a step ahead
        of the host: Session._plain_ahead, then `took_plain`)."""
        return self._plain_left

    def took_plain(self, n: int) -> None:
        self._plain_left = max(0, self._plain_left - n)

    def _length(self, confidence: torch.Tensor) -> int:
        g = self.model.cfg.dspark_block_size
        if self.config.length is not None:
            return min(self.config.length, g)
        if self.costs is None:
            return g
        # (read in one copy: choose_length reads an element a length, each a device sync)
        return choose_length(confidence.tolist(), self.costs, self.draft_cost)

    def _low_acceptance(self) -> bool:
        """Whether the recent windows (the last low_windows) accepted too few drafts."""
        drafted = sum(d for d, _ in self._recent)
        accepted = sum(a for _, a in self._recent)
        return drafted > 0 and accepted / drafted < self.config.low_acceptance

    def step(self, anchor: int, params: SamplingParams, budget: int,
             logprobs: Logprobs | None = None,
             constraint: Constraint | None = None) -> list[int]:
        """Advance from `anchor` (at state.position); return the tokens that follow it, the
        last of which is the next anchor. At most `budget` tokens are returned; their
        figures added to `logprobs` (from the rows that picked them); each picked among the
        tokens `constraint` allows (a window's rows masked as the grammar stands after the
        drafts before them) and advanced through it."""
        out = self._step(anchor, params, budget, logprobs, constraint)
        if constraint is not None:
            for t in out:
                constraint.advance(t)
        self._draft_ahead(out[-1], params, budget - len(out))
        return out

    def _launch_draft(self, anchor: int | torch.Tensor, params: SamplingParams,
                      position: torch.Tensor | None = None) -> Draft:
        """The draft from `anchor` at the state's position — or, graphed, from an anchor
        and `position` on the device ([1] each: `_draft_behind`)."""
        # (the anchor's Engram rows, which its window needs, are prefetched by
        # Session.generate as it hands the anchor over)
        s, model, state = self.session, self.model, self.session.state
        t0 = time.perf_counter()

        def pick(lg, positions):
            return sample(lg, positions, params)
        g = s.graphed
        draft = (g.draft(anchor, params, position) if g is not None and g.can_draft() else
                 model.dspark.draft(model.embed, model.head, anchor, state, model.numerics,
                                    pick))
        self.stats.draft_s += time.perf_counter() - t0
        return draft

    def _draft(self, anchor: int, params: SamplingParams) -> Draft:
        """The draft from `anchor` at the state's position: the one `_draft_ahead` launched
        for it, or one made now."""
        ahead, self._ahead = self._ahead, None
        self.stats.drafts += 1
        if ahead is not None and ahead[:2] == (anchor, self.session.state.position) \
                and ahead[2] is params:
            return ahead[3]
        return self._launch_draft(anchor, params)

    def _draft_ahead(self, anchor: int, params: SamplingParams, budget: int) -> None:
        """Launch the next step's draft now — its anchor and position are known once a step
        has committed — so the GPU drafts while the caller handles this step's tokens. A
        graphed draft only (an eager one is host work: it would only delay the tokens); not
        when the next step runs plain (the fallback's run, no budget left to draft for). The
        draft reads the state and writes nothing to it, so one the caller never uses (it
        stops) changes nothing. After a verify window `_draft_behind` has launched it
        already."""
        g, P = self.session.graphed, self.session.state.position
        if self._plain_left > 0 or budget <= 1:
            self._ahead = None  # (one launched behind a window the fallback follows)
        elif self._ahead is not None and self._ahead[:2] == (anchor, P):
            return
        elif DRAFT_AHEAD and g is not None and g.can_draft():
            self._ahead = (anchor, P, params, self._launch_draft(anchor, params))

    def _draft_behind(self, window: torch.Tensor, picks: torch.Tensor, P: int,
                      params: SamplingParams, budget: int) -> Draft | None:
        """The next step's draft, launched behind a verify window at P (its tokens
        `window` [L+1] and the target's `picks` [L+1], on the device) before the host reads
        the picks: its anchor — the pick after the accepted drafts — and position computed
        on the GPU, so the GPU goes from the window's commit to the draft while the host
        waits for the picks and then handles the window's tokens. Graphed drafts only; not
        where the window may use up the budget."""
        g = self.session.graphed
        L = window.numel() - 1
        if not (DRAFT_AHEAD and budget - (L + 1) > 1 and g is not None and g.can_draft()):
            return None
        with made_current(picks.device):  # (a tensor and a Python scalar: current_device.py)
            accepted = (window[1:] == picks[:L]).long().cumprod(0).sum().view(1)
            anchor, position = picks.gather(0, accepted), accepted + (P + 1)
        return self._launch_draft(anchor, params, position)

    def _step(self, anchor: int, params: SamplingParams, budget: int,
              logprobs: Logprobs | None, constraint: Constraint | None) -> list[int]:
        s, model, state = self.session, self.model, self.session.state
        P = state.position
        L, drafted, drafts = 0, False, []
        if self._plain_left > 0:
            self._plain_left -= 1
        elif budget > 1:
            drafted = True
            draft = self._draft(anchor, params)
            L = min(self._length(draft.confidence), budget - 1, state.capacity - P - 1)
            if self.override is not None:
                drafts = list(self.override(P, L))[:L]
                L = len(drafts)
        if L == 0:
            self.stats.plain_steps += 1
            if drafted:  # a draft not worth verifying counts as a rejected one, so steps
                # that keep paying for drafts they do not use fall back to plain decoding too
                self._note_window(1, 0)
            logits, ctx = s.forward(torch.tensor([anchor]), "all")
            s.commit_context(ctx, 1, P)
            allowed = logits if constraint is None else constraint.mask(logits)
            tok = int(sample(allowed, torch.tensor([P + 1]), params)[0])
            if logprobs is not None:
                logprobs.add(logits, [tok])
            return [tok]

        t0 = time.perf_counter()
        host_tokens = None
        if self.override is None and WINDOW_AHEAD and s.forwards_device_tokens():
            # On the draft's tokens where they are, the window queued behind the draft: the
            # host prepares and launches it while the GPU drafts, and reads the drafts (their
            # copy queued before the window, so the read waits for the draft alone) once the
            # window is launched.
            read = download(draft.tokens[:L])
            with made_current(draft.tokens.device):
                window = torch.cat((torch.full((1,), anchor, dtype=torch.long,
                                               device=draft.tokens.device), draft.tokens[:L]))

            def host_tokens() -> torch.Tensor:
                drafts.extend(read().tolist())
                return torch.tensor([anchor] + drafts)
        else:
            if self.override is None:
                drafts = draft.tokens[:L].tolist()
            window = torch.tensor([anchor] + drafts)
            model.prefetch_engram(window, state)  # the drafts' rows, as soon as they are known
        state.begin()
        try:  # (a failure anywhere before the rollback below leaves the state at P)
            logits, ctx = s.forward(window, "all", host_tokens)
            # (the drafts are on the host by now: host_tokens ran inside the launch)
            allowed = logits if constraint is None else constraint.mask_window(logits, drafts)
            picks_dev = sample(allowed, torch.arange(P + 1, P + L + 2, device=logits.device),
                               params)
            read_picks = download(picks_dev)
            # Every row's draft windows, launched before the host reads the picks (the GPU
            # commits while the host waits for them): the rows past the accepted ones lie at
            # positions from the next anchor's on, which a draft does not read (DSparkHead:
            # tags below its position), until the commit of those positions rewrites them.
            s.commit_context(ctx, L + 1, P)
            behind = self._draft_behind(ctx.device_tokens, picks_dev, P, params, budget)
            picks = read_picks().tolist()
            n = 0
            while n < L and drafts[n] == picks[n]:
                n += 1
            if logprobs is not None:  # (before the next replay reuses the logits' buffer)
                logprobs.add(logits[:n + 1], drafts[:n] + [picks[n]])
        except BaseException:
            state.rollback()
            raise
        state.rollback(to=P + n + 1)
        if behind is not None:
            self._ahead = (picks[n], P + n + 1, params, behind)
        self.stats.verify_s += time.perf_counter() - t0
        self.stats.windows += 1
        self.stats.committed.append(n + 1)
        self.stats.drafted += L
        self.stats.accepted += n
        self._note_window(L, n)
        return drafts[:n] + [picks[n]]

    def _note_window(self, drafted: int, accepted: int) -> None:
        """After low_windows windows of low acceptance, plain steps; after them the first
        probe_windows windows judge the drafts again (a failed window costs ~3 plain steps:
        a probe as long as the first judgement would cost more than the run saved). While
        the drafts keep failing each run is twice as long as the last (a draft that never
        pays costs a probe every max_plain_backoff steps, not every plain_backoff), back to
        plain_backoff once low_windows windows pay again."""
        c = self.config
        self._recent.append((drafted, accepted))
        del self._recent[:-c.low_windows]
        need = min(c.probe_windows, c.low_windows) if self._probing else c.low_windows
        if len(self._recent) < need:
            return
        if self._low_acceptance():
            self._plain_left = self._backoff
            self.stats.backoffs.append(self._backoff)
            self._backoff = min(2 * self._backoff, c.max_plain_backoff)
            self._recent.clear()
            self._probing = True
        elif self._probing:  # the drafts pay again: judged over low_windows windows from now
            self._probing = False
        else:
            self._backoff = c.plain_backoff


def measure_costs(model, rows: int, repeats: int = 3, context: int = 64,
                  graphs: bool = False) -> tuple[list[float], float]:
    """Median seconds of a decode-time forward over 1..rows rows and of one draft, on a
    scratch session with `context` tokens of history — eager, or (`graphs`) replayed from
    CUDA graphs as a graphed session runs them, each shape's capture made first and not
    timed: the start-up calibration of the adaptive length, which must price the windows
    the session will run (eagerly a step is mostly launch cost, so a wider window costs
    little more; replayed, each row adds its experts' decoding)."""
    from strata.runtime.session import Session  # (the session imports this module)
    cfg = model.cfg
    spec = SpecConfig() if model.dspark is not None else None
    s = Session(model, context + rows + cfg.dspark_block_size + 1, speculative=spec,
                graphs=graphs)
    tokens = torch.arange(context + rows) % cfg.vocab_size
    s.prefill(tokens[:context])
    state, greedy = s.state, SamplingParams()
    untimed = 1 if graphs else 0

    def median_s(run) -> float:
        times = []
        for i in range(untimed + repeats):
            t0 = time.perf_counter()
            run()
            if state.device.type == "cuda":
                torch.cuda.synchronize(state.device)
            if i >= untimed:
                times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    def window(r: int):
        def run() -> None:
            state.begin()
            try:
                s.forward(tokens[context:context + r], "all")
            finally:
                state.rollback()
        return run

    def draft() -> None:  # (from any anchor: the draft's work does not depend on it)
        if s.graphed is not None and s.graphed.can_draft():
            s.graphed.draft(5, greedy)
        else:
            model.dspark.draft(model.embed, model.head, 5, state, model.numerics,
                               lambda lg, positions: sample(lg, positions, greedy))

    try:
        costs = [median_s(window(r)) for r in range(1, rows + 1)]
        return costs, (median_s(draft) if model.dspark is not None else 0.0)
    finally:
        s.state.drop_graphs()


def speculative_config(model, length: int | None,
                       graphs: bool) -> tuple[SpecConfig, tuple[list[float], float] | None]:
    """A session's DSpark setup for `length` drafts a window, or (None) the adaptive length
    with its window prices measured now, the way the sessions will run (graphed or eager),
    and printed — the CLI's --speculative [--draft-length N]."""
    if model.dspark is None:
        raise StrataError("speculative decoding needs a model with DSpark stages (mtp.*)")
    if length is not None:
        return SpecConfig(length=length), None
    costs, draft = measure_costs(model, model.cfg.dspark_block_size + 1, graphs=graphs)
    print("strata: DSpark verify windows priced (ms by rows): "
          + ", ".join(f"{1e3 * c:.2f}" for c in costs) + f"; a draft {1e3 * draft:.2f}",
          file=sys.stderr, flush=True)
    return SpecConfig(), (costs, draft)
