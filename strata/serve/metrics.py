"""Prometheus metrics of one server (its own registry, so several apps can share a process)."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from strata.runtime.engine import Finished


class Metrics:
    def __init__(self, queue_depth: Callable[[], int], speculative: bool) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("strata_requests", "Requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("strata_prompt_tokens", "Prompt tokens of started "
                                     "generations", registry=r)
        self.cache_hit_tokens = Counter("strata_prefix_cache_hit_tokens", "Prompt tokens "
                                        "taken from retained state instead of prefilled",
                                        registry=r)
        self.generated_tokens = Counter("strata_generated_tokens", "Tokens generated",
                                        registry=r)
        self.decode_seconds = Counter("strata_decode_seconds", "Seconds spent decoding "
                                      "(after the prompt)", registry=r)
        self.decode_tps = Gauge("strata_decode_tokens_per_second", "Decode rate of the last "
                                "finished generation", registry=r)
        self.ttft = Histogram("strata_time_to_first_token_seconds", "From request arrival to "
                              "the first generated token", registry=r,
                              buckets=(.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.queue = Gauge("strata_queue_depth", "Requests waiting for the engine", registry=r)
        self.queue.set_function(queue_depth)
        # Only with DSpark on: otherwise there is nothing to report.
        self.spec_drafted = self.spec_accepted = None
        if speculative:
            self.spec_drafted = Counter("strata_speculative_drafted_tokens", "DSpark tokens "
                                        "drafted", registry=r)
            self.spec_accepted = Counter("strata_speculative_accepted_tokens", "DSpark drafted "
                                         "tokens accepted by verification", registry=r)

    def started(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.cache_hit_tokens.inc(cached_tokens)

    def finished(self, ev: Finished) -> None:
        self.generated_tokens.inc(ev.generated)
        self.decode_seconds.inc(ev.decode_s)
        # The first token comes from the prefill; the decode rate counts the others.
        if ev.generated > 1 and ev.decode_s > 0:
            self.decode_tps.set((ev.generated - 1) / ev.decode_s)
        if self.spec_drafted is not None:
            self.spec_drafted.inc(ev.drafted)
            self.spec_accepted.inc(ev.accepted)

    def render(self) -> bytes:
        return generate_latest(self.registry)
