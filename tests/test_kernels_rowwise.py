"""The batch-invariant row kernel against its torch reference, under TRITON_INTERPRET=1 on
CPU (the GPU suite runs it compiled). Small shapes: the interpreter is slow."""
from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is first launched

from strata.kernels.rowwise import rowwise_bmm, rowwise_bmm_reference  # noqa: E402


@pytest.mark.parametrize("B,M,N,K,shared", [(3, 1, 40, 70, True), (2, 4, 33, 128, False),
                                            (1, 2, 64, 64, True)])
def test_matches_reference(B, M, N, K, shared):
    g = torch.Generator().manual_seed(B * 100 + N)
    x = torch.randn(B, M, K, generator=g)
    w = torch.randn(1 if shared else B, N, K, generator=g)
    got = rowwise_bmm(x, w)
    assert got.shape == (B, M, N)
    torch.testing.assert_close(got, rowwise_bmm_reference(x, w), rtol=1e-5, atol=1e-5)


def test_strided_weight_and_batch_invariance():
    """A transposed view as w (attention output: p · rows), and each row alone == in a batch."""
    g = torch.Generator().manual_seed(1)
    p = torch.randn(5, 3, 20, generator=g)
    rows = torch.randn(5, 20, 48, generator=g)
    w = rows.transpose(1, 2)  # [B, N=48, K=20], not contiguous
    full = rowwise_bmm(p, w)
    torch.testing.assert_close(full, torch.bmm(p, rows), rtol=1e-5, atol=1e-5)
    alone = torch.cat([rowwise_bmm(p[i:i + 1], w[i:i + 1]) for i in range(5)])
    assert torch.equal(full, alone)


def test_rows_split_over_tiles_give_the_same_bits():
    """M ≥ 2 rows share a tile shape whatever M (tensor parallelism halves the heads): a split
    gives the full call's bits, with rows crossing a 64-row tile; M = 1 rows alone or batched."""
    from strata.kernels.rowwise import tile_shape
    assert tile_shape(2) == tile_shape(64) != tile_shape(1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 70, 40, generator=g)
    w = torch.randn(2, 24, 40, generator=g)
    full = rowwise_bmm(x, w)
    torch.testing.assert_close(full, rowwise_bmm_reference(x, w), rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.cat([rowwise_bmm(x[:, :10], w), rowwise_bmm(x[:, 10:], w)], 1),
                       full)
    one = rowwise_bmm(x[:, :1], w)
    assert torch.equal(torch.cat([rowwise_bmm(x[i:i + 1, :1], w[i:i + 1]) for i in range(2)]),
                       one)


