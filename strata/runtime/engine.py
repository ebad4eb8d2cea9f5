"""The engine: one worker thread owns the model and serves generation jobs one at a time.

Callers (the HTTP server) submit a `GenRequest` with an event callback and get a `Job` back.
The worker takes jobs in arrival order from a bounded queue (`QueueFull` when it is full),
continues the retained state sharing the longest prefix with the prompt (PrefixCache),
prefills the rest in chunks, decodes through `Session.generate` and reports every step to the
callback, from the worker thread:

  Started(prompt_tokens, cached_tokens) → Token(id) ... → Finished(reason, ...)
                                          or at any point Failed(message)

Cancellation is a flag the worker checks between prefill chunks and after every decode step,
so a cancelled job frees the worker within one forward. The state stays consistent on cancel
(every forward commits whole) and is retained; after an exception it is dropped, and the
worker goes on with the next job.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from strata.model.model import Model
from strata.runtime.constraint import Constraint
from strata.runtime.prefix_cache import PrefixCache, Retained
from strata.runtime.sampling import Logprobs, SamplingParams
from strata.runtime.session import PREFILL_CHUNK, Session
from strata.runtime.speculative import SpecConfig

log = logging.getLogger("strata.engine")


class QueueFull(Exception):
    """The engine's queue holds max_queue waiting jobs."""


class EngineStopped(Exception):
    """The engine no longer accepts jobs (shutting down)."""


@dataclass(frozen=True)
class GenRequest:
    prompt: Sequence[int]
    max_tokens: int
    params: SamplingParams = SamplingParams()
    stop_ids: frozenset[int] | None = None        # None: the model's EOS
    scripted: Sequence[int] | None = None         # test hook, see Session.generate
    logprobs: int | None = None                   # each token's logprob and this many top
    # alternatives (sampling.Logprobs), or None: not reported
    constraint: Constraint | None = None          # the grammar the answer is held to (its
    # own state, advanced as the job runs: a request object runs once)


# ---- events (delivered to the job's callback on the worker thread) ---------------------------
@dataclass(frozen=True)
class Started:
    prompt_tokens: int
    cached_tokens: int      # prompt tokens taken from a retained state (not prefilled)


@dataclass(frozen=True)
class Token:
    id: int
    logprob: tuple[float, list[tuple[int, float]]] | None = None  # (GenRequest.logprobs)


@dataclass(frozen=True)
class Finished:
    reason: str             # "stop" (a stop id), "length" (max_tokens) or "cancelled"
    generated: int
    prefill_s: float
    decode_s: float
    drafted: int = 0        # DSpark: drafted / accepted tokens of this job
    accepted: int = 0


@dataclass(frozen=True)
class Failed:
    message: str
    error_type: str


Event = Started | Token | Finished | Failed


@dataclass
class Job:
    request: GenRequest
    on_event: Callable[[Event], None]
    _cancel: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Ask the worker to stop this job (no effect once it has finished)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()


