"""Retained decode states for prefix reuse: a bounded LRU of conversations under a byte budget.

After a request the engine keeps its State (prompt + generated tokens). A new request takes the
retained state whose tokens share the longest prefix c with its prompt, goes back to c and
prefills only the rest. Going back uses, in order of preference:
- `State.truncate(c)` while the rings still hold the rows positions ≥ c will read;
- `State.restore(bm)` of the latest bookmark at a position ≤ c (the engine bookmarks the end
  of every prompt prefill, so the next turn of a conversation usually finds one);
- nothing: a fresh state.
Outputs after reuse equal a cold run's because forwards are batch-invariant and sampling is a
pure function of (seed, position, logits) — the cache only saves work.

A state is cut back in place when the new prompt diverges only inside the output of the
state's last request (the usual next turn: the client re-rendered the reply); when it diverges
inside an earlier prompt (a branch, or another conversation sharing the system prompt) the
state is forked (cloned), so the conversation it belongs to keeps its whole context.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import count

import torch

from strata.runtime.state import Bookmark, State


log = logging.getLogger("strata.prefix_cache")


def state_nbytes(state: State) -> int:
    """Bytes held by a state's tensors (rings, compressed caches, token history)."""
    tensors = [state.tokens, *state.comp_kv.values(), *state.index_k.values()]
    for ring in state._rings():
        tensors += [ring.rows, ring.tags]
    return sum(t.numel() * t.element_size() for t in tensors)


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-D token tensors."""
    n = min(a.numel(), b.numel())
    if n == 0:
        return 0
    diff = (a[:n] != b[:n].to(a.device)).nonzero()
    return int(diff[0, 0]) if diff.numel() else n


@dataclass
class Retained:
    """One conversation's state with the bookmarks taken on it (ascending positions)."""

    state: State
    bookmarks: list[Bookmark] = field(default_factory=list)

    def nbytes(self) -> int:
        """The state's caches, its bookmarks and its CUDA graphs (kept with it)."""
        graphs = self.state.graphs
        return (state_nbytes(self.state) + sum(b.nbytes() for b in self.bookmarks)
                + (graphs.nbytes() if graphs is not None else 0))

    def add_bookmark(self, limit: int) -> None:
        """Bookmark the current position, keeping the newest `limit` bookmarks."""
        bm = self.state.bookmark()
        self.bookmarks = [b for b in self.bookmarks if b.position < bm.position] + [bm]
        del self.bookmarks[:-limit]

    def fork(self) -> "Retained":
        # Bookmarks are never written after they are taken, so the fork can share them.
        return Retained(self.state.clone(), list(self.bookmarks))

    def rewind(self, to: int) -> int:
        """Go back to position `to` or the closest reachable point before it; return it."""
        st = self.state
        if to < st.position:
            if st.can_truncate(to):
                st.truncate(to)
            else:
                older = [b for b in self.bookmarks if b.position <= to]
                if not older:
                    st.truncate(0)  # always possible: nothing before position 0 is read
                    to = 0
                else:
                    st.restore(older[-1])
                    to = older[-1].position
        # Bookmarks past the point we moved back from describe tokens about to be replaced.
        self.bookmarks = [b for b in self.bookmarks if b.position <= to]
        return to


class PrefixCache:
    """Retained conversations, least recently used first out, within `budget_bytes`."""

    def __init__(self, budget_bytes: int, max_bookmarks: int = 4) -> None:
        if budget_bytes < 0:
            raise ValueError("prefix cache budget must be ≥ 0 bytes")
        if max_bookmarks < 1:
            raise ValueError("max_bookmarks must be ≥ 1")
        self.budget_bytes = budget_bytes
        self.max_bookmarks = max_bookmarks
        self._entries: OrderedDict[int, tuple[Retained, int]] = OrderedDict()  # key → (entry, bytes)
        self._keys = count()
        self._warned = False  # (that one conversation exceeds the budget: said once)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self._entries.values())

    def take(self, prompt: torch.Tensor) -> tuple[Retained | None, int]:
        """The retained state to continue `prompt` from and how many prompt tokens it already
        holds (its position), or (None, 0). At least one prompt token is always left to
        prefill, since the first pick needs the last prompt row's logits. The engine
        bookmarks each prompt one token before its end, so the latest bookmark marks where
        the state's last request started generating."""
        best_key, best = None, 0
        for key, (entry, _) in self._entries.items():
            st = entry.state
            c = common_prefix(st.tokens[:st.position], prompt)
            if c > best:
                best_key, best = key, c
        best = min(best, prompt.numel() - 1)
        if best_key is None or best <= 0:
            return None, 0
        entry, _ = self._entries[best_key]
        last_prompt = entry.bookmarks[-1].position if entry.bookmarks else 0
        if best >= last_prompt:
            # A continuation, or a divergence inside what the state's last request generated
            # (a retry; a reply the client re-rendered): no other request will want that
            # tail, so the state is handed over and cut back.
            del self._entries[best_key]
            return entry, entry.rewind(best)
        # Diverging inside an earlier prompt: a branch. Fork, so the conversation the state
        # belongs to keeps its whole context.
        self._entries.move_to_end(best_key)
        fork = entry.fork()
        reached = fork.rewind(best)
        return (fork, reached) if reached > 0 else (None, 0)

    def put(self, entry: Retained) -> None:
        """Retain a conversation as the most recent; evict the least recent over budget."""
        n = entry.nbytes()
        if n > self.budget_bytes > 0 and not self._warned:
            self._warned = True
            log.warning("the prefix cache's budget (%.1f MiB) is smaller than one "
                        "conversation's state (%.1f MiB): no prompt is reused; raise "
                        "--prefix-cache-mb", self.budget_bytes / 2**20, n / 2**20)
        self._entries[next(self._keys)] = (entry, n)
        while self._entries and self.nbytes > self.budget_bytes:
            _, (evicted, _) = self._entries.popitem(last=False)
            evicted.state.drop_graphs()  # (its memory freed now, not at a cycle collection)

    def clear(self) -> None:
        for entry, _ in self._entries.values():
            entry.state.drop_graphs()
        self._entries.clear()
