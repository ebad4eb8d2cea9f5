"""GPU suite (pytest -m gpu tests/gpu): the parity ladder on CUDA and CUDA-vs-CPU greedy tokens.

Run on the device machine. These fail (not skip) without CUDA: asking for the GPU suite on a
machine without a GPU is a mistake to report.
"""
from __future__ import annotations


import pytest
import torch

from tests.gpu.conftest import record

from strata.model.model import Model
from strata.model.numerics import Numerics
from strata.runtime.session import Session
from util import forward_100_then_rest, random_tokens, same_runs

pytestmark = pytest.mark.gpu

N = 300




def chunks(model, tokens, size):
    state = model.new_state(1024)
    return torch.cat([model.forward(tokens[i:i + size], state)[0]
                      for i in range(0, tokens.numel(), size)])


@pytest.mark.parametrize("mode", ["reference", "vendor"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_parity_ladder(cuda, tiny_dir, mode, dtype):
    model = Model.load(tiny_dir, cuda, Numerics.for_device(cuda, mode, dtype))
    tokens = random_tokens(N, seed=1).to(cuda)
    full = chunks(model, tokens, N)
    diffs = {}
    for size in (1, 7, 129):
        got = chunks(model, tokens, size)
        diffs[size] = float((got - full).abs().max() / full.abs().max())
    record(test="parity", mode=mode, dtype=dtype, max_rel_diff=diffs,
           bit_identical={k: v == 0.0 for k, v in diffs.items()})
    # Tolerance: none. Every token-dim product goes through the fixed-order row kernel
    # (strata.kernels.rowwise), so decode, chunks and prefill are bit-identical on CUDA too.
    for size, d in diffs.items():
        assert d == 0.0, f"chunk {size}: relative diff {d}"


def test_rowwise_kernel_compiled(cuda):
    from strata.kernels.rowwise import rowwise_bmm, rowwise_bmm_reference
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(37, 4, 1536, generator=g).to(cuda, dtype)
        w = torch.randn(1, 640, 1536, generator=g).to(cuda, dtype)
        full = rowwise_bmm(x, w)
        ref = rowwise_bmm_reference(x.float(), w.float())
        torch.testing.assert_close(full.float(), ref, rtol=2e-2 if dtype == torch.bfloat16 else 1e-4,
                                   atol=2e-1 if dtype == torch.bfloat16 else 1e-3)
        alone = torch.cat([rowwise_bmm(x[i:i + 1, j:j + 1], w) for i in range(37)
                           for j in range(4)]).view(37, 4, 640)
        # One row alone runs the 1-row tile, the batch a row tile: the same products
        # summed in another order (rounding apart, ~1e-6 of the |values| ≈ 40 here).
        tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=0.1)
        torch.testing.assert_close(alone, full, **tol)
        # Bit-identical where it matters: each batch element alone (decode vs prefill), and
        # M ≥ 2 rows split in halves (heads over two tensor-parallel ranks)...
        assert torch.equal(torch.cat([rowwise_bmm(x[i:i + 1], w) for i in range(37)]), full)
        assert torch.equal(torch.cat([rowwise_bmm(x[:, :2], w), rowwise_bmm(x[:, 2:], w)],
                                     dim=1), full)
        # ... and single rows (M = 1 call sites) alone or in a batch.
        assert torch.equal(torch.cat([rowwise_bmm(x[i:i + 1, :1], w) for i in range(37)]),
                           rowwise_bmm(x[:, :1], w))
    # Attention's shapes (64 heads over one query's 640 rows of 512, and back): a head's
    # output does not depend on the query's batch or on a 32/32 head split.
    q = torch.randn(3, 64, 512, generator=g).to(cuda)
    rows = torch.randn(3, 640, 512, generator=g).to(cuda)
    s = rowwise_bmm(q, rows)
    torch.testing.assert_close(s, rowwise_bmm_reference(q, rows), rtol=1e-4, atol=1e-3)
    o = rowwise_bmm(s, rows.transpose(1, 2))
    assert torch.equal(torch.cat([rowwise_bmm(s[:, :32], rows.transpose(1, 2)),
                                  rowwise_bmm(s[:, 32:], rows.transpose(1, 2))], dim=1), o)
    assert torch.equal(rowwise_bmm(s[1:2], rows[1:2].transpose(1, 2)), o[1:2])


def test_rowwise_split_and_row_tiles_compiled(cuda):
    """The tensor-core products added for prefill: attention's p·v (fp32 p against bf16 rows,
    p split exactly into three bf16) and row_matmul's 16-bit rows sharing row tiles (the
    router). Within fp32 rounding of the exact sums; a row's bits the same alone, in a batch
    and across a head split."""
    from strata.kernels.rowwise import Product, product, rowwise_bmm, rowwise_rows
    g = torch.Generator().manual_seed(7)
    p = torch.rand(5, 64, 640, generator=g).to(cuda)
    p = p / p.sum(-1, keepdim=True)  # softmax-like rows
    rows = torch.randn(5, 640, 512, generator=g).to(cuda, torch.bfloat16)
    v = rows.transpose(1, 2)
    assert product(64, p, v) == Product.SPLIT
    o = rowwise_bmm(p, v)
    exact = torch.bmm(p.double(), rows.double())
    torch.testing.assert_close(o.double(), exact, rtol=1e-5, atol=1e-6)
    assert torch.equal(torch.cat([rowwise_bmm(p[:, :32], v), rowwise_bmm(p[:, 32:], v)], 1), o)
    assert torch.equal(torch.cat([rowwise_bmm(p[i:i + 1], v[i:i + 1]) for i in range(5)]), o)
    x = torch.randn(37, 5120, generator=g).to(cuda, torch.bfloat16)
    w = (torch.randn(384, 5120, generator=g) * 0.02).to(cuda, torch.bfloat16)
    y = rowwise_rows(x, w, torch.float32)
    torch.testing.assert_close(y.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-4)
    for t in (0, 16, 36):
        assert torch.equal(rowwise_rows(x[t:t + 1], w, torch.float32), y[t:t + 1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_softmax_pv_compiled_queries_stand_alone(cuda, dtype):
    """Attention's softmax and p·v (sink_softmax_pv), compiled at V4.1's shapes (64 heads,
    rows of 512): near the float64 torch steps; a decode query, a verify window (p formed and
    stored before the product) and the rest of a prefill piece (p formed in the product; each
    its own tile width) give the batch's bits; rows in one K chunk, past one, and masked rows
    after each query's last visible one (a decode query has fewer rows than a chunk's — here
    also one chunk against two) change no bit; a RowTable of the rows gives the rows' bits."""
    from strata.kernels.attention import sink_softmax_pv
    from strata.kernels.rowwise import RowTable
    g = torch.Generator().manual_seed(9)
    sink = torch.randn(64, generator=g).to(cuda)
    for T, n, extra in ((40, 640, 100), (7, 1000, 100), (8, 1500, 60)):
        s = (torch.randn(T, 64, n + extra, generator=g) * 4).to(cuda)
        mask = (torch.rand(T, n + extra, generator=g) > 0.2).to(cuda)
        rows = torch.randn(T, n + extra, 512, generator=g).to(cuda, dtype)
        got = sink_softmax_pv(s[..., :n], mask[:, :n], sink, 0.044, rows[:, :n].contiguous())
        x = (s[..., :n].double() * 0.044).masked_fill(~mask[:, None, :n], float("-inf"))
        x = torch.cat((x, sink.double().view(1, 64, 1).expand(T, 64, 1)), -1)
        want = torch.softmax(x, -1)[..., :-1] @ rows[:, :n].double()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
        for i, j in ((0, 1), (1, 7), (7, T)):
            assert torch.equal(sink_softmax_pv(s[i:j, :, :n], mask[i:j, :n], sink, 0.044,
                                               rows[i:j, :n]), got[i:j]), (T, n, i)
        hidden = mask.clone()
        hidden[:, n:] = False
        assert torch.equal(sink_softmax_pv(s, hidden, sink, 0.044, rows), got), (T, n)
        flat = rows[:, :n].reshape(-1, 512)
        table = RowTable(flat, torch.arange(T * n, device=cuda).view(T, n) * 512, 512)
        assert torch.equal(sink_softmax_pv(s[..., :n], mask[:, :n], sink, 0.044, table), got)


@pytest.mark.parametrize("preset_dir", ["tiny_dir", "real_vocab_dir"])
def test_cuda_greedy_tokens_match_cpu(cuda, request, preset_dir):
    path = request.getfixturevalue(preset_dir)
    vocab = 320 if preset_dir == "tiny_dir" else 129280
    prompt = random_tokens(64, seed=11, vocab=vocab)
    out = {}
    for dev in ("cpu", "cuda"):
        model = Model.load(path, dev, Numerics(mode="reference", act_dtype=torch.float32))
        out[dev] = Session(model, 160).run(prompt, 64, stop_ids=frozenset()).tokens
    bf16 = Model.load(path, cuda, Numerics(mode="vendor", act_dtype=torch.bfloat16))
    out["cuda-bf16-vendor"] = Session(bf16, 160).run(prompt, 64, stop_ids=frozenset()).tokens
    agree = sum(a == b for a, b in zip(out["cpu"], out["cuda-bf16-vendor"])) / 64
    record(test="greedy", preset=preset_dir, cpu=out["cpu"], cuda=out["cuda"],
           cuda_bf16_vendor=out["cuda-bf16-vendor"], bf16_vendor_agreement=agree)
    assert out["cuda"] == out["cpu"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_dspark_equals_plain(cuda, tiny_dir, dtype):
    from strata.runtime.sampling import SamplingParams
    from strata.runtime.speculative import SpecConfig
    model = Model.load(tiny_dir, cuda, Numerics.for_device(cuda, "vendor", dtype))
    prompt = random_tokens(124, seed=3)
    for params in (SamplingParams(), SamplingParams(temperature=0.9, top_p=0.9, seed=4)):
        plain = Session(model, 256).run(prompt, 40, params, stop_ids=frozenset()).tokens
        s = Session(model, 256, speculative=SpecConfig(length=5, low_windows=10**6))
        spec = s.run(prompt, 40, params, stop_ids=frozenset()).tokens
        record(test="dspark", dtype=dtype, temperature=params.temperature,
               equal=spec == plain, windows=s.stats.windows,
               mean_committed=s.stats.mean_committed)
        assert spec == plain


def test_attention_pieces_slice_one_row_table(cuda, tiny_dir, monkeypatch):
    """On CUDA, where the key rows are a RowTable, a forward's queries get their row starts in
    one launch and the pieces slice them: row_table runs once per attention layer per forward
    (the forward's full query count), the pieces are ATTN_SCRATCH's size, and logits and every
    cache row equal one piece's, bit for bit."""
    from strata.kernels import attention as attn_kernels
    from strata.model import attention
    model = Model.load(tiny_dir, cuda, Numerics.for_device(cuda, "vendor", "bfloat16"))
    tokens = random_tokens(150, seed=9, vocab=model.cfg.vocab_size).to(cuda)
    tables, sizes = [], []
    row_table, attend = attn_kernels.row_table, attention.Attention.attend_heads
    monkeypatch.setattr(attn_kernels, "row_table", lambda kv, rows, tags, window, *a:
                        tables.append(len(window[0])) or row_table(kv, rows, tags, window, *a))
    monkeypatch.setattr(attention.Attention, "attend_heads",
                        lambda self, q, *a, **kw: sizes.append(len(q)) or attend(self, q, *a, **kw))
    runs = []
    for scratch, want in ((None, {100, 50}), (32, {32, 100 % 32, 50 % 32})):
        if scratch is not None:  # (in units of a query's scratch)
            monkeypatch.setattr(attention, "scratch_per_query", lambda *a: 1)
            monkeypatch.setattr(attention, "ATTN_SCRATCH", scratch)
        tables.clear()
        sizes.clear()
        runs.append(forward_100_then_rest(model, tokens))
        assert set(sizes) == want, (scratch, sorted(set(sizes)))
        assert tables and set(tables) == {100, 50}, sorted(set(tables))
    same_runs(runs)
