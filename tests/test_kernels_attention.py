"""The attention's sink softmax and p·v (strata.kernels.attention.sink_softmax_pv) against the
torch steps of strata.model.attention.sparse_attention, under TRITON_INTERPRET=1 on CPU
(tests/gpu/test_kernels_fused_ops_gpu.py runs it compiled)."""
from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is first launched

from strata.kernels.attention import sink_softmax_pv  # noqa: E402


def torch_steps(s, mask, sink, scale, rows):
    """sparse_attention's torch path after the scores, in float64."""
    T, H, _ = s.shape
    s = (s.double() * scale).masked_fill(~mask[:, None, :], float("-inf"))
    s = torch.cat((s, sink.double().view(1, H, 1).expand(T, H, 1)), dim=-1)
    return torch.softmax(s, dim=-1)[..., :-1] @ rows.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_torch_steps_and_queries_stand_alone(dtype):
    """fp32 rows (IEEE products) and bf16 rows (p split into three exact bf16 products), 70
    heads (two head blocks), rows in one K chunk and in three: the torch steps' output to
    fp32 rounding; a query alone, a transposed scores view and rows masked after a query's
    last visible one give the batch's bits."""
    g = torch.Generator().manual_seed(0)
    T, H, n, hd = 4, 70, 150, 40
    s = torch.randn(T, H, n, generator=g) * 30
    mask = torch.rand(T, n, generator=g) > 0.3
    mask[1] = False            # nothing visible: every probability 0, the sink takes it all
    mask[2] = True
    sink = torch.randn(H, generator=g) * 3
    sink[0] = 80.0             # a sink above every score
    rows = torch.randn(T, n, hd, generator=g).to(dtype)
    for k_chunk in (1024, 64):
        got = sink_softmax_pv(s, mask, sink, 0.125, rows, k_chunk=k_chunk)
        assert got.dtype == torch.float32 and got.shape == (T, H, hd)
        torch.testing.assert_close(got.double(), torch_steps(s, mask, sink, 0.125, rows),
                                   rtol=1e-5, atol=1e-6)
        assert torch.equal(got[1], torch.zeros(H, hd)) and got[:, 0].abs().max() < 1e-20
        assert torch.equal(sink_softmax_pv(s[3:4], mask[3:4], sink, 0.125, rows[3:4],
                                           k_chunk=k_chunk), got[3:4])
        st = s.transpose(0, 1).contiguous().transpose(0, 1)
        assert torch.equal(sink_softmax_pv(st, mask, sink, 0.125, rows, k_chunk=k_chunk), got)
        # (a decode step's query has fewer rows than a chunk's: the extra ones are masked)
        more = torch.cat((s, torch.randn(T, H, 50, generator=g)), -1)
        hidden = torch.cat((mask, torch.zeros(T, 50, dtype=torch.bool)), -1)
        more_rows = torch.cat((rows, torch.randn(T, 50, hd, generator=g).to(dtype)), 1)
        assert torch.equal(sink_softmax_pv(more, hidden, sink, 0.125, more_rows,
                                           k_chunk=k_chunk), got), k_chunk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stored_p_of_a_few_queries_gives_a_pieces_bits(dtype):
    """At most SMALL_BATCH queries (a decode step, a verify window) have p formed and stored by
    a launch of its own; a prefill piece's p·v forms it itself: the same queries give the
    same bits either way, in one K chunk and in two."""
    from strata.kernels.rowwise import SMALL_BATCH
    g = torch.Generator().manual_seed(5)
    T, H, n, hd = SMALL_BATCH + 4, 8, 100, 32
    s = torch.randn(T, H, n, generator=g) * 20
    mask = torch.rand(T, n, generator=g) > 0.3
    mask[0] = False
    sink = torch.randn(H, generator=g)
    rows = torch.randn(T, n, hd, generator=g).to(dtype)
    for k_chunk in (1024, 64):
        piece = sink_softmax_pv(s, mask, sink, 0.25, rows, k_chunk=k_chunk)
        for i, j in ((0, 1), (1, 7), (7, 7 + SMALL_BATCH)):
            assert torch.equal(sink_softmax_pv(s[i:j], mask[i:j], sink, 0.25, rows[i:j],
                                               k_chunk=k_chunk), piece[i:j]), (k_chunk, i)


def test_writes_into_a_given_buffer_and_rejects_a_wrong_one():
    """attend_pieces' pieces write into slices of one output: the values are a fresh call's,
    in the slice; an output of the wrong shape, dtype or layout, and rows that do not match
    the scores, are refused by name."""
    g = torch.Generator().manual_seed(1)
    T, H, n, hd = 3, 2, 24, 16
    s = torch.randn(T, H, n, generator=g) * 10
    mask = torch.rand(T, n, generator=g) > 0.3
    sink = torch.randn(H, generator=g)
    rows = torch.randn(T, n, hd, generator=g).bfloat16()
    buf = torch.full((T + 2, H, hd), 7.0)
    got = sink_softmax_pv(s, mask, sink, 0.5, rows, out=buf[:T])
    assert got.data_ptr() == buf.data_ptr()
    assert torch.equal(got, sink_softmax_pv(s, mask, sink, 0.5, rows))
    assert torch.equal(buf[T:], torch.full((2, H, hd), 7.0))
    for bad in (torch.empty(T, H, hd, dtype=torch.bfloat16), torch.empty(T, H, hd + 1),
                torch.empty(T, hd, H).transpose(1, 2)):
        with pytest.raises(ValueError, match="sink_softmax_pv: out must be"):
            sink_softmax_pv(s, mask, sink, 0.5, rows, out=bad)
    with pytest.raises(ValueError, match="do not match"):
        sink_softmax_pv(s, mask, sink, 0.5, rows[:, 1:])