class Engine:
    def __init__(self, model: Model, capacity: int, *, max_queue: int = 16,
                 prefix_cache_bytes: int = 1 << 30, max_bookmarks: int = 4,
                 prefill_chunk: int = PREFILL_CHUNK, speculative: SpecConfig | None = None,
                 costs: tuple[list[float], float] | None = None,
                 graphs: bool = False) -> None:
        if capacity < 2:
            raise ValueError("capacity must be ≥ 2 tokens")
        if max_queue < 0:
            raise ValueError("max_queue must be ≥ 0")
        self.model = model
        self.capacity = capacity
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.speculative = speculative
        self.costs = costs  # the adaptive verify length's prices (Session's `costs`)
        self.graphs = graphs  # decode from CUDA graphs (kept on the retained states)
        self.cache = PrefixCache(prefix_cache_bytes, max_bookmarks)
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.running: Job | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "Engine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="strata-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting jobs; finish the queued ones (drain) or cancel them; join the worker."""
        with self._cond:
            self._stopping = True
            if not drain:
                for job in self._waiting:
                    job.cancel()
                if self.running is not None:
                    self.running.cancel()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def warm_up(self) -> float:
        """The work of two throwaway requests (a whole prefill chunk and a ragged one, then a
        few greedy and a few sampled tokens, with the engine's graphs and DSpark windows) on a
        scratch state, dropped after: on CUDA the kernels compile and the graph code runs here,
        before the first client waits for it (a fresh machine compiles for tens of seconds),
        and a broken GPU setup fails at start-up. Nothing is retained. Seconds taken."""
        t0 = time.perf_counter()
        cfg = self.model.cfg
        n = min(self.prefill_chunk + 21, self.capacity - 8)
        if n < 1:
            return 0.0
        prompt = torch.arange(n) % (cfg.vocab_size - 3) + 3
        if self.model.device.type == "cuda":  # (met by a long prompt's selection only)
            from strata.kernels import ranking
            ranking.compile_split(self.model.device)
        for params in (SamplingParams(), SamplingParams(1.0, 0.9, 0)):
            session = Session(self.model, n + 64, self.prefill_chunk,  # (room for windows)
                              speculative=self.speculative, costs=self.costs,
                              decoder_skip=True, graphs=self.graphs)
            try:
                session.run(prompt, 4, params, stop_ids=frozenset())
            finally:
                session.state.drop_graphs()
        return time.perf_counter() - t0

    # ---- submission ----------------------------------------------------------------------------
    def submit(self, request: GenRequest, on_event: Callable[[Event], None]) -> Job:
        job = Job(request, on_event)
        with self._cond:
            if self._stopping:
                raise EngineStopped("the engine is shutting down")
            if len(self._waiting) >= self.max_queue and self.running is not None:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting")
            self._waiting.append(job)
            self._cond.notify_all()
        return job

    def cancel(self, job: Job) -> None:
        """Cancel a job; a job still waiting leaves the queue at once."""
        job.cancel()
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:
                return  # running or done: the worker sees the flag
        job.on_event(Finished("cancelled", 0, 0.0, 0.0))

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return len(self._waiting)

    # ---- the worker --------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while not self._waiting and not self._stopping:
                    self._cond.wait()
                if not self._waiting:
                    return  # stopping and drained
                job = self._waiting.popleft()
                self.running = job
            try:
                self._serve(job)
            except Exception as e:  # reported to this job's client; the worker goes on
                log.exception("generation failed")
                job.on_event(Failed(str(e) or type(e).__name__, type(e).__name__))
            finally:
                with self._cond:
                    self.running = None

    def _serve(self, job: Job) -> None:
        req = job.request
        if job.cancelled:
            job.on_event(Finished("cancelled", 0, 0.0, 0.0))
            return
        prompt = torch.as_tensor(list(req.prompt), dtype=torch.long)
        if prompt.numel() == 0:
            raise ValueError("the prompt is empty")
        entry, cached = self.cache.take(prompt)
        if entry is None:
            entry = Retained(self.model.new_state(self.capacity))
        try:
            self._generate(job, entry, cached, prompt)
        except BaseException:
            entry.state.drop_graphs()  # (not retained: its memory freed now, not at a collection)
            raise

    def _generate(self, job: Job, entry: Retained, cached: int, prompt: torch.Tensor) -> None:
        """The request on `entry`'s state, which holds the prompt's first `cached` tokens;
        the state retained after (a cancel included)."""
        req = job.request
        state = entry.state
        state.check_room(prompt.numel() - cached + max(req.max_tokens - 1, 0))
        job.on_event(Started(prompt.numel(), cached))
        # The exact decoder-skipping prefill for long prompts (prefix reuse stays exact: see
        # Session.prefill).
        session = Session(self.model, self.capacity, self.prefill_chunk,
                          speculative=self.speculative, costs=self.costs, state=state,
                          decoder_skip=True, graphs=self.graphs)
        t0 = time.perf_counter()
        # Prefill all but the last prompt token here, chunk by chunk, so a cancel is seen
        # between chunks; generate() runs the last one and picks the first token from it.
        rest = prompt[cached:]
        for i in range(0, rest.numel() - 1, self.prefill_chunk):
            if job.cancelled:
                self.cache.put(entry)
                job.on_event(Finished("cancelled", 0, time.perf_counter() - t0, 0.0))
                return
            end = min(i + self.prefill_chunk, rest.numel() - 1)
            session.prefill(rest[i:end], rows_after=rest.numel() - end)
        # Bookmark one token before the prompt's end: a later request needs at least one
        # token to prefill (the first pick needs the last prompt row's logits), so this is
        # the furthest point a retry of the same prompt, or a later turn, can come back to.
        if cached < prompt.numel() - 1:
            entry.add_bookmark(self.cache.max_bookmarks)

        stop_ids = req.stop_ids if req.stop_ids is not None \
            else frozenset({self.model.cfg.eos_token_id})
        first: list[float] = []  # when the first token was picked (prefill done)
        mode = "plain" if req.scripted is not None else None
        n, last = 0, None
        lps = None if req.logprobs is None else Logprobs(req.logprobs)
        # An exception propagates to _loop without retaining the state: the failing forward
        # undid its own writes, but the conversation's next request starts cold rather than
        # from a state we cannot vouch for.
        for tok in session.generate(rest[-1:], req.max_tokens, req.params, stop_ids,
                                    should_stop=lambda: job.cancelled, mode=mode,
                                    scripted=req.scripted, logprobs=lps,
                                    constraint=req.constraint):
            if not first:
                first.append(time.perf_counter())
            job.on_event(Token(tok, None if lps is None else lps.items[n]))
            n, last = n + 1, tok
        t1 = time.perf_counter()
        self.cache.put(entry)
        if last is not None and last in stop_ids:
            reason = "stop"
        elif n >= req.max_tokens:
            reason = "length"
        else:
            reason = "cancelled"
        stats = session.stats
        t_pre = first[0] if first else t1
        job.on_event(Finished(reason, n, t_pre - t0, t1 - t_pre,
                              stats.drafted if stats else 0, stats.accepted if stats else 0))
