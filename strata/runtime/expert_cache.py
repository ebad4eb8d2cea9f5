"""A bounded device cache for the DSpark stages' routed experts (issue 6, item 4).

When the draft stages' 3 × 128 experts (~7 GB for V4.1) do not fit beside the backbone, they
stay on the host or on disk and the experts a draft step selects are brought to the drafting
device on demand. Only draft experts ever enter this cache — backbone weights are owned by the
model and are never entries — so evicting can never touch the backbone.

Exactness: an entry is exactly what `fetch(key)` returns (the same stored encoding, read from
the same bytes), so a computation gives the same result whether its experts were hits or
misses, whatever the budget.

Budget: the resident entries' bytes stay ≤ `budget_bytes`; the least recently used entries are
evicted first. A caller holding a value keeps it alive after eviction (torch frees it when the
last reference goes), so `get_many` is the way to ask for all experts of one step together:
it fails, naming the keys, when they cannot be resident at once.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from strata.errors import StrataError

MiB = 1 << 20
DEFAULT_BUDGET_BYTES = 1024 * MiB
# Left free on the device when the budget grows into free memory: activations, graphs, slack.
FREE_MARGIN_BYTES = 4096 * MiB


class ExpertCacheError(StrataError):
    """An expert (or one step's experts) cannot fit the cache budget."""


def default_budget(device: torch.device | str) -> int:
    """1024 MiB, or more when the drafting device has more free memory than the margin needs."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        return max(DEFAULT_BUDGET_BYTES, free - FREE_MARGIN_BYTES)
    return DEFAULT_BUDGET_BYTES


class ExpertCache:
    """LRU of device-resident experts under a byte budget.

    `fetch(key) -> (value, nbytes)` loads one expert onto the device (e.g. the three Linears of
    `mtp.{stage}.ffn.experts.{e}` through a TensorLoader) and says how many device bytes it holds.
    """

    def __init__(self, fetch: Callable[[Hashable], tuple[Any, int]], budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"expert cache budget {budget_bytes} must be > 0 bytes")
        self.fetch, self.budget = fetch, int(budget_bytes)
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()  # LRU first
        self.resident_bytes = 0
        self.hits = self.misses = self.evictions = 0
        self.bytes_fetched = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> Any:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[Hashable]) -> list[Any]:
        """The values of `keys` (repeats allowed), all resident together when this returns."""
        wanted = list(dict.fromkeys(keys))  # distinct, first-use order
        for key in wanted:
            if key in self._entries:
                self.hits += 1
                self._entries.move_to_end(key)
        keep = set(wanted)
        for key in wanted:
            if key in self._entries:
                continue
            self.misses += 1
            value, nbytes = self.fetch(key)
            self.bytes_fetched += nbytes
            if nbytes > self.budget:
                raise ExpertCacheError(f"expert {key!r} holds {nbytes} bytes, more than the "
                                       f"whole cache budget of {self.budget} bytes")
            self._make_room(nbytes, keep, key)
            self._entries[key] = (value, nbytes)
            self.resident_bytes += nbytes
        return [self._entries[k][0] for k in keys]

    def _make_room(self, nbytes: int, keep: set, key: Hashable) -> None:
        """Evict least recently used entries not needed by this step until `nbytes` fit."""
        for victim in list(self._entries):
            if self.resident_bytes + nbytes <= self.budget:
                return
            if victim in keep:
                continue
            _, vbytes = self._entries.pop(victim)
            self.resident_bytes -= vbytes
            self.evictions += 1
        if self.resident_bytes + nbytes > self.budget:
            step = [k for k in self._entries if k in keep] + [key]
            raise ExpertCacheError(
                f"the experts of one step ({', '.join(map(repr, step))}) need more than the "
                f"cache budget of {self.budget} bytes at once; raise the budget")

    def clear(self) -> None:
        self._entries.clear()
        self.resident_bytes = 0

    def stats(self) -> dict[str, int | float]:
        total = self.hits + self.misses
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "hit_rate": self.hits / total if total else 0.0,
                "resident_bytes": self.resident_bytes, "budget_bytes": self.budget,
                "bytes_fetched": self.bytes_fetched}


class CachedExperts:
    """The routed experts of one DSpark stage, kept off the device and brought in through an
    ExpertCache when a draft step selects them (ExpertStack's `slots` interface).

    Exactness: a step runs `ExpertStack.of_linears` over just the selected experts — the same
    per-pair products as the full stack restricted to them — so drafts are bit-identical to a
    model holding every draft expert on the device, whatever the cache held before the step.
    """

    def __init__(self, cache: ExpertCache, prefix: str, n_experts: int, limit: float) -> None:
        self.cache, self.prefix = cache, prefix
        self.n_experts, self.limit = n_experts, limit

    def slots(self, x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor,
              nx) -> torch.Tensor:
        from strata.model.moe import ExpertStack
        selected = torch.unique(idx)  # ascending, so the remapped order is the original one
        parts = self.cache.get_many([(self.prefix, int(e)) for e in selected.tolist()])
        linears = {name: [p[name] for p in parts] for name in ("w1", "w3", "w2")}
        local = torch.searchsorted(selected, idx.contiguous())
        return ExpertStack.of_linears(linears, self.limit).slots(x, local, weight, nx)


class DraftExpertReader:
    """A weight reader that loads everything through `inner` except the DSpark stages' routed
    experts (`mtp.*.ffn.experts`), which stay on disk behind one ExpertCache per device.

    Fetching reads an expert's three projections as stored, through the reader's own small
    staging pool (the model's loader is closed once loading ends), from the same checkpoint
    folder or pack. Backbone experts are never cache entries, so no eviction touches them.
    """

    def __init__(self, inner, budget_bytes: int | None = None,
                 buffer_bytes: int = 64 * MiB, n_buffers: int = 2) -> None:
        from strata.checkpoint.loader import TensorLoader
        from strata.checkpoint.weights import WeightReader
        self.inner = inner
        self._fetch_reader = WeightReader(inner.folder, inner.device, TensorLoader(
            inner.device, buffer_bytes=buffer_bytes, n_buffers=n_buffers))
        budget = budget_bytes if budget_bytes is not None else default_budget(inner.device)
        self.cache = ExpertCache(self._fetch, budget)
        self._shapes: dict[str, dict[str, tuple[int, int]]] = {}

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # everything else is the inner reader's

    def cached_experts(self, cfg, prefix: str, n_experts: int) -> CachedExperts | None:
        if not prefix.startswith("mtp."):
            return None
        from strata.model.moe import expert_shapes
        self._shapes[prefix] = expert_shapes(cfg)
        for name in self._shapes[prefix]:  # fail at load, not at the first draft
            for e in (0, n_experts - 1):
                if not self.inner.folder.has(f"{prefix}.{e}.{name}.weight") and \
                        not self.inner.folder.has(f"{prefix}.{e}.{name}.trellis"):
                    raise ExpertCacheError(f"draft expert {prefix}.{e}.{name} is missing from "
                                           f"{self.inner.folder.path}")
        return CachedExperts(self.cache, prefix, n_experts, cfg.swiglu_limit)

    def _fetch(self, key: tuple[str, int]) -> tuple[dict, int]:
        prefix, e = key
        linears = {name: self._fetch_reader.linear(f"{prefix}.{e}.{name}", *shape)
                   for name, shape in self._shapes[prefix].items()}
        return linears, sum(l.nbytes() for l in linears.values())

    def close(self) -> None:
        self._fetch_reader.loader.close()
