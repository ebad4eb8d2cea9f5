"""Per-session decode state with snapshot → commit / rollback (DESIGN.md, spec §4).

Everything a forward writes lives here, preallocated on the model's device:
- `window[l]`: each layer's sliding-window KV in a position-tagged ring (rows are valid for a
  query by their tag, so rows of rejected positions are simply never read again);
- `comp_tail[l]`: per-token compressor inputs (k, gate) of ratio-2 kv-source layers, a ring
  holding the unfinished group's first token across forwards;
- `comp_kv[l]`, `index_k[l]`: compressed KV and index keys of kv-source layers, at absolute
  entry indices (entry j ↔ tokens [j·r, (j+1)·r)); entries past the committed position are
  invisible by construction and overwritten when recomputed (a forward writes its unfinished
  group's entry too: one spare row);
- `dspark[k]`: each DSpark stage's window of keys projected from committed main rows (written
  only for committed positions, so verification never has to undo them);
- `tokens`: the committed token ids, on the host (Engram history, prefix matching);
- `position`: the number of committed tokens.

Rolling back never copies whole caches: a forward run under `begin()` journals only the ring
slots it overwrites (cost ∝ rows written), and rollback restores those of rejected positions.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from strata.config import ModelConfig
from strata.current_device import made_current
from strata.errors import CapacityError
from strata.kernels import ring as ring_kernels


def entry_bucket(n: int) -> int:
    """The number of compressed entries a selection scores when n are written: n rounded up
    to a multiple of max(256, 2^(bits(n) − 4)) — at most ~6 % more past 4K entries, ~16 sizes
    per doubling. Invisible entries are masked to −inf, which the selection never picks, so
    the result is that of scoring n. (The index-key caches are sized to the bucket of their
    capacity; the layer split's carry sizes the candidate blocks with it.)"""
    step = max(256, 1 << max(0, n.bit_length() - 4))
    return -(-n // step) * step


class PositionRing:
    """A ring of `size` rows addressed by absolute position (slot = pos % size), with tags."""

    def __init__(self, size: int, row_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, keep: int) -> None:
        if size < keep + 1:
            raise ValueError(f"ring of {size} rows cannot keep {keep} rows of history")
        self.size = size
        self.keep = keep  # rows before the current position that later reads may need
        self.rows = torch.zeros((size,) + row_shape, dtype=dtype, device=device)
        self.tags = torch.full((size,), -1, dtype=torch.long, device=device)

    def gather(self, positions: torch.Tensor) -> torch.Tensor:
        """Rows of the given positions (the caller guarantees they are present)."""
        return self.rows[positions % self.size]

    def write(self, first: int, positions: torch.Tensor, rows: torch.Tensor,
              journal: "Journal | None") -> None:
        """Write rows for the consecutive positions first, first + 1, ... (`positions`: the
        same, on the device — the caller's forward positions, so the ops do not depend on
        `first`, a host int kept for the journal's bookkeeping); journal the displaced slots.

        Only the last `size` rows can be stored; a journaled write that drops earlier rows
        can then be rolled back wholly, or to a point whose history it still holds.
        """
        n = rows.shape[0]
        kept_from = first + max(0, n - self.size)
        if n > self.size:
            rows, positions = rows[-self.size:], positions[-self.size:]
        fused = ring_kernels.available(self.rows, rows)
        slots = positions % self.size if journal is not None or not fused else None
        if journal is not None:
            journal.writes.append(RingWrite(self, first, kept_from, slots, positions,
                                            self.rows[slots].clone(), self.tags[slots].clone()))
        if fused:  # (one launch: slots, cast and both stores)
            ring_kernels.ring_write(self.rows, self.tags, positions, rows)
        else:
            self.rows[slots] = rows.to(self.rows.dtype)
            self.tags[slots] = positions

    def clone(self) -> "PositionRing":
        other = object.__new__(PositionRing)
        other.size, other.keep = self.size, self.keep
        other.rows, other.tags = self.rows.clone(), self.tags.clone()
        return other


@dataclass
class RingWrite:
    """One journaled ring write: the slots it overwrote and what they held."""

    ring: PositionRing
    first: int                 # first position the caller asked to write
    kept_from: int             # first position actually stored (the last `size` of the write)
    slots: torch.Tensor
    positions: torch.Tensor    # positions actually stored (the last `size` of the write)
    old_rows: torch.Tensor
    old_tags: torch.Tensor
    # the write this one is a shifted copy of (a CUDA graph's recorded write): they share
    # their tensors, so the restore's table row is made once, on the source
    source: "RingWrite | None" = field(default=None, repr=False, compare=False)
    _entry: object = field(default=None, init=False, repr=False, compare=False)

    def undo_from(self, to: int) -> None:
        """Restore the slots of positions ≥ `to`."""
        undo_writes([self], to)

    def check_undo(self, to: int) -> None:
        kept_from = self.kept_from
        if self.first < to < kept_from + self.ring.keep and kept_from > self.first:
            raise ValueError(f"cannot roll back to position {to}: this write kept only "
                             f"positions ≥ {kept_from} of the {self.ring.keep} it needs before {to}")

    def restore_entry(self):
        """This write's row of kernels/ring.ring_restore's table (made on first use)."""
        src = self.source or self
        if src._entry is None:
            src._entry = ring_kernels.restore_entry(
                self.ring.rows, self.ring.tags, self.slots, self.positions, self.old_rows,
                self.old_tags)
        return src._entry

    def undo_torch(self, to: int) -> None:
        # Every slot is rewritten, with its old or its current row: no boolean indexing, so
        # no wait for the device (the undo mask lives there).
        rows, tags = self.ring.rows, self.ring.tags
        undo = self.positions >= to
        mask = undo.view(-1, *([1] * (self.old_rows.dim() - 1)))
        rows[self.slots] = torch.where(mask, self.old_rows, rows[self.slots])
        tags[self.slots] = torch.where(undo, self.old_tags, tags[self.slots])

    def shifted(self, delta: int) -> "RingWrite":
        """The same write `delta` positions later (its device tensors shared): a CUDA graph's
        recorded write, replayed at another position (runtime/graphs.py)."""
        return RingWrite(self.ring, self.first + delta, self.kept_from + delta, self.slots,
                         self.positions, self.old_rows, self.old_tags, self.source or self)


def undo_writes(writes: list[RingWrite], to: int) -> None:
    """Undo journaled writes in the order given (a rollback's: newest first) from position
    `to`. Where the kernel runs, the writes into distinct rings of one dtype restore in one
    launch (kernels/ring.py): one batch per dtype, launched when one of its rings comes again
    (so each ring's undos keep their order; rings of other dtypes are other rings) and at the
    end. Every write is checked before any runs."""
    for w in writes:
        w.check_undo(to)
    batches: dict[torch.dtype, list[RingWrite]] = {}

    def flush(dtype: torch.dtype) -> None:
        batch = batches.pop(dtype, [])
        if batch:
            ring_kernels.ring_restore([b.restore_entry() for b in batch], to)
    for w in writes:
        dtype = w.ring.rows.dtype
        if not ring_kernels.available(w.ring.rows, w.old_rows):
            for d in list(batches):
                flush(d)
            w.undo_torch(to)
            continue
        if any(b.ring is w.ring for b in batches.get(dtype, [])):
            flush(dtype)
        batches.setdefault(dtype, []).append(w)
    for d in list(batches):
        flush(d)


@dataclass
class Journal:
    """What the forwards since begin() displaced from the rings, to undo rejected rows."""

    start: int
    n_written: int = 0
    stale_index_source: int | None = None
    writes: list[RingWrite] = field(default_factory=list)


@dataclass
class Bookmark:
    """The ring contents at a position: with them, a state that has since gone further on the
    same tokens can return to `position` exactly (the caches at absolute positions below it
    were not touched by later forwards). Costs a copy of the rings, not of the caches."""

    position: int
    rings: list[tuple[torch.Tensor, torch.Tensor]]
    stale_index_source: int | None

    def nbytes(self) -> int:
        return sum(r.numel() * r.element_size() + t.numel() * t.element_size()
                   for r, t in self.rings)


def cache_sources(cfg: ModelConfig, layers: Iterable[int]) -> set[int]:
    """The kv-source layers whose compressed KV / index keys `layers` write or read."""
    out = set()
    for l in layers:
        if cfg.is_kv_source(l):
            out.add(l)
        if cfg.ratio(l) > 0 and cfg.kv_source_of(l) is not None:
            out.add(cfg.kv_source_of(l))
    return out


class State:
    """Decode state of one sequence for a given model config and capacity (in tokens)."""

    def __init__(self, cfg: ModelConfig, capacity: int, device: torch.device | str = "cpu",
                 kv_dtype: torch.dtype = torch.float32, ring_size: int | None = None,
                 layers: Iterable[int] | None = None, dspark: bool = True) -> None:
        """`layers`: the backbone layers whose caches this state holds (default all; a rank of
        a layer split holds its own, runtime/parallel.py), with the compressed caches those
        layers read. `dspark=False` leaves out the draft windows."""
        device = torch.device(device)
        self.cfg, self.capacity, self.device = cfg, capacity, device
        W = cfg.sliding_window
        # Window plus the widest verify window, so rejected rows never displace live ones.
        self.ring_size = ring_size or (W + max(128, 2 * cfg.dspark_block_size + 2))
        hd, ihd = cfg.head_dim, cfg.index_head_dim
        held = tuple(range(cfg.n_layers)) if layers is None else tuple(sorted(layers))
        self.layers = held
        self.window = {l: PositionRing(self.ring_size, (hd,), kv_dtype, device, keep=W - 1)
                       for l in held}
        self.comp_tail: dict[int, PositionRing] = {}
        self.comp_kv: dict[int, torch.Tensor] = {}
        self.index_k: dict[int, torch.Tensor] = {}
        sources = cache_sources(cfg, held)
        for l in cfg.kv_source_layer_ids:
            if l not in sources:
                continue
            r = cfg.ratio(l)
            if r > 1 and l in held:
                # As long as the window ring, so truncation reaches as far back for both.
                self.comp_tail[l] = PositionRing(self.ring_size, (2, hd), torch.float32,
                                                 device, keep=r - 1)
            # One spare entry: a forward also writes the group it leaves unfinished,
            # invisible until a later forward completes and rewrites it (Compressor.forward);
            # index keys: room for the bucketed number of entries a selection scores.
            n = capacity // r
            self.comp_kv[l] = torch.zeros((n + 1, hd), dtype=kv_dtype, device=device)
            if cfg.is_index_source(l):
                self.index_k[l] = torch.zeros((max(entry_bucket(n), n + 1), ihd),
                                              dtype=kv_dtype, device=device)
        # DSpark: each stage's window of target-derived keys, committed positions only.
        self.dspark = [PositionRing(self.ring_size, (hd,), kv_dtype, device, keep=W - 1)
                       for _ in range(cfg.num_nextn_predict_layers if dspark else 0)]
        # (on the host: only host work reads it — the Engram hash, prefix matching)
        self.tokens = torch.zeros(capacity, dtype=torch.long)
        self.position = 0
        # vendor_stale_index_k: last kv-source layer that published keys in the last forward
        self.stale_index_source: int | None = None
        self.journal: Journal | None = None
        # The CUDA graphs of forwards on these buffers (runtime/graphs.py: Model.graphed makes
        # them on first use; they stay valid as long as the buffers do, across requests).
        self.graphs = None

    def drop_graphs(self) -> None:
        """Free this state's CUDA graphs now — for a state being let go: it and its graphs
        refer to each other, so otherwise its buffers (GBs of caches at long context) and the
        graphs' memory would wait for Python's cycle collector, which may not run for long."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    # ---- forward bookkeeping ------------------------------------------------------------
    def check_room(self, n_new: int) -> None:
        if self.position + n_new > self.capacity:
            raise CapacityError(
                f"{self.position} tokens in context + {n_new} new = {self.position + n_new} "
                f"exceeds the session capacity of {self.capacity} tokens")

    def advance(self, tokens: torch.Tensor) -> None:
        """Record the forward's tokens as written (the caller commits or rolls back)."""
        T = tokens.numel()
        self.tokens[self.position:self.position + T] = tokens
        if self.journal is not None:
            self.journal.n_written += T
        self.position += T

    # ---- snapshot / commit / rollback ---------------------------------------------------
    def begin(self) -> Journal:
        """Start journaling ring writes; the next forwards can be rolled back to here."""
        if self.journal is not None:
            raise RuntimeError("a snapshot is already open on this state")
        self.journal = Journal(start=self.position, stale_index_source=self.stale_index_source)
        return self.journal

    def commit(self) -> None:
        """Keep everything written since begin()."""
        self.journal = None

    def rollback(self, to: int | None = None) -> None:
        """Undo every row written since begin() for positions ≥ `to` (default: all of them)."""
        j = self.journal
        if j is None:
            raise RuntimeError("rollback without an open snapshot")
        to = j.start if to is None else to
        end = j.start + j.n_written
        if not j.start <= to <= end:
            raise ValueError(f"rollback target {to} outside the journaled range "
                             f"[{j.start}, {end}]")
        # The undo is a Triton launch (kernels/ring.py), which goes to the current device: a
        # state on another GPU than the current one must make its own current (current_device.py).
        # (nothing to undo where every journaled row lies before `to` — a window whose drafts
        # were all accepted; a forward that failed midway wrote rows past `end`)
        if any(w.kept_from + w.slots.numel() > to for w in j.writes):
            with made_current(self.device):
                undo_writes(list(reversed(j.writes)), to)
        if to == j.start:
            self.stale_index_source = j.stale_index_source
        self.position = to
        self.journal = None

    # ---- going back without a journal (prefix reuse) -------------------------------------
    def _rings(self) -> list[PositionRing]:
        return list(self.window.values()) + list(self.comp_tail.values()) + list(self.dspark)

    def bookmark(self) -> Bookmark:
        """Remember the current position so the state can later return to it."""
        if self.journal is not None:
            raise RuntimeError("commit or roll back the open snapshot before bookmarking")
        return Bookmark(self.position, [(r.rows.clone(), r.tags.clone()) for r in self._rings()],
                        self.stale_index_source)

    def restore(self, bm: Bookmark) -> None:
        """Return to a bookmark taken on this state at or before the current position, with
        the same tokens up to it (the caller checks tokens; bookmarks past a point the state
        has been moved back from are invalid and must be dropped)."""
        if self.journal is not None:
            raise RuntimeError("commit or roll back the open snapshot before restoring")
        if bm.position > self.position:
            raise ValueError(f"bookmark at {bm.position} is ahead of the state ({self.position})")
        for ring, (rows, tags) in zip(self._rings(), bm.rings):
            ring.rows.copy_(rows)
            ring.tags.copy_(tags)
        self.position = bm.position
        self.stale_index_source = bm.stale_index_source

    def can_truncate(self, to: int) -> bool:
        """Whether every ring still holds the rows that positions ≥ `to` will read."""
        if not 0 <= to <= self.position:
            return False
        for ring in self._rings():
            if not bool((ring.tags >= 0).any()):
                continue  # never written (DSpark's windows without speculative decoding)
            need = torch.arange(max(0, to - ring.keep), to, device=ring.tags.device)
            if need.numel() and not bool((ring.tags[need % ring.size] == need).all()):
                return False
        return True

    def truncate(self, to: int) -> None:
        """Forget positions ≥ `to` (their rows are invisible to later forwards)."""
        if self.journal is not None:
            raise RuntimeError("commit or roll back the open snapshot before truncating")
        if not self.can_truncate(to):
            raise ValueError(f"cannot truncate to {to}: the rings no longer hold the rows "
                             "before it (restore a bookmark instead)")
        self.position = to

    # ---- inspection (tests, prefix reuse) -----------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every cache tensor by name, for bit-exact comparisons."""
        out: dict[str, torch.Tensor] = {"tokens": self.tokens[:self.position]}
        for l, ring in self.window.items():
            out[f"window.{l}.rows"], out[f"window.{l}.tags"] = ring.rows, ring.tags
        for l, ring in self.comp_tail.items():
            out[f"comp_tail.{l}.rows"], out[f"comp_tail.{l}.tags"] = ring.rows, ring.tags
        for k, ring in enumerate(self.dspark):
            out[f"dspark.{k}.rows"], out[f"dspark.{k}.tags"] = ring.rows, ring.tags
        for l, t in self.comp_kv.items():
            out[f"comp_kv.{l}"] = t[:self.position // self.cfg.ratio(l)]
        for l, t in self.index_k.items():
            out[f"index_k.{l}"] = t[:self.position // self.cfg.ratio(l)]
        return out

    def live_tensors(self) -> dict[str, torch.Tensor]:
        """What later forwards can read: ring rows in reach of the next position, caches up
        to the committed entry count. Two states that agree here decode identically."""
        out = {"tokens": self.tokens[:self.position]}
        p = self.position
        for name, rings in (("window", self.window), ("comp_tail", self.comp_tail),
                            ("dspark", dict(enumerate(self.dspark)))):
            for l, ring in rings.items():
                lo = p - ring.keep
                live = (ring.tags >= max(lo, 0)) & (ring.tags < p)
                order = torch.argsort(torch.where(live, ring.tags, torch.full_like(ring.tags, -1)))
                keep = order[live[order]]
                out[f"{name}.{l}.tags"] = ring.tags[keep]
                out[f"{name}.{l}.rows"] = ring.rows[keep]
        for l, t in self.comp_kv.items():
            out[f"comp_kv.{l}"] = t[:p // self.cfg.ratio(l)]
        for l, t in self.index_k.items():
            out[f"index_k.{l}"] = t[:p // self.cfg.ratio(l)]
        return out

    def clone(self) -> "State":
        other = object.__new__(State)
        other.__dict__.update(self.__dict__)
        other.window = {l: r.clone() for l, r in self.window.items()}
        other.comp_tail = {l: r.clone() for l, r in self.comp_tail.items()}
        other.dspark = [r.clone() for r in self.dspark]
        other.comp_kv = {l: t.clone() for l, t in self.comp_kv.items()}
        other.index_k = {l: t.clone() for l, t in self.index_k.items()}
        other.tokens = self.tokens.clone()
        other.journal = None
        other.graphs = None  # (they replay on this state's buffers, not the copy's)
        return other
