"""The fused small-op kernels on CUDA (pytest -m gpu): mHC collapse, hc_update, RoPE, the qdq
steps, the MoE's slot sum and the attention's row gather give the torch code's bits, routing,
ranked_topk's keys and greedy argmax its picks; mHC's coefficients, RMSNorm, the SwiGLU, the
sink softmax, the Engram gate and the indexer's scores stay within fp32 rounding of it, and
their rows do not depend on the other rows of the call; the Engram row ids hashed on the
device are the host's. V4.1 shapes (H = 4, D = 5120)."""
from __future__ import annotations

import pytest
import torch

from strata.kernels import mhc as K
from strata.model import mhc as ref
from strata.model.mhc import HcWeights

pytestmark = pytest.mark.gpu


def torch_path(monkeypatch, fn, *args, **kwargs):
    """The torch definitions on CUDA (the fused kernels switched off for the call)."""
    from strata.kernels import attention, indexer, moe_ops, norm, qdq, ranking, rope
    with monkeypatch.context() as m:
        for module in (K, attention, indexer, moe_ops, norm, qdq, ranking, rope):
            m.setattr(module, "available", lambda t: False)
        return fn(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_collapse_and_update_equal_the_torch_code(cuda, monkeypatch, dtype):
    T, H, D = 37, 4, 5120
    g = torch.Generator().manual_seed(3)
    h = torch.randn(T, H, D, generator=g).to(cuda, dtype)
    pre = torch.rand(T, H, generator=g).to(cuda)
    y = torch.randn(T, D, generator=g).to(cuda, dtype)
    post = (torch.rand(T, H, generator=g) * 2).to(cuda)
    comb = torch.softmax(torch.randn(T, H, H, generator=g), -1).to(cuda)
    assert torch.equal(ref.collapse(h, pre), torch_path(monkeypatch, ref.collapse, h, pre))
    assert torch.equal(ref.hc_update(y, h, post, comb),
                       torch_path(monkeypatch, ref.hc_update, y, h, post, comb))
    # a sublayer's input in one launch: the collapse kernel's and the norm kernel's bits
    from strata.kernels import norm
    w = torch.randn(D, generator=g).to(cuda, dtype)
    assert torch.equal(ref.collapse_norm(h, pre, w, 1e-6),
                       norm.rms_norm(ref.collapse(h, pre), w, 1e-6))


def test_hc_coeffs_near_the_torch_code_and_row_invariant(cuda, monkeypatch):
    T, H, D = 37, 4, 5120
    g = torch.Generator().manual_seed(4)
    n = (2 + H) * H
    w = HcWeights(fn=(torch.randn(n, H * D, generator=g) * (H * D) ** -0.5).to(cuda),
                  base=(torch.randn(n, generator=g) * 0.5).to(cuda),
                  scale=(torch.rand(3, generator=g) + 0.5).to(cuda))
    h = (torch.randn(T, H, D, generator=g) * 3).to(cuda, torch.bfloat16)
    got = ref.hc_mixes(h, w, 1e-6, 1e-6, 20)
    want = torch_path(monkeypatch, ref.hc_mixes, h, w, 1e-6, 1e-6, 20)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (a - b).abs().max()
    alone = ref.hc_mixes(h[20:21], w, 1e-6, 1e-6, 20)
    for a, full in zip(alone, got):
        assert torch.equal(a[0], full[20])


def test_hc_mix_of_a_bf16_stream_on_tensor_cores(cuda):
    """hc_mix for a bf16 stream: fn split exactly into three bf16, each product exact in fp32
    — within fp32 rounding of the float64 sums; one decode row (a program of 16 rows) has its
    bits in a prefill's batch (programs of 64 rows; a row past the first block included)."""
    T, H, D = 70, 4, 5120
    g = torch.Generator().manual_seed(12)
    fn = (torch.randn(24, H * D, generator=g) * (H * D) ** -0.5).to(cuda)
    h = (torch.randn(T, H, D, generator=g) * 3).to(cuda, torch.bfloat16)
    assert K.mix_split(h)
    m, sq = K.hc_mix(h, fn)
    x = h.double().reshape(T, -1)
    torch.testing.assert_close(m.double(), x @ fn.double().T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sq.double(), (x * x).sum(-1), rtol=1e-6, atol=0)
    for t in (0, 33, 69):
        one = K.hc_mix(h[t:t + 1], fn)
        assert torch.equal(one[0][0], m[t]) and torch.equal(one[1][0], sq[t])


def test_rms_norm_near_the_torch_code_and_row_invariant(cuda, monkeypatch):
    from strata.model.numerics import rms_norm
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(37, 5120, generator=g) * 3).to(cuda, torch.float32)
    w = (torch.rand(5120, generator=g) + 0.5).to(cuda)
    got = rms_norm(x, w, 1e-6)
    assert torch.allclose(got, torch_path(monkeypatch, rms_norm, x, w, 1e-6), rtol=1e-5,
                          atol=1e-6)
    assert torch.equal(rms_norm(x[9:10], w, 1e-6)[0], got[9])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_the_torch_code(cuda, monkeypatch, dtype):
    from strata.model import rope
    g = torch.Generator().manual_seed(7)
    inv_freq = (10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)).to(cuda)
    cos, sin = rope.rope_cos_sin(inv_freq, torch.arange(1000, 1037).to(cuda))
    x = torch.randn(37, 64, 512, generator=g).to(cuda, dtype)  # q: 64 heads of 512, rope 64
    for inverse in (False, True):
        assert torch.equal(rope.apply_rope(x, cos, sin, inverse),
                           torch_path(monkeypatch, rope.apply_rope, x, cos, sin, inverse))
        # the attention output's form: written in bf16 by the kernel, torch's cast's bits
        assert torch.equal(rope.apply_rope(x, cos, sin, inverse, out_dtype=torch.bfloat16),
                           torch_path(monkeypatch, rope.apply_rope, x, cos, sin, inverse,
                                      out_dtype=torch.bfloat16))
        # in place (the queries): only the tails written, the same bits — a chunk's rows
        # (8 a program) and a decode step's (one a program)
        for rows in (x, x[:1]):
            y = rows.clone()
            assert rope.apply_rope(y, cos[:len(y)], sin[:len(y)], inverse, in_place=True) is y
            assert torch.equal(y, torch_path(monkeypatch, rope.apply_rope, rows, cos[:len(y)],
                                             sin[:len(y)], inverse))