def test_a_row_table_is_its_rows():
    """RowTable: rows where they lie (two allocations, offsets counted from one, negative
    ones included) as w give the gathered rows' products bit for bit (q·k; p·v:
    tests/test_kernels_attention.py)."""
    from strata.kernels.rowwise import RowTable
    g = torch.Generator().manual_seed(9)
    B, n, hd = 3, 150, 48  # (row starts a multiple of 16 elements, as a RowTable's are)
    a = torch.randn(70, hd, generator=g).bfloat16()
    b = torch.randn(70, hd, generator=g).bfloat16()
    a, b = (a, b) if a.data_ptr() > b.data_ptr() else (b, a)  # (b's rows: negative offsets)
    from_b = torch.rand(B, n, generator=g) < 0.5
    ia, ib = torch.randint(0, 70, (B, n), generator=g), torch.randint(0, 70, (B, n), generator=g)
    rows = torch.where(from_b[..., None], b[ib], a[ia])
    offsets = torch.where(from_b, (b.data_ptr() - a.data_ptr()) // 2 + ib * hd, ia * hd)
    assert (offsets < 0).any() and (offsets % 16 == 0).all()
    table = RowTable(a, offsets, hd)
    assert table.shape == rows.shape and table.rows(1, 3).shape == (2, n, hd)
    q = torch.randn(B, 5, hd, generator=g).bfloat16()
    assert torch.equal(rowwise_bmm(q, table, out_dtype=torch.float32),
                       rowwise_bmm(q, rows, out_dtype=torch.float32))
    assert torch.equal(rowwise_bmm(q[1:3], table.rows(1, 3), out_dtype=torch.float32),
                       rowwise_bmm(q[1:3], rows[1:3], out_dtype=torch.float32))


def test_shape_mismatch():
    with pytest.raises(ValueError, match="do not match"):
        rowwise_bmm(torch.zeros(2, 1, 8), torch.zeros(1, 4, 9))


@pytest.mark.parametrize("M", [1, 3])
def test_long_reductions_split_over_k_chunks(M):
    """K past the chunk size runs as chunks in parallel, added in chunk order (the partition
    depends on K alone): the reference's values, each batch element's bits alone or batched.
    (The chunk is lowered to 64 here to keep the interpreter's shapes small.)"""
    g = torch.Generator().manual_seed(M)
    x = torch.randn(3, M, 200, generator=g)
    w = torch.randn(1, 24, 200, generator=g)
    full = rowwise_bmm(x, w, k_chunk=64)
    torch.testing.assert_close(full, rowwise_bmm_reference(x, w), rtol=1e-5, atol=1e-4)
    assert torch.equal(torch.cat([rowwise_bmm(x[i:i + 1], w, k_chunk=64) for i in range(3)]),
                       full)
    one = rowwise_bmm(x, w, k_chunk=256)  # a single chunk: the unsplit kernel
    torch.testing.assert_close(one, full, rtol=1e-5, atol=1e-4)


def test_16_bit_and_mixed_operands_accumulate_in_fp32():
    """bf16 pairs (the tile kernel's tensor-core path) and an fp32 × bf16 pair, written as fp32:
    the exact products summed in fp32 (the reference on the widened operands), rows alone
    equal rows in a batch and across a head split."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 20, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(3, 24, 64, generator=g).to(torch.bfloat16)
    for a in (x, x.float()):
        got = rowwise_bmm(a, w, out_dtype=torch.float32)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, rowwise_bmm_reference(a.float(), w.float()),
                                   rtol=1e-5, atol=1e-5)
        assert torch.equal(torch.cat([rowwise_bmm(a[i:i + 1], w[i:i + 1],
                                                  out_dtype=torch.float32) for i in range(3)]),
                           got)
        assert torch.equal(torch.cat([rowwise_bmm(a[:, :7], w, out_dtype=torch.float32),
                                      rowwise_bmm(a[:, 7:], w, out_dtype=torch.float32)], 1),
                           got)


@pytest.mark.parametrize("chunks", [1, 4, 7, 9])
def test_chunk_sums_add_in_chunk_order(chunks):
    """The K chunks' partials are added in chunk order, element by element, whatever the
    unrolling: the bits of a plain left-to-right fp32 sum (-0.0 partials included)."""
    import triton

    from strata.kernels.rowwise import _chunk_sum_kernel
    g = torch.Generator().manual_seed(chunks)
    n = 1500  # past one block
    part = torch.randn(chunks, n, generator=g) * torch.logspace(-6, 6, n)
    part[:, 0] = -0.0
    want = torch.zeros(n)
    for c in range(chunks):
        want = want + part[c]
    got = torch.empty(n)
    _chunk_sum_kernel[(triton.cdiv(n, 1024),)](part, got, n, chunks, BLOCK=1024, PDL=False)
    assert torch.equal(got, want)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # (signed zeros too)


def test_products_follow_dtypes_and_structural_m():
    from strata.kernels.rowwise import Product, product
    f32, b16 = torch.zeros(1, 2, 8), torch.zeros(1, 2, 8, dtype=torch.bfloat16)
    assert product(1, b16, b16) == Product.ROW
    # (16-bit tiles and the split need the compiled kernel: the interpreter takes fp32 FMAs)
    assert product(2, b16, b16) == product(2, f32, b16) == Product.FMA


def test_row_tiles_give_a_row_alone_its_bits_among_many():
    """rowwise_rows' fixed row tile (ROWS_TILE) for the rows of a row_matmul: one decode row
    runs the tile a prefill's rows share, so it gets the same bits alone; K chunked."""
    from strata.kernels.rowwise import ROWS_TILE
    g = torch.Generator().manual_seed(5)
    x = torch.randn(37, 200, generator=g)
    w = torch.randn(24, 200, generator=g)
    full = rowwise_bmm(x[None], w[None], k_chunk=64, tile=ROWS_TILE)[0]
    torch.testing.assert_close(full, x @ w.T, rtol=1e-5, atol=1e-4)
    for t in (0, 16, 36):  # in the first tile, at a tile's start, in the last partial tile
        assert torch.equal(rowwise_bmm(x[None, t:t + 1], w[None], k_chunk=64,
                                       tile=ROWS_TILE)[0], full[t:t + 1])


def test_dense_linear_16_bit_weight_keeps_no_fp32_copy():
    """A bf16 weight with a bf16 input and an fp32 output (the router): the widened
    operands' products without an fp32 copy of the weight — the old path's bits on CPU."""
    from strata.model.numerics import Numerics, row_matmul
    from strata.quant.linear import DenseLinear
    g = torch.Generator().manual_seed(6)
    w = torch.randn(24, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    lin = DenseLinear(w)
    y = lin(x, Numerics(act_dtype=torch.bfloat16), torch.float32)
    assert y.dtype == torch.float32 and torch.float32 not in lin._dense
    assert torch.equal(y, row_matmul(x, w.float(), torch.float32))
