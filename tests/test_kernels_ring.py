"""A position ring's one-launch write and undo (strata.kernels.ring) against PositionRing's
torch path, under TRITON_INTERPRET=1 on CPU (tests/gpu/test_kernels_fused_ops_gpu.py runs it
compiled)."""
from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is first launched

from strata.kernels.ring import restore_entry, ring_restore, ring_write  # noqa: E402
from strata.runtime.state import Journal, PositionRing  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_write_stores_the_torch_paths_rows_and_tags(dtype):
    """Rows at positions mod size (a write that wraps), cast as torch casts (ties to even),
    tags = positions; slots not written keep their contents."""
    g = torch.Generator().manual_seed(1)
    size, shape = 8, (2, 300)  # a row past one block
    rows = torch.randn(size, *shape, generator=g).to(dtype)
    tags = torch.arange(size, dtype=torch.long) - 20
    src = torch.randn(5, *shape, generator=g) * 10
    src[0, 0, 0] = 1 + 3 * 2 ** -8  # rounds up in bf16 (to even)
    positions = torch.arange(13, 18)  # slots 5, 6, 7, 0, 1
    want_rows, want_tags = rows.clone(), tags.clone()
    want_rows[positions % size] = src.to(dtype)
    want_tags[positions % size] = positions
    ring_write(rows, tags, positions, src)
    assert torch.equal(rows, want_rows) and torch.equal(tags, want_tags)