def test_a_window_keys_norm_and_rope_in_one_launch(cuda):
    """A window key (512 wide, the last 64 channels roped, bf16) and an index key (128 wide,
    fp32): rms_norm_rope gives the norm kernel's then the RoPE kernel's bits."""
    from strata.config import v41_flash_config
    from strata.kernels import norm
    from strata.model import rope
    cfg = v41_flash_config()
    g = torch.Generator().manual_seed(20)
    inv_freq = rope.rope_inv_freq(cfg, 2, cuda)
    cos, sin = rope.rope_cos_sin(inv_freq, torch.arange(500, 506).to(cuda))
    for K, dtype in ((512, torch.bfloat16), (128, torch.float32)):
        x = (torch.randn(6, K, generator=g) * 3).to(cuda, dtype)
        w = (torch.rand(K, generator=g) + 0.5).to(cuda)
        assert torch.equal(rope.rms_norm_rope(x, w, 1e-6, cos, sin),
                           rope.apply_rope(norm.rms_norm(x, w, 1e-6), cos, sin)), K


def test_rope_table_equals_the_torch_code(cuda, monkeypatch):
    """The cos/sin table in one launch: torch's CUDA cos and sin of the fp64 angles, rounded
    to fp32 — bit for bit (V4.1's two tables, positions up to 1M)."""
    from strata.config import v41_flash_config
    from strata.model import rope
    cfg = v41_flash_config()
    positions = torch.cat((torch.arange(0, 300), torch.arange(1_048_000, 1_048_576))).to(cuda)
    for ratio in (0, 2):
        inv_freq = rope.rope_inv_freq(cfg, ratio, cuda)
        got = rope.rope_cos_sin(inv_freq, positions)
        want = torch_path(monkeypatch, rope.rope_cos_sin, inv_freq, positions)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), ratio


@pytest.mark.parametrize("T,k", [(1, 6), (6, 6), (64, 1), (8, 8)])
def test_one_program_grouping_equals_the_general_path(cuda, T, k):
    """A decode step's expert grouping on CUDA (one kernel) gives the general path's tensors
    exactly (V4.1: 384 experts; the EXL3 kernels' 64-row tiles and the fp8/fp4 ones')."""
    from strata.kernels import moe_grouping as G
    idx = torch.randint(0, 384, (T, k), generator=torch.Generator().manual_seed(T * k)).to(cuda)
    idx[-1] = idx[0]  # repeated experts
    for bm in (16, 64):
        got = G.group_in_one_program(idx, 384, bm)
        want = G.group_by_expert(idx.cpu(), 384, bm)
        assert torch.equal(got.order.cpu(), want.order)
        assert torch.equal(got.tile_expert.cpu(), want.tile_expert)
        assert torch.equal(got.tile_rows.cpu(), want.tile_rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qdq_kernels_equal_the_torch_code(cuda, monkeypatch, dtype):
    """The vendor numerics' three qdq steps in one launch each == their torch definitions,
    bit for bit and sign for sign, on the interpreter test's hard values (subnormal inputs
    included: the GPU loads them exactly) and at the window KV's shape."""
    from util import qdq_hard_values

    from strata.quant import qdq as Q
    g = torch.Generator().manual_seed(5)
    for fn, block in ((Q.fp8_act_qdq, 32), (Q.fp4_qdq_e4m3_scale, 16), (Q.fp4_qdq_ue8m0, 32)):
        for x in (qdq_hard_values(block), torch.randn(37, 512, generator=g) * 3):
            x = x.to(cuda, dtype)
            got, want = fn(x), torch_path(monkeypatch, fn, x)
            assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit()), fn


