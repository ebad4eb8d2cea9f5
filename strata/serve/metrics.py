"""Prometheus metrics of one server (its own registry, so several apps can share a process)."""
from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from strata.runtime.engine import Finished


class EngramCollector:
    """Row counts of the disk-resident Engram tables, read from the stores at scrape time."""

    OUTCOMES = ("cache_hits", "prefetch_hits", "misses")

    def __init__(self, stores: Mapping) -> None:
        self.stores = stores  # layer -> strata.engram_store.EngramStore

    def collect(self):
        rows = CounterMetricFamily("strata_engram_rows", "Engram rows looked up, by how they "
                                   "were served (cached, read ahead by prefetch, read on "
                                   "demand)", labels=["layer", "outcome"])
        read = CounterMetricFamily("strata_engram_read_bytes", "Bytes read from the Engram "
                                   "table files", labels=["layer"])
        for layer, store in sorted(self.stores.items()):
            st = store.stats()
            for outcome in self.OUTCOMES:
                rows.add_metric([str(layer), outcome], getattr(st, outcome))
            read.add_metric([str(layer)], st.bytes_read)
        yield rows
        yield read


class Metrics:
    def __init__(self, queue_depth: Callable[[], int], speculative: bool,
                 engram_stores: Mapping | None = None) -> None:
        r = self.registry = CollectorRegistry()
        if engram_stores:  # --engram disk
            r.register(EngramCollector(engram_stores))
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