def test_a_mismatched_write_is_refused():
    rows, tags = torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="ring write"):
        ring_write(rows, tags, torch.arange(2), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="ring write"):
        ring_write(rows, tags, torch.arange(5), torch.zeros(5, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_undo_restores_what_the_torch_undo_restores(dtype, monkeypatch):
    """A journaled window write (wrapping the ring) undone from a position inside it: the
    kernel's restore leaves the rows and tags the torch undo leaves, bit for bit."""
    from strata.kernels import ring
    g = torch.Generator().manual_seed(3)
    result = []
    for fused in (True, False):
        r = PositionRing(8, (2, 300), dtype, "cpu", keep=3)
        r.write(0, torch.arange(0, 6), torch.randn(6, 2, 300, generator=g), None)
        j = Journal(start=6)
        r.write(6, torch.arange(6, 11), torch.randn(5, 2, 300, generator=g), j)  # slots 6..2
        w = j.writes[0]
        with monkeypatch.context() as m:
            m.setattr(ring, "available", lambda rows, src: fused)
            w.undo_from(8)  # keep 6 and 7, put back what 8, 9, 10 overwrote
        result.append((r.rows, r.tags))
        g = torch.Generator().manual_seed(3)  # the same rows for the torch run
    (rows, tags), (want_rows, want_tags) = result
    assert torch.equal(rows, want_rows) and torch.equal(tags, want_tags)
    assert tags.tolist() == list(range(8))  # (slots 0-2 back to positions 0-2)


def test_a_mismatched_restore_is_refused():
    rows, tags = torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)
    slots = torch.arange(2)
    with pytest.raises(ValueError, match="ring restore"):
        restore_entry(rows, tags, slots, slots, torch.zeros(2, 3, dtype=torch.bfloat16), slots)
    with pytest.raises(ValueError, match="ring restore"):
        restore_entry(rows, tags, slots, torch.arange(3), torch.zeros(2, 3), slots)
    with pytest.raises(ValueError, match="contiguous"):  # (the entry is kept: no copies)
        restore_entry(rows, tags, slots, slots, torch.zeros(3, 2).t(), slots)
    with pytest.raises(ValueError, match="int64"):
        restore_entry(rows, tags, slots.int(), slots, torch.zeros(2, 3), slots)
    one = restore_entry(rows, tags, slots, slots, torch.zeros(2, 3), slots)
    with pytest.raises(ValueError, match="two undos into one ring"):
        ring_restore([one, one], 1)
    other = restore_entry(torch.zeros(4, 3, dtype=torch.bfloat16), tags.clone(), slots, slots,
                          torch.zeros(2, 3, dtype=torch.bfloat16), slots)
    with pytest.raises(ValueError, match="in one launch"):
        ring_restore([one, other], 1)


def test_a_replayed_writes_restore_reuses_its_table(monkeypatch):
    """A CUDA graph's recorded write, replayed (shifted) and rolled back window after window:
    its table row is made once on the recorded write, the restore's table is found by content
    (no new upload), and each rollback restores what the torch undo restores."""
    from strata.kernels import ring
    from strata.runtime.state import Journal
    g = torch.Generator().manual_seed(7)
    r, ref = (PositionRing(8, (2, 300), torch.float32, "cpu", keep=3) for _ in range(2))
    for x in (r, ref):
        x.write(0, torch.arange(0, 6), torch.randn(6, 2, 300, generator=g), None)
        g = torch.Generator().manual_seed(7)
    j = Journal(start=6)
    r.write(6, torch.arange(6, 9), torch.randn(3, 2, 300), j)
    recorded = j.writes[0]
    ring._TABLES.clear()
    for window in range(3):
        # what a replay at this window's position does: the recorded tensors get new values
        # (the slots this window displaces), the write goes to the live journal shifted
        new = torch.randn(3, 2, 300)
        for x in (r, ref):
            x.rows[recorded.slots] = new
            x.tags[recorded.slots] = recorded.positions
        recorded.old_rows.copy_(torch.randn(3, 2, 300))
        recorded.old_tags.copy_(torch.arange(3) + 10 * window)
        w = recorded.shifted(0)
        assert w.restore_entry() is recorded.restore_entry()
        with monkeypatch.context() as m:
            m.setattr(ring, "available", lambda rows, src: True)
            w.undo_from(7)
        with monkeypatch.context() as m:
            m.setattr(ring, "available", lambda rows, src: False)
            w_ref = type(w)(ref, *[getattr(w, f) for f in
                                   ("first", "kept_from", "slots", "positions", "old_rows",
                                    "old_tags")])
            w_ref.undo_from(7)
        assert torch.equal(r.rows, ref.rows) and torch.equal(r.tags, ref.tags)
        assert len(ring._TABLES) == 1


def test_a_rollback_restores_its_rings_in_few_launches_as_the_torch_undo_does(monkeypatch):
    """A journal as a verify window leaves it — writes into several rings of two dtypes —
    plus a second forward's writes into the same rings, rolled back to inside the first:
    the batched kernel leaves every ring as the torch undo does, in one launch per dtype for
    each forward's writes (a ring met again launches its dtype's batch first, so its undos
    keep their newest-first order)."""
    from strata.kernels import ring
    from strata.runtime import state as state_mod
    result, launches = [], []
    real = ring.ring_restore

    def counted(undos, to):
        launches.append(len(undos))
        real(undos, to)
    monkeypatch.setattr(ring, "ring_restore", counted)
    for fused in (True, False):
        g = torch.Generator().manual_seed(5)
        rings = [PositionRing(8, (2, 300), torch.bfloat16, "cpu", keep=3),
                 PositionRing(8, (2, 300), torch.bfloat16, "cpu", keep=3),
                 PositionRing(8, (600,), torch.float32, "cpu", keep=1)]
        for r in rings:
            r.write(0, torch.arange(0, 6), torch.randn(6, *r.rows.shape[1:], generator=g), None)
        j = Journal(start=6)
        for first, n in ((6, 4), (10, 3)):  # two forwards under one journal
            for r in rings:
                r.write(first, torch.arange(first, first + n),
                        torch.randn(n, *r.rows.shape[1:], generator=g), j)
        launches.clear()
        with monkeypatch.context() as m:
            m.setattr(ring, "available", lambda rows, src: fused)
            state_mod.undo_writes(list(reversed(j.writes)), 8)
        result.append([(r.rows.clone(), r.tags.clone()) for r in rings])
        if fused:  # newest first: the second forward's f32 and bf16 ×2, then the first's
            assert sorted(launches) == [1, 1, 2, 2], launches
    for (a, ta), (b, tb) in zip(*result):
        assert torch.equal(a, b) and torch.equal(ta, tb)