def test_moe_small_steps_against_the_torch_code(cuda, monkeypatch):
    """V4.1's router (384 experts, 6 picked) and SwiGLU (I = 2048, clamp 10) in one launch
    each: the same picks in the same order, weights and activations to fp32 rounding, rows
    independent of the batch; the slot sum bit for bit."""
    from util import route_reference

    from strata.kernels import moe_ops
    from strata.model import moe as M
    g = torch.Generator().manual_seed(9)
    T, E, k, I = 37, 384, 6, 2048
    logits = (torch.randn(T, E, generator=g) * 3).to(cuda)
    bias = (torch.randn(E, generator=g) * 0.05).to(cuda)
    idx, w = moe_ops.route(logits, bias, 1.0, k, 2.5)
    ref_idx, ref_w = route_reference(logits, bias, 1.0, k, 2.5)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(w, ref_w, rtol=4e-6, atol=0)
    assert torch.equal(moe_ops.route(logits[5:6], bias, 1.0, k, 2.5)[0], idx[5:6])
    gate = (torch.randn(T, k, I, generator=g) * 6).to(cuda, torch.bfloat16)
    up = (torch.randn(T, k, I, generator=g) * 6).to(cuda, torch.bfloat16)
    a = M.swiglu_to(gate, up, 10.0, torch.bfloat16, w)
    ref_a = torch_path(monkeypatch, M.swiglu_to, gate, up, 10.0, torch.bfloat16, w)
    torch.testing.assert_close(a.float(), ref_a.float(), rtol=8e-3, atol=1e-6)
    assert torch.equal(M.swiglu_to(gate[:1], up[:1], 10.0, torch.bfloat16, w[:1]), a[:1])
    y = (torch.randn(T, k, 5120, generator=g) * 4).to(cuda, torch.bfloat16)
    assert torch.equal(M.slot_sum(y), torch_path(monkeypatch, M.slot_sum, y))
    shared = (torch.randn(T, 5120, generator=g) * 4).to(cuda)
    # the slot sum and the join with the shared expert's output in one launch
    assert torch.equal(M.slot_sum(y, shared, torch.bfloat16),
                       torch_path(monkeypatch, M.slot_sum, y, shared, torch.bfloat16))


def test_compressor_pooling_in_one_launch_equals_the_torch_code(cuda):
    """The ratio-2 pooling (strata.kernels.compressor) at V4.1's width: torch's CUDA softmax
    and weighted sum bit for bit — a decode row completing a group and one starting it, a
    verify window from mid-group, a prefill chunk from position 0."""
    from strata.kernels.compressor import pool
    from strata.model.compressor import entry_indices
    from strata.runtime.state import PositionRing
    from util import compressor_pool
    g = torch.Generator(device=cuda).manual_seed(21)
    hd, size = 512, 256
    ring = PositionRing(size, (2, hd), torch.float32, cuda, keep=1)
    ring.rows.copy_(torch.randn(size, 2, hd, device=cuda, generator=g) * 3)
    for first, T in ((7, 1), (8, 1), (5, 6), (0, 4096)):
        positions = torch.arange(first, first + T, device=cuda)
        k = torch.randn(T, hd, device=cuda, generator=g) * 2
        gate = torch.randn(T, hd, device=cuda, generator=g) * 4
        entries = entry_indices(2, positions)
        assert torch.equal(pool(ring.rows, k, gate, positions, entries, 2),
                           compressor_pool(ring, k, gate, positions, entries, 2)), (first, T)


