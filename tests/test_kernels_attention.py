"""The attention's one-launch sink softmax (strata.kernels.attention) against the torch
steps of strata.model.attention.sparse_attention, under TRITON_INTERPRET=1 on CPU
(tests/gpu/test_kernels_fused_ops_gpu.py runs it compiled)."""
from __future__ import annotations

import os

import torch

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is first launched

from strata.kernels.attention import sink_softmax  # noqa: E402


def torch_steps(s, mask, sink, scale):
    T, H, _ = s.shape
    s = (s * scale).masked_fill(~mask[:, None, :], float("-inf"))
    s = torch.cat((s, sink.view(1, H, 1).expand(T, H, 1)), dim=-1)
    return torch.softmax(s, dim=-1)[..., :-1]


def test_matches_the_torch_steps_and_rows_stand_alone():
    g = torch.Generator().manual_seed(0)
    T, H, n = 5, 3, 40
    s = torch.randn(T, H, n, generator=g) * 30
    mask = torch.rand(T, n, generator=g) > 0.3
    mask[1] = False            # nothing visible: every probability 0, the sink takes it all
    mask[2] = True
    sink = torch.randn(H, generator=g) * 3
    sink[0] = 80.0             # a sink above every score
    got = sink_softmax(s, mask, sink, 0.125)
    want = torch_steps(s, mask, sink, 0.125)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-9)
    assert torch.equal(got[1], torch.zeros(H, n))
    assert torch.equal(sink_softmax(s[3:4], mask[3:4], sink, 0.125), got[3:4])
    # a transposed scores view (any strides) gives the same rows
    st = s.transpose(0, 1).contiguous().transpose(0, 1)
    assert torch.equal(sink_softmax(st, mask, sink, 0.125), got)
    # as the exact split p·v takes (rowwise.planes_bmm): three bf16 planes summing to p
    planes = sink_softmax(s, mask, sink, 0.125, planes=True)
    assert planes.shape == (3, T, H, n) and planes.dtype == torch.bfloat16
    # (exact down to fp32's tiny values, whose low parts fall below bf16's normal range)
    normal = got.abs() > 2.0 ** -100
    assert torch.equal(planes.double().sum(0)[normal], got.double()[normal])
    torch.testing.assert_close(planes.double().sum(0), got.double(), rtol=0, atol=2.0 ** -120)


def test_writes_into_a_given_buffer_and_rejects_a_wrong_one():
    """attend_pieces' pieces reuse one buffer (a prefix of it when the last piece is short):
    the values are a fresh call's, in the buffer; a buffer of the wrong shape, dtype or layout
    is refused by name."""
    import pytest
    g = torch.Generator().manual_seed(1)
    T, H, n = 3, 2, 24
    s = torch.randn(T, H, n, generator=g) * 10
    mask = torch.rand(T, n, generator=g) > 0.3
    sink = torch.randn(H, generator=g)
    planes_buf = torch.full((3, T + 2, H, n), 7.0, dtype=torch.bfloat16)
    got = sink_softmax(s, mask, sink, 0.5, planes=True, out=planes_buf[:, :T])
    assert got.data_ptr() == planes_buf.data_ptr()
    assert torch.equal(got, sink_softmax(s, mask, sink, 0.5, planes=True))
    assert torch.equal(planes_buf[:, T:], torch.full((3, 2, H, n), 7.0, dtype=torch.bfloat16))
    p_buf = torch.empty(T + 1, H, n)
    assert torch.equal(sink_softmax(s, mask, sink, 0.5, out=p_buf[:T]),
                       sink_softmax(s, mask, sink, 0.5))
    for bad in (torch.empty(T, H, n), torch.empty(3, T, H, n + 1, dtype=torch.bfloat16),
                torch.empty(3, T, n, H, dtype=torch.bfloat16).transpose(2, 3)):
        with pytest.raises(ValueError, match="sink_softmax: out must be"):
            sink_softmax(s, mask, sink, 0.5, planes=True, out=bad)


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
    queries read every element exactly (rowwise_bmm(I, rows) = rowsᵀ), p·v reads them as its
    transposed operand; the mask is gather_rows'. Sources of mixed dtypes are refused."""
    import pytest

    from strata.kernels.attention import gather_rows, row_table
    from strata.kernels.rowwise import planes_bmm, rowwise_bmm, split_planes
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
        p = torch.softmax(torch.randn(rows.shape[0], 3, rows.shape[1], generator=g), -1)
        planes = split_planes(p)
        assert torch.equal(planes_bmm(planes, table.transposed()),
                           planes_bmm(planes, rows.transpose(1, 2)))
        # a piece of the queries: its own table, the same rows
        piece, _ = row_table(kv, ring.rows, ring.tags, tuple(w[3:7] for w in window), c,
                             None if s is None else s[3:7])
        assert torch.equal(rowwise_bmm(eye[3:7], piece, out_dtype=torch.float32), got[3:7])
    with pytest.raises(ValueError, match="kv's dtype"):
        row_table(kv, ring.rows, ring.tags, window, cache.float(), sel)
    with pytest.raises(ValueError, match="aligned"):  # (rows 63 elements apart)
        row_table(kv, ring.rows, ring.tags, window, cache.view(-1)[:29 * 63].view(29, 63), sel)