def _window(positions, W, ring_size):
    """ForwardContext.window for these positions (it reads only them: no config needed)."""
    from strata.model.context import ForwardContext
    ctx = ForwardContext(cfg=None, numerics=None, start=0, positions=positions)
    return ctx.window(W, ring_size)


def test_gather_rows_is_the_torch_path_bit_for_bit():
    """A chunk of 10 queries at positions 20..29 with a window of 8 over a ring of 12 slots
    (some slots stale, some never written) and 5 compressed picks (−1 = empty): the joined
    rows and mask equal the torch path's, for the whole chunk and for a piece of it."""
    from strata.kernels.attention import gather_rows as kernel_rows
    from strata.model import attention as A
    from strata.runtime.state import PositionRing
    g = torch.Generator().manual_seed(5)
    W, S, hd = 8, 12, 40
    for dtype in (torch.float32, torch.bfloat16):
        ring = PositionRing(S, (hd,), dtype, "cpu", keep=W - 1)
        ring.rows.copy_(torch.randn(S, hd, generator=g).to(dtype))
        ring.tags.copy_(torch.tensor([12, 13, 2, 15, 16, 17, 18, 19, -1, -1, 10, 11]))
        positions = torch.arange(20, 30)
        kv = torch.randn(10, hd, generator=g).to(dtype)
        window = _window(positions, W, S)
        cache = torch.randn(30, hd, generator=g).to(dtype)
        sel = torch.randint(-1, 30, (10, 5), generator=g)
        for c, s in ((None, None), (cache, sel)):
            want = A.gather_rows(kv, ring, window, c, s)  # (on CPU: the torch path)
            dt = A.rows_dtype(kv, ring, c)
            got = kernel_rows(kv, ring.rows, ring.tags, window, c, s, dt)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            piece = kernel_rows(kv, ring.rows, ring.tags, tuple(w[3:7] for w in window), c,
                                None if s is None else s[3:7], dt)
            assert torch.equal(piece[0], want[0][3:7]) and torch.equal(piece[1], want[1][3:7])


def test_row_table_reads_the_gathered_rows_where_they_lie():
    """row_table: the rows where they lie (this forward's kv, the ring, the cache — three
    allocations) as the products' w give gather_rows' copy's results bit for bit: one-hot
    queries read every element exactly (rowwise_bmm(I, rows) = rowsᵀ), and p·v (the softmax's
    launch) reads them as its rows; the mask is gather_rows'. Sources of mixed dtypes are
    refused."""
    from strata.kernels.attention import gather_rows, row_table
    from strata.kernels.rowwise import rowwise_bmm
    from strata.runtime.state import PositionRing
    g = torch.Generator().manual_seed(6)
    W, S, hd, dt = 8, 12, 64, torch.bfloat16
    ring = PositionRing(S, (hd,), dt, "cpu", keep=W - 1)
    ring.rows.copy_(torch.randn(S, hd, generator=g).to(dt))
    ring.tags.copy_(torch.tensor([12, 13, 2, 15, 16, 17, 18, 19, -1, -1, 10, 11]))
    kv = torch.randn(10, hd, generator=g).to(dt)
    window = _window(torch.arange(20, 30), W, S)
    cache = torch.randn(30, hd, generator=g).to(dt)
    sel = torch.randint(-1, 30, (10, 5), generator=g)
    for c, s in ((None, None), (cache, sel)):
        rows, mask = gather_rows(kv, ring.rows, ring.tags, window, c, s, dt)
        table, tmask = row_table(kv, ring.rows, ring.tags, window, c, s)
        assert table.shape == rows.shape and torch.equal(tmask, mask)
        eye = torch.eye(hd, dtype=dt).expand(rows.shape[0], -1, -1)
        got = rowwise_bmm(eye, table, out_dtype=torch.float32)
        assert torch.equal(got, rows.transpose(1, 2).float())
        scores = torch.randn(rows.shape[0], 3, rows.shape[1], generator=g) * 4
        sink = torch.randn(3, generator=g)
        for k_chunk in (1024, 64):
            assert torch.equal(sink_softmax_pv(scores, mask, sink, 0.5, table, k_chunk=k_chunk),
                               sink_softmax_pv(scores, mask, sink, 0.5, rows, k_chunk=k_chunk))
        # a piece of the queries: its own table, the same rows
        piece, _ = row_table(kv, ring.rows, ring.tags, tuple(w[3:7] for w in window), c,
                             None if s is None else s[3:7])
        assert torch.equal(rowwise_bmm(eye[3:7], piece, out_dtype=torch.float32), got[3:7])
    with pytest.raises(ValueError, match="kv's dtype"):
        row_table(kv, ring.rows, ring.tags, window, cache.float(), sel)
    with pytest.raises(ValueError, match="aligned"):  # (rows 63 elements apart)
        row_table(kv, ring.rows, ring.tags, window, cache.view(-1)[:29 * 63].view(29, 63), sel)