def test_engram_gate_in_one_launch_near_the_torch_code(cuda, monkeypatch):
    """The Engram gate and update (strata.kernels.engram) at V4.1's shapes, a bf16 stream and
    the keys and value as views of one fp32 projection: the torch steps' stream to a bf16
    rounding step (the gates within fp32 rounding of theirs), a decode row alone its bits in
    a verify window."""
    from strata.kernels import engram
    from strata.model.engram import gate_update
    g = torch.Generator().manual_seed(23)
    T, H, D = 6, 4, 5120
    h = (torch.randn(T, H, D, generator=g) * 3).to(cuda, torch.bfloat16)
    w = torch.randn(H, D, generator=g).to(cuda)
    kv = torch.randn(T, (H + 1) * D, generator=g).to(cuda)
    key, value = kv[:, :H * D].view(T, H, D), kv[:, H * D:]
    got = gate_update(h, w, key, value, 1e-20)
    with monkeypatch.context() as m:
        m.setattr(engram, "available", lambda t: False)
        want = gate_update(h, w, key, value, 1e-20)
    # one bf16 step where the gates' last-bit difference crosses a rounding boundary
    step = want.float().abs().clamp(min=2 ** -126) * 2 ** -7
    assert ((got.float() - want.float()).abs() <= step).all()
    assert (got != want).float().mean() < 1e-3
    one = gate_update(h[2:3], w, key[2:3], value[2:3], 1e-20)
    assert torch.equal(one[0], got[2])


@pytest.mark.parametrize("T, history", [(1, [17, 99_000, 5]), (6, [4]), (4096, []),
                                        (3, [8, -1, 12])])
def test_engram_ids_hashed_on_the_device_are_the_host_hash(cuda, T, history):
    """strata.kernels.engram.ngram_ids compiled, V4.1's hashing constants: a decode token, a
    verify window at the sequence's start, a prefill chunk, a dead id in the history."""
    from strata.bench.synthetic import synthetic_hasher
    from strata.config import v41_flash_config
    cfg = v41_flash_config()
    hasher = synthetic_hasher(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(T))
    span = cfg.engram_max_ngram_size - 1
    padded = torch.tensor([-1] * (span - len(history)) + history)
    got = hasher.device_ids(padded.to(cuda), tokens.to(cuda))
    want = hasher.ids(tokens, torch.tensor(history, dtype=torch.long))
    for layer in cfg.engram_layer_ids:
        assert torch.equal(got[layer].cpu(), want[layer]), layer


def test_a_forward_hashing_engram_ids_on_the_device_gives_the_host_hashs_logits(
        cuda, tiny_dir, monkeypatch):
    """The tiny model on the GPU (bf16): a prompt from position 0 and two decode steps, with
    the Engram ids hashed inside the forward (the default there) and on the host."""
    from strata.model.model import Model
    from strata.model.numerics import Numerics
    model = Model.load(tiny_dir, cuda, Numerics.for_device(cuda))
    assert model.hashes_on_device
    tokens = torch.tensor([5, 17, 3, 200, 41, 9, 77, 150, 2, 64])

    def run():
        state = model.new_state(32)
        out = [model.forward(tokens[:8], state, logits="all")[0]]
        out += [model.forward(t.view(1), state, logits="last")[0] for t in tokens[8:]]
        return out
    device = run()
    monkeypatch.setattr(Model, "hashes_on_device", property(lambda self: False))
    for a, b in zip(device, run()):
        assert torch.equal(a, b)


def test_attention_sink_softmax_near_the_torch_code(cuda, monkeypatch):
    """sparse_attention at V4.1's shapes (64 heads, 128 window + 512 compressed rows of 512,
    fp32) with the softmax and p·v in two launches: the torch steps' output to fp32 rounding, and
    each query's output alone equal to it in a batch."""
    from strata.model.attention import sparse_attention
    g = torch.Generator().manual_seed(4)
    T, H, W, k, hd = 9, 64, 128, 512, 512
    q = torch.randn(T, H, hd, generator=g).to(cuda)
    rows = torch.randn(T, W + k, hd, generator=g).to(cuda)
    mask = torch.cat((torch.rand(T, W, generator=g) > 0.2,  # (the window's rows, then the
                      torch.rand(T, k, generator=g) > 0.5), dim=1).to(cuda)  # compressed)
    sink = torch.randn(H, generator=g).to(cuda)
    args = (q, rows, mask, sink, hd ** -0.5)
    got = sparse_attention(*args)
    torch.testing.assert_close(got, torch_path(monkeypatch, sparse_attention, *args),
                               rtol=1e-4, atol=1e-5)
    alone = sparse_attention(*(a[2:3] if a is not sink and torch.is_tensor(a) else a
                               for a in args))
    assert torch.equal(alone, got[2:3])


def test_attention_rows_gathered_in_one_launch_equal_the_torch_code(cuda, monkeypatch):
    """A 300-query chunk's key rows at V4.1's shapes (window 128 over a 256-slot ring, 512
    compressed picks, rows of 512 in bf16): the one-launch gather equals the torch path bit
    for bit, rows and mask; the model's rows on CUDA — a RowTable of where they lie, every
    source bf16 — read through the products (one-hot queries: each element exactly) are those
    rows, and sparse attention over them gives the gathered rows' bits."""
    from strata.kernels import attention as attn_kernels
    from strata.kernels.rowwise import RowTable, rowwise_bmm
    from strata.model import attention as A
    from strata.model.context import ForwardContext
    from strata.runtime.state import PositionRing
    g = torch.Generator().manual_seed(6)
    W, S, hd, T, k = 128, 256, 512, 300, 512
    ring = PositionRing(S, (hd,), torch.bfloat16, cuda, keep=W - 1)
    ring.rows.copy_(torch.randn(S, hd, generator=g).to(cuda, torch.bfloat16))
    held = torch.arange(1000 - S, 1000)  # the ring holds the S positions before the chunk,
    tags = torch.empty(S, dtype=torch.long)
    tags[held % S] = held
    tags[::7] -= S                       # some of them stale
    ring.tags.copy_(tags.to(cuda))
    positions = torch.arange(1000, 1000 + T, device=cuda)
    window = ForwardContext(cfg=None, numerics=None, start=1000, positions=positions).window(W, S)
    kv = torch.randn(T, hd, generator=g).to(cuda, torch.bfloat16)
    cache = torch.randn(600, hd, generator=g).to(cuda, torch.bfloat16)
    sel = torch.randint(-1, 600, (T, k), generator=g).to(cuda)
    want = torch_path(monkeypatch, A.gather_rows, kv, ring, window, cache, sel)
    got = attn_kernels.gather_rows(kv, ring.rows, ring.tags, window, cache, sel, torch.bfloat16)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    table, mask = A.gather_rows(kv, ring, window, cache, sel)
    assert isinstance(table, RowTable) and torch.equal(mask, want[1])
    eye = torch.eye(hd, dtype=torch.bfloat16, device=cuda).expand(T, -1, -1)
    assert torch.equal(rowwise_bmm(eye, table, out_dtype=torch.float32),
                       want[0].transpose(1, 2).float())
    q = torch.randn(T, 64, hd, generator=g).to(cuda, torch.bfloat16)
    sink = torch.randn(64, generator=g).to(cuda)
    assert torch.equal(A.sparse_attention(q, table, mask, sink, hd ** -0.5),
                       A.sparse_attention(q, want[0], want[1], sink, hd ** -0.5))


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
def test_an_attention_piece_takes_the_scratch_its_estimate_counts(cuda, cache_dtype):
    """One piece of attend_pieces at V4.1's shapes (300 queries, 64 heads, window 128 + 512
    compressed rows of 512): the device memory its gather and sparse attention take at their
    peak is within scratch_per_query × 300 and above 80 % of it — the estimate sets how many
    queries a piece takes, so too low would overrun ATTN_SCRATCH and too high would cut a
    prefill chunk into needlessly many launches. Every source bf16: the rows' starts (a
    RowTable); an fp32 cache: the rows' gathered fp32 copy."""
    from strata.model import attention as A
    from strata.model.context import ForwardContext
    from strata.runtime.state import PositionRing
    g = torch.Generator().manual_seed(11)
    W, S, hd, T, k, H = 128, 256, 512, 300, 512, 64
    ring = PositionRing(S, (hd,), torch.bfloat16, cuda, keep=W - 1)
    ring.tags.copy_(torch.arange(1000 - S, 1000, device=cuda).roll(1000 % S))
    positions = torch.arange(1000, 1000 + T, device=cuda)
    window = ForwardContext(cfg=None, numerics=None, start=1000, positions=positions).window(W, S)
    kv = torch.randn(T, hd, generator=g).to(cuda, torch.bfloat16)
    cache = torch.randn(600, hd, generator=g).to(cuda, cache_dtype)
    sel = torch.randint(-1, 600, (T, k), generator=g).to(cuda)
    q = torch.randn(T, H, hd, generator=g).to(cuda, torch.bfloat16)
    sink = torch.randn(H, generator=g).to(cuda)
    out = torch.empty((T, H, hd), dtype=torch.float32, device=cuda)
    torch.cuda.synchronize(cuda)
    torch.cuda.reset_peak_memory_stats(cuda)
    before = torch.cuda.memory_allocated(cuda)
    rows, mask = A.gather_rows(kv, ring, window, cache, sel)
    A.sparse_attention(q, rows, mask, sink, hd ** -0.5, out=out)
    used = torch.cuda.max_memory_allocated(cuda) - before
    counted = T * A.scratch_per_query(kv, ring, cache, H, W + k)
    assert 0.8 * counted <= used <= counted + (8 << 20), (used, counted)  # (+ allocator blocks)


@pytest.mark.parametrize("dtype, key_dtype", [(torch.float32, torch.float32),
                                               (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])
def test_indexer_scores_in_one_launch_near_the_torch_code(cuda, dtype, key_dtype):
    """V4.1's indexer (32 heads of 128) over 5,000 entries: Σ_h w_h·relu(q_h·k), masked to
    each query's visible entries, from one launch within fp32 rounding of the torch steps
    (rows_bmm, relu, rows_bmm, where); a query's scores alone and over fewer entries are the
    batch's bits, and the weights scaled inside are torch's scaled weights' bits."""
    from strata.kernels.indexer import index_scores
    from strata.model.numerics import rows_bmm
    g = torch.Generator().manual_seed(8)
    T, H, D, n = 37, 32, 128, 5000
    q = torch.randn(T, H, D, generator=g).to(cuda, dtype)
    keys = torch.randn(n, D, generator=g).to(cuda, key_dtype)  # (fp32 × bf16: split product)
    w = (torch.randn(T, H, generator=g) * 0.02).to(cuda)
    visible = torch.randint(0, n + 1, (T,), generator=g).to(cuda)
    got = index_scores(q, keys, w, visible)
    per_head = torch.relu(rows_bmm(q, keys.unsqueeze(0), torch.float32))
    want = rows_bmm(w.unsqueeze(1), per_head.transpose(1, 2)).squeeze(1)
    seen = torch.arange(n, device=cuda)[None] < visible[:, None]
    want = torch.where(seen, want, torch.full_like(want, float("-inf")))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(index_scores(q[5:6], keys, w[5:6], visible[5:6]), got[5:6])
    assert torch.equal(index_scores(q, keys[:1234], w, visible), got[:, :1234])
    s = 128 ** -0.5 * 32 ** -0.5  # the weights' scale inside: torch's w * s, its bits
    assert torch.equal(index_scores(q, keys, w, visible, s), index_scores(q, keys, w * s, visible))


def test_ranked_topk_keys_in_one_launch_pick_as_the_torch_code(cuda, monkeypatch):
    """ranked_topk with its keys from one launch: the torch code's indices in the torch code's
    order (signed zeros, infinities and ties included), at an indexer piece's shape."""
    from strata.model.numerics import ranked_topk
    g = torch.Generator().manual_seed(10)
    scores = torch.randn(64, 20000, generator=g)
    scores[0, :6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-45, -1e-45])
    scores[1, 100:900] = 0.5
    scores = scores.to(cuda)
    for sorted_ in (True, False):
        got = ranked_topk(scores, 512, sorted=sorted_)
        want = torch_path(monkeypatch, ranked_topk, scores, 512, sorted_)
        assert torch.equal(got.sort(-1).values, want.sort(-1).values)
        if sorted_:
            assert torch.equal(got, want)


def test_greedy_argmax_in_two_launches_gives_torchs_ids(cuda):
    """argmax_rows at the vocabulary's width (129,280 logits a row): torch.argmax's ids for a
    decode row and a 6-row window — random logits, a row rounded into ties (the lowest id),
    one with NaNs (the first), one all −inf — and a row alone as in the window."""
    from strata.kernels.ranking import argmax_rows
    g = torch.Generator(device=cuda).manual_seed(12)
    x = torch.randn(6, 129280, device=cuda, generator=g) * 4
    x[1] = x[1].round()
    x[2, 77_000] = x[2, 5] = float("nan")
    x[3] = float("-inf")
    x[4, :] = x[4].max()  # every id ties
    got = argmax_rows(x)
    assert torch.equal(got, x.argmax(-1))
    assert torch.equal(argmax_rows(x[:1]), x[:1].argmax(-1))
    assert torch.equal(argmax_rows(x[5:6])[0], got[5])


@pytest.mark.parametrize("programs", [None, 1])
def test_the_indexers_selection_kernels_equal_the_torch_code(cuda, monkeypatch, programs):
    """topk_lowest_index by ranking.top_picks: the torch code's [T, k] at an indexer piece's
    shape, a candidate-block shape (fewer entries than picks), a candidate source's 2,048
    blocks and a decode query's 131K entries, infinities and ties included — rows split in
    parts as the code chooses, and (programs=1) every row in one program."""
    from strata.kernels import ranking
    from strata.model.indexer import topk_lowest_index
    if programs is not None:
        monkeypatch.setattr(ranking, "PICKS_PROGRAMS", programs)
    g = torch.Generator().manual_seed(11)
    scores = torch.randn(64, 20000, generator=g)
    scores[0, 300:] = float("-inf")
    scores[1, 100:900] = 0.5
    scores[2, ::2] = float("-inf")
    scores = scores.to(cuda)
    long = torch.randn(2, 131072, generator=g).to(cuda)
    long[1, 5000:90000] = 0.125
    for s, k in ((scores, 512), (scores[:, :200].contiguous(), 512), (scores[:, :700], 64),
                 (scores[:, :10000], 2048), (long, 512), (long[:1], 512)):
        got = topk_lowest_index(s, k)
        want = torch_path(monkeypatch, topk_lowest_index, s, k)
        assert torch.equal(got, want), (s.shape, k)


def test_after_compile_split_a_long_contexts_selections_compile_nothing(cuda):
    """The split selection's kernels are not specialised on the rows or parts of a call: once
    ranking.compile_split has run, the selections of a long prefill's pieces and a decode
    query (any rows, any number of parts, with and without ids) compile no new variant — a
    compile there had cost the first long prompt seconds (Triton's per-device kernel caches
    counted)."""
    from strata.kernels import ranking
    ranking.compile_split(cuda)
    kernels = (ranking._split_counts_kernel, ranking._split_picks_kernel)

    def compiled():
        return [len(k.device_caches[torch.cuda.current_device()][0]) for k in kernels]
    before = compiled()
    assert all(before)
    g = torch.Generator(device=cuda).manual_seed(13)
    for T, n in ((1, 131072), (3, 65792), (100, 16384), (17, 40960)):
        s = torch.randn(T, n, device=cuda, generator=g)
        ids = torch.randint(0, 1 << 40, (T, n), device=cuda, generator=g)
        assert torch.equal(ranking.top_picks(s, 512), torch.topk(s, 512).indices.sort().values)
        ranking.top_picks(s, 512, ids)
    assert compiled() == before


def test_attentions_products_have_one_set_of_bits_for_any_batch_and_tile_width(cuda):
    """q·kᵀ (bf16 pairs) and p·v (fp32 against bf16) at V4.1's decode shapes: a query alone
    (the narrow tile of small batches) gives its bits in a 40-query batch (the wide tile), and
    every tile width 16–128 gives them too — the width changes no output's chain of k-steps,
    which is what lets tile_shape follow the batch."""
    from strata.kernels.rowwise import rowwise_bmm, tile_shape
    g = torch.Generator(device=cuda).manual_seed(12)
    q = torch.randn(40, 64, 512, device=cuda, generator=g).bfloat16()
    rows = torch.randn(40, 640, 512, device=cuda, generator=g).bfloat16()
    p = torch.softmax(torch.randn(40, 64, 640, device=cuda, generator=g), -1)
    for x, w in ((q, rows), (p, rows.transpose(1, 2))):
        full = rowwise_bmm(x, w, out_dtype=torch.float32)
        assert tile_shape(64, 1, 1)[1] != tile_shape(64, 1, 40)[1]  # (two widths here)
        for i in (0, 17, 39):
            assert torch.equal(rowwise_bmm(x[i:i + 1], w[i:i + 1], out_dtype=torch.float32),
                               full[i:i + 1]), i
        assert torch.equal(rowwise_bmm(x[3:9], w[3:9], out_dtype=torch.float32), full[3:9])
        for width in (16, 32, 64, 128):
            assert torch.equal(rowwise_bmm(x, w, out_dtype=torch.float32,
                                           tile=(64, width, 64)), full), width


def test_a_dense_fp32_linear_of_bf16_rows_and_weight(cuda):
    """Linear.forward with an fp32 output, bf16 activations and a bf16 weight (the router):
    the pairs' exact products summed in fp32 on tensor cores — no cast launch, no fp32 copy
    of the weight — within fp32 rounding of the widened product; a row alone has its bits
    in the batch."""
    from strata.model.numerics import Numerics
    from strata.quant.linear import DenseLinear
    g = torch.Generator().manual_seed(11)
    lin = DenseLinear((torch.randn(384, 5120, generator=g) * 0.02).to(cuda, torch.bfloat16))
    x = torch.randn(9, 5120, generator=g).to(cuda, torch.bfloat16)
    nx = Numerics(mode="reference", act_dtype=torch.bfloat16)
    got = lin(x, nx, torch.float32)
    assert got.dtype == torch.float32 and torch.float32 not in lin._dense
    exact = x.double() @ lin.weight.double().T
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
    assert torch.equal(lin(x[4:5], nx, torch.float32), got[4:5])


def test_ring_writes_in_one_launch_equal_the_torch_code(cuda, monkeypatch):
    """PositionRing.write on CUDA (one launch) against its torch code: a window ring of bf16
    rows written from bf16 and fp32 sources, wrapping, then a journaled write undone."""
    from strata.kernels import ring
    from strata.runtime.state import Journal, PositionRing
    g = torch.Generator().manual_seed(12)
    rings = [PositionRing(256, (512,), torch.bfloat16, torch.device(cuda), keep=127)
             for _ in range(2)]
    writes = [(0, 200), (200, 1), (201, 100), (301, 6)]  # a prefill, decode, wrap, window
    srcs = [torch.randn(n, 512, generator=g).to(cuda, torch.float32 if i % 2 else
                                                 torch.bfloat16)
            for i, (_, n) in enumerate(writes)]
    journal = Journal(start=301)
    for r, fused in zip(rings, (True, False)):
        with monkeypatch.context() as m:
            if not fused:
                m.setattr(ring, "available", lambda rows, src: False)
            for (first, n), src in zip(writes, srcs):
                pos = torch.arange(first, first + n, device=cuda)
                r.write(first, pos, src, journal if first == 301 and fused else None)
    assert torch.equal(rings[0].rows, rings[1].rows)
    assert torch.equal(rings[0].tags, rings[1].tags)
    journal.writes[0].undo_from(301)  # the window rejected: back to the state after 301 rows
    with monkeypatch.context() as m:
        m.setattr(ring, "available", lambda rows, src: False)
        back = PositionRing(256, (512,), torch.bfloat16, torch.device(cuda), keep=127)
        for (first, n), src in zip(writes[:3], srcs[:3]):
            back.write(first, torch.arange(first, first + n, device=cuda), src, None)
    assert torch.equal(rings[0].rows, back.rows) and torch.equal(rings[0].tags, back.tags)


def test_a_rollbacks_batched_restores_equal_the_torch_undo(cuda, monkeypatch):
    """State's rollback on CUDA: a journal's writes into several rings of two dtypes (a
    window's window and compressor-tail rings), two forwards deep, undone from inside the
    first by the batched restore (one launch per dtype and forward: kernels/ring.py's
    address table, compiled) — the rings equal the torch undo's, bit for bit."""
    from strata.kernels import ring
    from strata.runtime.state import Journal, PositionRing, undo_writes
    dev = torch.device(cuda)
    result = []
    for fused in (True, False):
        g = torch.Generator().manual_seed(13)
        rings = [PositionRing(256, (512,), torch.bfloat16, dev, keep=127) for _ in range(3)]
        rings.append(PositionRing(256, (2, 512), torch.float32, dev, keep=3))
        for r in rings:
            src = torch.randn(300, *r.rows.shape[1:], generator=g).to(dev)
            r.write(0, torch.arange(0, 300, device=dev), src, None)
        j = Journal(start=300)
        for first, n in ((300, 7), (307, 3)):
            for r in rings:
                src = torch.randn(n, *r.rows.shape[1:], generator=g).to(dev)
                r.write(first, torch.arange(first, first + n, device=dev), src, j)
        with monkeypatch.context() as m:
            if not fused:
                m.setattr(ring, "available", lambda rows, src: False)
            undo_writes(list(reversed(j.writes)), 302)
        result.append([(r.rows.clone(), r.tags.clone()) for r in rings])
    for (a, ta), (b, tb) in zip(*result):
        assert torch.equal(a, b) and torch.equal(ta, tb)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_querys_own_entries_score_with_their_bits_among_all(cuda, dtype):
    """index_scores with `entries` (a reindex layer's candidates, each query's own, ascending,
    −1 none) at V4.1's indexer shapes: every score has the bits the query's scores over all
    the entries give it — the same tile shapes and MMA chain — so the picks from candidates
    alone equal the picks from all entries masked to them; −1 and unseen ids give −inf."""
    from strata.kernels.indexer import index_scores
    from strata.model.indexer import candidate_entries
    g = torch.Generator().manual_seed(21)
    T, H, D, n = 6, 32, 128, 20480
    q = torch.randn(T, H, D, generator=g).to(cuda, dtype)
    keys = torch.randn(n, D, generator=g).to(cuda, torch.bfloat16)
    w = torch.rand(T, H, generator=g).to(cuda)
    visible = torch.tensor([20480, 20000, 9000, 1, 0, 15000], device=cuda)
    full = index_scores(q, keys, w, visible, 0.0156)
    blocks = torch.stack([torch.randperm(n // 8, generator=g)[:2048].sort().values
                          for _ in range(T)]).to(cuda)
    blocks[1, 2000:] = -1
    entries = candidate_entries(blocks, 8)
    got = index_scores(q, keys, w, visible, 0.0156, entries=entries)
    want = torch.where(entries >= 0, full.gather(1, entries.clamp(min=0)), float("-inf"))
    assert torch.equal(got, want)
    assert torch.equal(index_scores(q[2:3], keys, w[2:3], visible[2:3], 0.0156,
                                    entries=entries[2:3]), got[2:3])
