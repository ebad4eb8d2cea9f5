"""Unit tests of the model pieces against the formulas of architecture.md §2 (test list §8).

Every expected value is recomputed here from the spec's formulas (mostly in float64 Python or
torch), never by calling the helper under test a second time:
  1. mHC: Sinkhorn, hc_mixes (pre/post/comb), comb index order in the stream update (§2.3)
  2. RoPE/YaRN tables and the interleaved rotation of the last rope_dim channels (§2.4)
  3. Compressor: prefill == decode == odd/even chunks, bit for bit; entries recomputed (§2.5)
  4. Indexer: top-k ties/padding, candidate blocks, visibility in the model (§2.6)
  5. MoE routing and the SwiGLU experts (§2.8)
  6. Engram gate (§2.7)
  7. The lagged `pre` of V4.1's blocks (§2.2)
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from strata.config import v41_flash_config
from strata.model.engram import Engram
from strata.model.indexer import (candidate_entries, candidate_mask,
                                  select_candidate_blocks, topk_lowest_index)
from strata.model.mhc import HcWeights, collapse, hc_mixes, hc_update, sinkhorn
from strata.model.moe import GATHER_PAIRS, MoE, swiglu
from strata.model.numerics import Numerics
from strata.model.rope import apply_rope, rope_cos_sin, rope_inv_freq
from strata.quant.linear import DenseLinear
from strata.quant.qdq import fp8_act_qdq

from util import forward_100_then_rest, random_tokens, same_runs

NEG = float("-inf")
EPS = 1e-20  # rms_norm_eps of V4.1 (and of the tiny fixture)


# ------------------------------------------------------------------------------------------
# independent spec helpers (float64)
# ------------------------------------------------------------------------------------------
def spec_rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float = EPS) -> torch.Tensor:
    x = x.double()
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y * w.double() if w is not None else y


def spec_inv_freq(theta: float, rd: int, yarn: bool, factor: float = 16.0, orig: int = 65536,
                  beta_fast: float = 32.0, beta_slow: float = 1.0) -> list[float]:
    """f_k = θ^(-2k/rd), with the YaRN ramp of §2.4 when `yarn`."""
    f = [theta ** (-2.0 * k / rd) for k in range(rd // 2)]
    if not yarn:
        return f

    def corr(r: float) -> float:
        return rd * math.log(orig / (2 * math.pi * r)) / (2 * math.log(theta))

    lo = max(math.floor(corr(beta_fast)), 0)
    hi = min(math.ceil(corr(beta_slow)), rd - 1)
    out = []
    for k, fk in enumerate(f):
        ramp = min(max((k - lo) / max(hi - lo, 1e-3), 0.0), 1.0)
        out.append(fk / factor * ramp + fk * (1 - ramp))
    return out


def spec_rotate(x: torch.Tensor, pos: int, freqs: list[float], inverse: bool = False) -> torch.Tensor:
    """Interleaved-pair rotation of the last 2·len(freqs) channels of a 1-D vector (float64)."""
    x = x.double().clone()
    rd = 2 * len(freqs)
    base = x.shape[-1] - rd
    out = x.clone()
    for k, f in enumerate(freqs):
        ang = pos * f * (-1 if inverse else 1)
        c, s = math.cos(ang), math.sin(ang)
        a, b = x[..., base + 2 * k], x[..., base + 2 * k + 1]
        out[..., base + 2 * k] = a * c - b * s
        out[..., base + 2 * k + 1] = a * s + b * c
    return out


def spec_sinkhorn(logits: list[list[float]], iters: int, eps: float) -> list[list[float]]:
    """§2.3 in plain Python: row softmax + eps, column normalise, then iters-1 × (row, col)."""
    n = len(logits)
    c = []
    for row in logits:
        mx = max(row)
        e = [math.exp(v - mx) for v in row]
        s = sum(e)
        c.append([v / s + eps for v in e])

    def col_norm(c):
        cs = [sum(c[i][j] for i in range(n)) for j in range(n)]
        return [[c[i][j] / (cs[j] + eps) for j in range(n)] for i in range(n)]

    def row_norm(c):
        return [[v / (sum(row) + eps) for v in row] for row in c]

    c = col_norm(c)
    for _ in range(iters - 1):
        c = col_norm(row_norm(c))
    return c


def spec_swiglu(g: torch.Tensor, v: torch.Tensor, limit: float) -> torch.Tensor:
    g = torch.minimum(g.double(), torch.tensor(limit, dtype=torch.float64))
    v = torch.clamp(v.double(), -limit, limit)
    return g * torch.sigmoid(g) * v


# ------------------------------------------------------------------------------------------
# 1. mHC
# ------------------------------------------------------------------------------------------
def test_sinkhorn_doubly_stochastic_and_matches_spec():
    gen = torch.Generator().manual_seed(11)
    # logits of the spread mHC produces (std ~0.5): 20 iterations reach ~1e-6. (Sharper
    # logits converge slower: at std 2 rows are off by up to ~1e-2 after 20 iterations — a
    # property of the vendor's fixed iteration count, checked against the spec below.)
    logits = torch.randn(64, 4, 4, generator=gen) * 0.5
    c = sinkhorn(logits, iters=20, eps=1e-6)
    assert c.dtype == torch.float32 and c.shape == (64, 4, 4)
    assert (c > 0).all()
    torch.testing.assert_close(c.sum(-1), torch.ones(64, 4), atol=2e-6, rtol=0)  # rows
    torch.testing.assert_close(c.sum(-2), torch.ones(64, 4), atol=2e-6, rtol=0)  # columns
    sharp = torch.randn(16, 4, 4, generator=gen) * 2.0
    torch.testing.assert_close(sinkhorn(sharp, 20, 1e-6).sum(-2), torch.ones(16, 4), atol=2e-6,
                               rtol=0)  # the last step normalises columns
    logits = torch.cat((logits[:16], sharp))
    c = sinkhorn(logits, iters=20, eps=1e-6)
    for b in range(logits.shape[0]):
        ref = torch.tensor(spec_sinkhorn(logits[b].tolist(), 20, 1e-6), dtype=torch.float64)
        torch.testing.assert_close(c[b].double(), ref, atol=1e-6, rtol=1e-5)


def test_sinkhorn_cpu_loop_matches_the_torch_loop_and_is_batch_invariant():
    """On CPU the normalisation loop runs in numpy (torch's per-call cost dominated it). With
    four copies (V4.1's hc_mult) it gives the torch loop's bits; with other counts numpy may
    add a row's terms in another order (last-bit differences). Either way each row's result
    must not depend on what else is in the batch."""
    def torch_loop(logits, iters, eps):
        c = torch.softmax(logits, dim=-1) + eps
        c = c / (c.sum(-2, keepdim=True) + eps)
        for _ in range(iters - 1):
            c = c / (c.sum(-1, keepdim=True) + eps)
            c = c / (c.sum(-2, keepdim=True) + eps)
        return c

    gen = torch.Generator().manual_seed(5)
    for T, H, std, iters in ((1, 4, 0.5, 20), (3000, 4, 1.0, 20), (5, 4, 0.5, 1),
                             (257, 2, 3.0, 7), (64, 8, 0.5, 20)):
        logits = torch.randn(T, H, H, generator=gen) * std
        got = sinkhorn(logits, iters, 1e-6)
        assert got.dtype == torch.float32 and got.shape == (T, H, H)
        want = torch_loop(logits, iters, 1e-6)
        if H == 4:
            assert torch.equal(got, want), (T, std, iters)
        else:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        for i in (0, T // 2, T - 1):
            assert torch.equal(sinkhorn(logits[i:i + 1], iters, 1e-6), got[i:i + 1]), (T, H, i)
    # a column slice of wider rows, as hc_mixes passes it, and a leading batch dim
    wide = torch.randn(6, 32, generator=gen)
    sliced = wide[:, 16:].reshape(6, 4, 4)
    assert torch.equal(sinkhorn(sliced, 20, 1e-6), torch_loop(sliced, 20, 1e-6))
    batched = torch.randn(2, 3, 4, 4, generator=gen)
    assert torch.equal(sinkhorn(batched, 20, 1e-6), torch_loop(batched, 20, 1e-6))


def _random_hc(gen: torch.Generator, H: int, D: int) -> HcWeights:
    n = (2 + H) * H
    return HcWeights(fn=torch.randn(n, H * D, generator=gen) * 0.3,
                     base=torch.randn(n, generator=gen),
                     scale=0.5 + torch.rand(3, generator=gen))


def test_hc_mixes_matches_spec_formulas():
    H, D, T = 4, 16, 3
    gen = torch.Generator().manual_seed(12)
    w = _random_hc(gen, H, D)
    h = torch.randn(T, H, D, generator=gen) * 1.7
    pre, post, comb = hc_mixes(h, w, norm_eps=EPS, hc_eps=1e-6, iters=20)
    assert pre.shape == (T, H) and post.shape == (T, H) and comb.shape == (T, H, H)
    fn, base, s = w.fn.double(), w.base.double().tolist(), w.scale.double().tolist()
    for t in range(T):
        x = h[t].double().flatten()
        r = 1.0 / math.sqrt(float((x * x).mean()) + EPS)
        m = [float(fn[k] @ x) * r for k in range(fn.shape[0])]
        sig = lambda z: 1.0 / (1.0 + math.exp(-z))  # noqa: E731
        exp_pre = [sig(m[i] * s[0] + base[i]) + 1e-6 for i in range(H)]
        exp_post = [2 * sig(m[H + i] * s[1] + base[H + i]) for i in range(H)]
        # m[8:24] viewed (4,4) row-major: C[i][j] = z[8 + 4i + j]
        C = [[m[2 * H + H * i + j] * s[2] + base[2 * H + H * i + j] for j in range(H)]
             for i in range(H)]
        exp_comb = spec_sinkhorn(C, 20, 1e-6)
        torch.testing.assert_close(pre[t].double(), torch.tensor(exp_pre, dtype=torch.float64),
                                   atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(post[t].double(), torch.tensor(exp_post, dtype=torch.float64),
                                   atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(comb[t].double(), torch.tensor(exp_comb, dtype=torch.float64),
                                   atol=1e-6, rtol=1e-5)
        # the test discriminates the view order: a column-major view gives another matrix
        CT = [list(col) for col in zip(*C)]
        wrong = torch.tensor(spec_sinkhorn(CT, 20, 1e-6), dtype=torch.float64)
        assert (comb[t].double() - wrong).abs().max() > 1e-3
    # saturated pre logits: pre = sigmoid(-40) + eps = eps (the +hc_eps is visible here)
    base = w.base.clone()
    base[:H] = -40.0
    base[H:2 * H] = 40.0
    zero = HcWeights(fn=torch.zeros_like(w.fn), base=base, scale=w.scale)
    pre, post, _ = hc_mixes(h, zero, norm_eps=EPS, hc_eps=1e-6, iters=20)
    torch.testing.assert_close(pre, torch.full((T, H), 1e-6), atol=0, rtol=1e-5)
    torch.testing.assert_close(post, torch.full((T, H), 2.0), atol=0, rtol=1e-6)


def test_hc_update_sums_over_first_comb_index():
    T, H, D = 2, 4, 5
    gen = torch.Generator().manual_seed(13)
    R = torch.randn(T, H, D, generator=gen)
    y = torch.randn(T, D, generator=gen)
    post = torch.rand(T, H, generator=gen) * 2
    comb = torch.rand(T, H, H, generator=gen)
    assert (comb - comb.transpose(1, 2)).abs().max() > 0.1  # clearly non-symmetric
    out = hc_update(y, R, post, comb)
    exp = torch.zeros(T, H, D, dtype=torch.float64)
    for t in range(T):
        for j in range(H):
            exp[t, j] = post[t, j].double() * y[t].double()
            for i in range(H):  # residual copy i goes into output copy j with comb[i, j]
                exp[t, j] += comb[t, i, j].double() * R[t, i].double()
    torch.testing.assert_close(out.double(), exp, atol=1e-5, rtol=1e-5)
    wrong = post.double()[..., None] * y.double()[:, None] + torch.einsum(
        "tji,tid->tjd", comb.double(), R.double())
    assert (out.double() - wrong).abs().max() > 1e-2


def test_collapse_weights_copies_by_pre():
    gen = torch.Generator().manual_seed(14)
    h = torch.randn(3, 4, 7, generator=gen)
    pre = torch.rand(3, 4, generator=gen)
    exp = sum(pre[:, i, None].double() * h[:, i].double() for i in range(4))
    torch.testing.assert_close(collapse(h, pre).double(), exp, atol=1e-6, rtol=1e-6)
    onehot = torch.zeros(3, 4)
    onehot[:, 0] = 1
    assert torch.equal(collapse(h, onehot), h[:, 0])


# ------------------------------------------------------------------------------------------
# 2. RoPE / YaRN
# ------------------------------------------------------------------------------------------
def test_rope_inv_freq_ratio0_plain_theta_10000():
    cfg = v41_flash_config()
    assert cfg.qk_rope_head_dim == 64
    exp = torch.tensor([10000.0 ** (-2 * k / 64) for k in range(32)], dtype=torch.float64)
    for layer in (0, 1, 40, 41, 42):  # window-only layers and the DSpark stages
        assert cfg.compress_ratios[layer] == 0
    f = rope_inv_freq(cfg, 0)
    assert f.shape == (32,)
    torch.testing.assert_close(f.double(), exp, rtol=1e-12, atol=0)


@pytest.mark.parametrize("ratio", [1, 2])
def test_rope_inv_freq_yarn_for_compressed_layers(ratio):
    cfg = v41_flash_config()
    theta, rd = 160000.0, 64

    def corr(r):
        return rd * math.log(65536 / (2 * math.pi * r)) / (2 * math.log(theta))

    lo = max(math.floor(corr(32)), 0)
    hi = min(math.ceil(corr(1)), rd - 1)
    assert (lo, hi) == (15, 25)  # corr(32) = 15.45, corr(1) = 24.71
    base = [theta ** (-2 * k / rd) for k in range(rd // 2)]
    f = rope_inv_freq(cfg, ratio).double()
    # ramp_k = 0 for k <= lo: the fast (first) pairs keep their frequency ...
    for k in range(lo + 1):
        assert f[k].item() == pytest.approx(base[k], rel=1e-12)
    # ... ramp_k = 1 for k >= hi: the slow (last) pairs are interpolated by the factor 16
    for k in range(hi, rd // 2):
        assert f[k].item() == pytest.approx(base[k] / 16, rel=1e-12)
    for k in range(lo + 1, hi):  # in between, linear in k
        ramp = (k - lo) / (hi - lo)
        assert f[k].item() == pytest.approx(base[k] / 16 * ramp + base[k] * (1 - ramp), rel=1e-12)
    torch.testing.assert_close(f, torch.tensor(spec_inv_freq(theta, rd, True), dtype=torch.float64),
                               rtol=1e-12, atol=0)


def test_rope_table_does_not_depend_on_max_length():
    cfg = v41_flash_config()
    ref1, ref0 = rope_inv_freq(cfg, 1), rope_inv_freq(cfg, 0)
    for mpe in (128, 4096, 65536, 1 << 20, 1 << 24):
        c = replace(cfg, max_position_embeddings=mpe)
        assert torch.equal(rope_inv_freq(c, 1), ref1)  # YaRN on even below 65536
        assert torch.equal(rope_inv_freq(c, 0), ref0)
    assert rope_inv_freq(cfg, 1)[-1].item() == pytest.approx(160000.0 ** (-62 / 64) / 16, rel=1e-12)
    # the vendor gate is only original_seq_len > 0
    plain = rope_inv_freq(replace(cfg, original_max_position_embeddings=0), 1).double()
    torch.testing.assert_close(plain, torch.tensor(spec_inv_freq(160000.0, 64, False),
                                                   dtype=torch.float64), rtol=1e-12, atol=0)


def test_rope_cos_sin_at_large_positions():
    cfg = v41_flash_config()
    pos = torch.tensor([0, 1, 77, 70000, 1_000_000])
    f = spec_inv_freq(160000.0, 64, True)
    cos, sin = rope_cos_sin(rope_inv_freq(cfg, 2), pos)
    exp_c = torch.tensor([[math.cos(p * fk) for fk in f] for p in pos.tolist()], dtype=torch.float64)
    exp_s = torch.tensor([[math.sin(p * fk) for fk in f] for p in pos.tolist()], dtype=torch.float64)
    torch.testing.assert_close(cos.double(), exp_c, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin.double(), exp_s, atol=1e-6, rtol=0)


def test_apply_rope_interleaved_pairs_of_last_channels():
    gen = torch.Generator().manual_seed(21)
    T, H, d, rd = 3, 2, 24, 8
    x = torch.randn(T, H, d, generator=gen)
    positions = [0, 5, 1234]
    freqs = spec_inv_freq(160000.0, rd, True, orig=64)  # any frequencies; a small orig ramps
    ang = torch.tensor([[p * fk for fk in freqs] for p in positions], dtype=torch.float64)
    cos, sin = torch.cos(ang).float(), torch.sin(ang).float()
    y = apply_rope(x, cos, sin)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(y[..., :d - rd], x[..., :d - rd])  # leading channels untouched
    for t, p in enumerate(positions):
        for hh in range(H):
            torch.testing.assert_close(y[t, hh].double(), spec_rotate(x[t, hh], p, freqs),
                                       atol=2e-6, rtol=0)
    # each pair keeps its norm
    xp = x[..., d - rd:].reshape(T, H, rd // 2, 2)
    yp = y[..., d - rd:].reshape(T, H, rd // 2, 2)
    torch.testing.assert_close(yp.norm(dim=-1), xp.norm(dim=-1), atol=1e-5, rtol=1e-5)
    # a pair at position 0 is not rotated; the inverse undoes the rotation
    torch.testing.assert_close(y[0], x[0], atol=0, rtol=0)
    back = apply_rope(y, cos, sin, inverse=True)
    torch.testing.assert_close(back, x, atol=2e-6, rtol=0)
    inv = apply_rope(x, cos, sin, inverse=True)
    for hh in range(H):
        torch.testing.assert_close(inv[2, hh].double(),
                                   spec_rotate(x[2, hh], positions[2], freqs, inverse=True),
                                   atol=2e-6, rtol=0)


# ------------------------------------------------------------------------------------------
# model runs shared by the compressor / indexer tests
# ------------------------------------------------------------------------------------------
N_TOKENS = 37  # odd; > 4 candidate blocks of 8 ratio-1 entries; > index_topk (16) entries
SCHEDULES = {
    "prefill": [N_TOKENS],
    "decode": [1] * N_TOKENS,
    # chunks of odd and even sizes starting at odd and even positions
    "chunks_a": [3, 4, 1, 5, 2, 6, 7, 9],   # starts 0, 3, 7, 8, 13, 15, 21, 28
    "chunks_b": [2, 3, 5, 4, 1, 6, 8, 8],   # starts 0, 2, 5, 10, 14, 15, 21, 29
}
for _s in SCHEDULES.values():
    assert sum(_s) == N_TOKENS


def _kv_sources(cfg):
    return list(cfg.kv_source_layer_ids)


@pytest.fixture(scope="module")
def runs(tiny_model):
    """Each schedule's final state, the per-forward contexts, and per-step cache snapshots."""
    model = tiny_model
    cfg = model.cfg
    toks = random_tokens(N_TOKENS, seed=5, vocab=cfg.vocab_size)
    out = {}
    for name, sizes in SCHEDULES.items():
        state = model.new_state(64)
        ctxs, logits, snaps = [], [], []
        p = 0
        for n in sizes:
            lg, ctx = model.forward(toks[p:p + n], state)
            p += n
            ctxs.append(ctx)
            logits.append(lg)
            snaps.append((p, {l: (state.comp_kv[l].clone(), state.index_k[l].clone())
                              for l in _kv_sources(cfg)}))
        out[name] = dict(state=state, ctxs=ctxs, logits=torch.cat(logits), snaps=snaps)
    out["tokens"] = toks
    out["model"] = model
    return out


# ------------------------------------------------------------------------------------------
# 3. Compressor
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["decode", "chunks_a", "chunks_b"])
def test_compressed_caches_identical_across_schedules(runs, schedule):
    cfg = runs["model"].cfg
    ref, other = runs["prefill"]["state"], runs[schedule]["state"]
    assert other.position == ref.position == N_TOKENS
    for l in _kv_sources(cfg):
        n = N_TOKENS // cfg.ratio(l)
        assert torch.equal(other.comp_kv[l][:n], ref.comp_kv[l][:n]), f"comp_kv[{l}]"
        assert torch.equal(other.index_k[l][:n], ref.index_k[l][:n]), f"index_k[{l}]"
    # the compressor tail of the unfinished ratio-2 pair
    for l, ring in ref.comp_tail.items():
        p = N_TOKENS - 1
        assert torch.equal(other.comp_tail[l].gather(torch.tensor([p])),
                           ring.gather(torch.tensor([p])))
    # and the logits (verify / chunked decode == single-token decode, §8 item 8)
    assert torch.equal(runs[schedule]["logits"], runs["prefill"]["logits"])


@pytest.mark.parametrize("length", [20, 21])
def test_prefill_of_even_and_odd_length_matches_decode(runs, length):
    model = runs["model"]
    cfg = model.cfg
    state = model.new_state(64)
    model.forward(runs["tokens"][:length], state, logits="none")
    pos, snap = runs["decode"]["snaps"][length - 1]
    assert pos == length
    for l in _kv_sources(cfg):
        kv, ik = snap[l]
        n = length // cfg.ratio(l)  # (past n: the unfinished group's provisional entry)
        assert torch.equal(state.comp_kv[l][:n], kv[:n]), f"comp_kv[{l}]"
        assert torch.equal(state.index_k[l][:n], ik[:n]), f"index_k[{l}]"


@pytest.mark.parametrize("schedule", ["decode", "chunks_a"])
def test_entry_count_and_entries_never_change(runs, schedule):
    cfg = runs["model"].cfg
    final = runs[schedule]["state"]
    for pos, snap in runs[schedule]["snaps"]:
        for l in _kv_sources(cfg):
            r = cfg.ratio(l)
            n = pos // r
            kv, ik = snap[l]
            # position // ratio entries complete, every one nonzero; past them at most the
            # unfinished group's provisional entry (invisible until a forward completes it) ...
            assert (kv[:n].abs().amax(-1) > 0).all() and (ik[:n].abs().amax(-1) > 0).all()
            assert (kv[n + 1:] == 0).all() and (ik[n + 1:] == 0).all(), \
                f"layer {l} wrote past {n + 1}"
            # ... and they never change afterwards
            assert torch.equal(kv[:n], final.comp_kv[l][:n])
            assert torch.equal(ik[:n], final.index_k[l][:n])


@contextlib.contextmanager
def _set_attr(obj, name, value):
    """Set an instance attribute and restore the instance exactly (no leftover attribute
    shadowing the class's method, unlike monkeypatch on an instance)."""
    had = name in vars(obj)
    old = vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


def _capture(stack: contextlib.ExitStack, obj, name, store):
    """Record the positional arguments of every call of obj.name (the call still runs)."""
    orig = getattr(obj, name)

    def wrapper(*args, **kw):
        store.append(args)
        return orig(*args, **kw)

    stack.enter_context(_set_attr(obj, name, wrapper))


def test_compressed_entries_recomputed_from_weights(tiny_reference):
    model = tiny_reference
    cfg = model.cfg
    rd = cfg.qk_rope_head_dim
    freqs = spec_inv_freq(cfg.compress_rope_theta, rd, True, factor=cfg.rope_factor,
                          orig=cfg.original_max_position_embeddings)
    seen = {l: [] for l in _kv_sources(cfg)}
    N = 13  # odd: the last token waits in the ratio-2 tail
    state = model.new_state(32)
    with contextlib.ExitStack() as stack:
        for l in _kv_sources(cfg):
            _capture(stack, model.layers[l].attn, "forward", seen[l])
        model.forward(random_tokens(N, seed=6, vocab=cfg.vocab_size), state, logits="none")
    for l in _kv_sources(cfg):
        (u, _ctx, _st), = seen[l]
        u = u.double()
        comp = model.layers[l].attn.compressor
        idx = model.layers[l].attn.indexer
        r = cfg.ratio(l)
        k = u @ comp.wkv.dequantize(torch.float64).T
        n = N // r
        for j in range(n):
            if r == 1:
                pooled = k[j]
            else:
                g = u[r * j:r * j + r] @ comp.wgate.dequantize(torch.float64).T
                wts = torch.softmax(g, dim=0)  # over the 2 tokens, per channel
                pooled = (wts * k[r * j:r * j + r]).sum(0)
            latent = spec_rms_norm(pooled, comp.norm)
            exp_kv = spec_rotate(latent, r * j, freqs)  # rotated at the group's first position
            torch.testing.assert_close(state.comp_kv[l][j].double(), exp_kv, atol=1e-4, rtol=1e-4)
            # index key: RMSNorm(wk·pre-RoPE latent; k_norm), rotated at j·ratio
            ik = spec_rms_norm(latent @ idx.wk.dequantize(torch.float64).T, idx.k_norm)
            torch.testing.assert_close(state.index_k[l][j].double(), spec_rotate(ik, r * j, freqs),
                                       atol=1e-4, rtol=1e-4)
        assert (state.comp_kv[l][n + 1:] == 0).all()
    # the odd tail is held in the tail ring; its entry (6) is only provisional: the next
    # forward completes the pair and rewrites it
    assert N // 2 == 6 and (state.comp_kv[1][7] == 0).all()


# ------------------------------------------------------------------------------------------
# 4. Indexer
# ------------------------------------------------------------------------------------------
def spec_topk(row: list[float], k: int) -> list[int]:
    finite = [(-v, j) for j, v in enumerate(row) if v != NEG]
    picked = sorted(j for _, j in sorted(finite)[:k])
    return picked + [-1] * (k - len(picked))


def test_topk_lowest_index_hand_examples():
    s = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0],      # three-way tie at the top
                      [NEG, 5.0, NEG, 1.0, NEG],       # fewer finite than k
                      [NEG, NEG, NEG, NEG, NEG],       # nothing finite
                      [0.1, 5.0, 0.2, 7.0, 0.2]])      # ascending output, tie at the cut
    assert topk_lowest_index(s, 2).tolist() == [[1, 2], [1, 3], [-1, -1], [1, 3]]
    assert topk_lowest_index(s, 3).tolist() == [[1, 2, 4], [1, 3, -1], [-1, -1, -1], [1, 2, 3]]
    # always k wide, even when k > n
    assert topk_lowest_index(s, 7).tolist() == [[0, 1, 2, 3, 4, -1, -1], [1, 3, -1, -1, -1, -1, -1],
                                                [-1] * 7, [0, 1, 2, 3, 4, -1, -1]]
    assert topk_lowest_index(torch.tensor([[float("inf"), 0.0, float("inf")]]), 1).tolist() == [[0]]


def test_topk_lowest_index_random_ties():
    gen = torch.Generator().manual_seed(31)
    s = torch.randint(0, 4, (50, 23), generator=gen).float()
    s[torch.rand(50, 23, generator=gen) < 0.3] = NEG
    for k in (1, 5, 16, 30):
        got = topk_lowest_index(s, k)
        assert got.shape == (50, k)
        assert got.tolist() == [spec_topk(row, k) for row in s.tolist()]


def test_topk_lowest_index_orders_negative_scores_and_signed_zeros():
    """The selection keys order floats as floats do: negatives below positives, −0 equal to
    +0 (a tie, to the lower index), −inf never picked, +inf above everything."""
    s = torch.tensor([[-0.0, 0.0, -1.5, -1e-30, 2.0, NEG, float("inf"), -3e38]])
    for k in range(1, 9):
        assert topk_lowest_index(s, k).tolist() == [spec_topk(s[0].tolist(), k)]
    gen = torch.Generator().manual_seed(32)
    s = torch.randn(40, 300, generator=gen) * torch.logspace(-30, 30, 300)
    s[:, ::7] = s[:, 3:4]  # ties
    s[torch.rand(40, 300, generator=gen) < 0.2] = NEG
    for k in (1, 17, 250, 300):
        assert topk_lowest_index(s, k).tolist() == [spec_topk(r, k) for r in s.tolist()]


def test_ranked_topk_is_a_stable_descending_sorts_first_k():
    """The routing's and the indexer's selection: exactly a stable descending sort's first k,
    in its order (the MoE sums its slots in that order), ties to the lowest index."""
    from strata.model.numerics import ranked_topk
    gen = torch.Generator().manual_seed(33)
    s = torch.randn(30, 384, generator=gen)
    s[:, ::5] = s[:, 2:3]                                   # ties
    s[:3] = torch.tensor([0.0, -0.0, 1.0, -1.0] * 96)      # signed zeros, many ties
    s[3] = float("inf")
    for k in (1, 6, 64, 384):
        want = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(ranked_topk(s, k), want)
        assert torch.equal(ranked_topk(s, k, sorted=False).sort(-1).values, want.sort(-1).values)


def spec_candidates(row: list[float], n_visible: int, block: int, n_blocks: int) -> list[bool]:
    n = len(row)
    nb = -(-n // block)
    bmax = [max(row[b * block:(b + 1) * block] + [NEG] * (block - len(row[b * block:(b + 1) * block])))
            for b in range(nb)]
    if n_visible > 0:
        bmax[(n_visible - 1) // block] = float("inf")
    keep = [b for b in spec_topk(bmax, n_blocks) if b >= 0]
    return [(j // block) in keep for j in range(n)]


def test_select_candidate_blocks_hand_examples():
    # 10 entries, blocks of 4 -> blocks {0-3}, {4-7}, {8, 9} (+2 padding); keep 2 blocks
    s = torch.tensor([
        [5.0, 0.0, 0.0, 0.0, 1.0, 9.0, 1.0, 1.0, 0.5, 0.2],   # newest block (2) lowest: pinned
        [5.0, 0.0, 0.0, 0.0, 1.0, 9.0, NEG, NEG, NEG, NEG],   # visible 6: block 1 pinned
        [3.0, NEG, NEG, NEG, 3.0, NEG, NEG, NEG, 3.0, NEG],   # tie of block maxima: lowest
        [NEG, NEG, 1.0, NEG, NEG, NEG, NEG, NEG, NEG, NEG],   # one finite block only
        [NEG] * 10,                                           # nothing visible
    ])
    n_vis = torch.tensor([10, 6, 9, 3, 0])
    blocks = select_candidate_blocks(s, n_vis, block=4, n_blocks=2)
    assert blocks.tolist() == [[1, 2], [0, 1], [0, 2], [0, -1], [-1, -1]]
    got = candidate_mask(blocks, 4, 10)
    B0, B1, B2 = [True] * 4 + [False] * 6, [False] * 4 + [True] * 4 + [False] * 2, \
        [False] * 8 + [True] * 2
    OR = lambda a, b: [x or y for x, y in zip(a, b)]  # noqa: E731
    exp = [OR(B1, B2),   # block 1 has the max (9), block 2 pinned; block 0 (5) dropped
           OR(B0, B1),   # block 1 pinned (entry 5 newest), block 0 next
           OR(B0, B2),   # pinned block 2, then the lowest of the tied blocks 0/1
           B0,           # blocks without a finite score are never kept
           [False] * 10]
    assert got.tolist() == exp
    for t in range(s.shape[0]):
        assert got[t].tolist() == spec_candidates(s[t].tolist(), int(n_vis[t]), 4, 2)


def test_select_candidate_blocks_random():
    gen = torch.Generator().manual_seed(32)
    T, n = 40, 29
    s = torch.randint(0, 6, (T, n), generator=gen).float()
    n_vis = torch.randint(0, n + 1, (T,), generator=gen)
    s = torch.where(torch.arange(n)[None] < n_vis[:, None], s, torch.full_like(s, NEG))
    for n_blocks in (1, 2, 3, 10):
        blocks = select_candidate_blocks(s, n_vis, block=8, n_blocks=n_blocks)
        assert blocks.shape == (T, min(n_blocks, 4))  # (29 entries: 4 blocks at most)
        got = candidate_mask(blocks, 8, n)
        entries = candidate_entries(blocks, 8)
        for t in range(T):
            ids = [j for j in entries[t].tolist() if j >= 0]
            assert ids == sorted(ids) and ids == [j for j in range(32) if j // 8 in blocks[t]]
            assert got[t].tolist() == spec_candidates(s[t].tolist(), int(n_vis[t]), 8, n_blocks)


def test_selection_visibility_in_model(runs):
    cfg = runs["model"].cfg
    for name in SCHEDULES:
        for ctx in runs[name]["ctxs"]:
            pos = ctx.positions.tolist()
            for l, sel in ctx.sel.items():
                r = cfg.ratio(l)
                assert sel.shape == (len(pos), cfg.index_topk)
                for t, p in enumerate(pos):
                    picks = [j for j in sel[t].tolist() if j >= 0]
                    assert all(j < (p + 1) // r for j in picks), (name, l, p, picks)
                    assert picks == sorted(set(picks))
                    if cfg.is_kv_source(l):  # scores of visible entries are all finite
                        assert len(picks) == min(cfg.index_topk, (p + 1) // r)
                    if cfg.is_reindex(l):
                        kept = set(ctx.candidates[t].tolist())
                        assert all(j // cfg.candidate_block_size in kept for j in picks)
                        n_fin = sum(j // cfg.candidate_block_size in kept
                                    for j in range((p + 1) // r))
                        assert len(picks) == min(cfg.index_topk, n_fin)
            if ctx.candidates is not None:
                blk = cfg.candidate_block_size
                for t, p in enumerate(pos):
                    nv = (p + 1) // cfg.ratio(cfg.candidate_source_layer_id)
                    ids = ctx.candidates[t].tolist()
                    blocks = [b for b in ids if b >= 0]
                    assert ids == blocks + [-1] * (len(ids) - len(blocks))  # −1 last
                    assert blocks == sorted(set(blocks))
                    assert len(blocks) <= cfg.candidate_topk_blocks
                    if nv:
                        assert (nv - 1) // blk in blocks  # the newest visible block is pinned
                    assert all(b * blk < nv for b in blocks)  # kept blocks have visible entries


@pytest.mark.parametrize("schedule", ["decode", "chunks_b"])
def test_selection_identical_across_schedules(runs, schedule):
    def stacked(name):
        return {l: torch.cat([c.sel[l] for c in runs[name]["ctxs"]]) for l in runs[name]["ctxs"][0].sel}

    ref, other = stacked("prefill"), stacked(schedule)
    assert ref.keys() == other.keys()
    for l in ref:
        assert torch.equal(ref[l], other[l]), f"layer {l}"


def test_indexer_scores_recomputed(tiny_reference):
    model = tiny_reference
    cfg = model.cfg
    nh, ihd, rd = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    freqs = spec_inv_freq(cfg.compress_rope_theta, rd, True, factor=cfg.rope_factor,
                          orig=cfg.original_max_position_embeddings)
    calls = {l: [] for l in cfg.index_source_layer_ids}
    N = 30
    state = model.new_state(32)
    with contextlib.ExitStack() as stack:
        for l in cfg.index_source_layer_ids:
            _capture(stack, model.layers[l].attn.indexer, "select", calls[l])
        _, ctx = model.forward(random_tokens(N, seed=7, vocab=cfg.vocab_size), state, logits="none")
    for l in cfg.index_source_layer_ids:
        (u, qr, _c, _s), = calls[l]
        idx = model.layers[l].attn.indexer
        r = cfg.ratio(l)
        keys = state.index_k[cfg.kv_source_of(l)].double()
        q = (qr.double() @ idx.wq_b.dequantize(torch.float64).T).view(N, nh, ihd)
        wts = (u.double() @ idx.weights_proj.dequantize(torch.float64).T) * ihd ** -0.5 * nh ** -0.5
        for t in range(N):
            qt = torch.stack([spec_rotate(q[t, h], t, freqs) for h in range(nh)])
            nvis = (t + 1) // r
            score = (wts[t][:, None] * torch.relu(qt @ keys[:nvis].T)).sum(0)  # [nvis]
            allowed = list(range(nvis))
            if cfg.is_reindex(l):
                kept = set(ctx.candidates[t].tolist())
                allowed = [j for j in allowed if j // cfg.candidate_block_size in kept]
            picks = [j for j in ctx.sel[l][t].tolist() if j >= 0]
            assert len(picks) == min(cfg.index_topk, len(allowed))
            rest = [j for j in allowed if j not in picks]
            if picks and rest:
                lo = min(score[j].item() for j in picks)
                hi = max(score[j].item() for j in rest)
                assert lo >= hi - 1e-4 * max(1.0, abs(hi)), (l, t, lo, hi)


def test_indexer_scores_queries_in_bounded_pieces(tiny_reference, monkeypatch):
    """A long prefill's queries are scored a few at a time (indexer.SCORE_SCRATCH bounds the
    [rows, heads, entries] scratch, in bytes): the picks, the candidate blocks and the logits
    equal those of one piece, bit for bit."""
    from strata.model import indexer
    model, cfg = tiny_reference, tiny_reference.cfg
    tokens = random_tokens(200, seed=8, vocab=cfg.vocab_size)
    runs = []
    for scratch in (indexer.SCORE_SCRATCH, 4 * cfg.index_n_heads * 64 * 3):  # one piece; 3 rows
        monkeypatch.setattr(indexer, "SCORE_SCRATCH", scratch)
        state = model.new_state(256)
        logits, ctx = model.forward(tokens, state, logits="all")
        runs.append((logits, ctx.candidates, {l: ctx.sel[l] for l in cfg.index_source_layer_ids}))
    (a, ca, sa), (b, cb, sb) = runs
    assert ca is not None and torch.equal(ca, cb) and torch.equal(a, b)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[l], sb[l]) for l in sa)


def test_indexer_pieces_are_multiples_of_16_queries(tiny_reference, monkeypatch):
    """Where the scratch allows 16 queries or more a piece, pieces are a multiple of 16 (a
    budget of 37 rows scores 32 at a time): every piece's slices start 16-byte aligned, so a
    long prompt meets no new kernel specialisation mid-prefill. The picks are one piece's."""
    from strata.model import indexer
    model, cfg = tiny_reference, tiny_reference.cfg
    tokens = random_tokens(200, seed=8, vocab=cfg.vocab_size)
    want = model.forward(tokens, model.new_state(256), logits="all")
    sizes, topk = [], indexer.topk_lowest_index

    def spy(scores, k, ids=None):
        sizes.append(scores.shape[0])
        return topk(scores, k, ids)

    monkeypatch.setattr(indexer, "topk_lowest_index", spy)
    n = indexer.entry_bucket(200 // cfg.ratio(cfg.index_source_layer_ids[0]))
    monkeypatch.setattr(indexer, "SCORE_SCRATCH", 4 * cfg.index_n_heads * n * 37)
    logits, ctx = model.forward(tokens, model.new_state(256), logits="all")
    # (each piece's picks — and a candidate source's blocks — ranked once: 32 at a time, the
    # last 200 − 6·32 = 8)
    assert set(sizes) == {32, 200 % 32}, sizes
    assert torch.equal(logits, want[0]) and torch.equal(ctx.candidates, want[1].candidates)


def test_attention_runs_queries_in_bounded_pieces(tiny_reference, monkeypatch):
    """A long forward's queries attend a few at a time (attention.ATTN_SCRATCH bounds the
    scratch scratch_per_query counts; above 16 queries, pieces of a multiple of 16): logits
    and every cache row equal one piece's, bit for bit."""
    from strata.model import attention
    model, cfg = tiny_reference, tiny_reference.cfg
    tokens = random_tokens(150, seed=9, vocab=cfg.vocab_size)
    sizes, attend = [], attention.Attention.attend_heads
    monkeypatch.setattr(attention.Attention, "attend_heads",
                        lambda self, q, *a, **kw: sizes.append(len(q)) or attend(self, q, *a, **kw))
    runs = []
    # the default: one piece a forward; 37 queries' scratch: pieces of 32; one query a piece
    for scratch, want in ((None, {100, 50}), (37, {32, 100 % 32, 50 % 32}), (1, {1})):
        if scratch is not None:  # (in units of a query's scratch)
            monkeypatch.setattr(attention, "scratch_per_query", lambda *a: 1)
            monkeypatch.setattr(attention, "ATTN_SCRATCH", scratch)
        sizes.clear()
        runs.append(forward_100_then_rest(model, tokens))
        assert set(sizes) == want, (scratch, sorted(set(sizes)))
    same_runs(runs)


def test_a_few_queries_scratch_counts_their_stored_p(monkeypatch):
    """scratch_per_query's CUDA count (the availability check mocked: no CUDA here): where
    ATTN_SCRATCH holds at most SMALL_BATCH queries, a query also holds its stored p — fp32
    for fp32 rows, three bf16 parts (6 bytes an entry) for bf16 rows, as sink_softmax_pv
    allocates it; bigger pieces form p in the product and count none."""
    from strata.kernels import attention as attn_kernels
    from strata.kernels.rowwise import SMALL_BATCH
    from strata.model import attention
    from strata.runtime.state import PositionRing
    monkeypatch.setattr(attn_kernels, "available", lambda t: True)
    monkeypatch.setattr(attn_kernels, "row_table_applies", lambda *a: False)
    H, n, hd = 64, 640, 512
    for dt, p_bytes in ((torch.float32, 4), (torch.bfloat16, 6)):
        kv = torch.zeros(1, hd, dtype=dt)
        ring = PositionRing(8, (hd,), dt, torch.device("cpu"), keep=7)
        base = n * hd * dt.itemsize + n + 4 * H * n + 8 * H
        monkeypatch.setattr(attention, "ATTN_SCRATCH", base * 300)
        assert attention.scratch_per_query(kv, ring, None, H, n) == base
        monkeypatch.setattr(attention, "ATTN_SCRATCH", base * SMALL_BATCH)
        assert attention.scratch_per_query(kv, ring, None, H, n) == base + p_bytes * H * n


# ------------------------------------------------------------------------------------------
# 5. MoE
# ------------------------------------------------------------------------------------------
def _bare_moe(gate_w: torch.Tensor, bias: torch.Tensor, top_k: int, gate_temp: float = 1.0) -> MoE:
    moe = object.__new__(MoE)
    moe.cfg = replace(v41_flash_config(), gate_temp=gate_temp)
    moe.top_k = top_k
    moe.gate = DenseLinear(gate_w.float())
    moe.bias = bias.float()
    moe.bias_vl = None
    return moe


REF = Numerics(mode="reference")


@pytest.mark.parametrize("gate_temp", [1.0, 2.0])
def test_route_weights_from_unbiased_scores(gate_temp):
    gen = torch.Generator().manual_seed(41)
    E, D, k, T = 12, 16, 3, 5
    W = torch.randn(E, D, generator=gen)
    u = torch.randn(T, D, generator=gen)
    s = torch.sqrt(F.softplus((u.double() @ W.double().T) / gate_temp))
    # a bias that drags the 3 lowest-scoring experts of every token to the top
    lowest = torch.argsort(s, dim=-1)[:, :k]
    for t in range(T):
        bias = torch.zeros(E)
        bias[lowest[t]] = 100.0 + torch.arange(k, dtype=torch.float32)
        moe = _bare_moe(W, bias, k, gate_temp)
        idx, w = moe.route(u[t:t + 1], REF)
        assert sorted(idx[0].tolist()) == sorted(lowest[t].tolist())
        picked = s[t, idx[0]]
        exp = picked / (picked.sum() + 1e-20) * 1.5
        torch.testing.assert_close(w[0].double(), exp, atol=1e-6, rtol=1e-5)
        assert w[0].sum().item() == pytest.approx(1.5, rel=1e-6)
    # the bias moves only the selection: same picks with another bias -> same weights
    b1, b2 = torch.zeros(E), torch.zeros(E)
    b1[[0, 5, 7]] = 50.0
    b2[[0, 5, 7]] = torch.tensor([10.0, 30.0, 20.0])
    i1, w1 = _bare_moe(W, b1, k, gate_temp).route(u, REF)
    i2, w2 = _bare_moe(W, b2, k, gate_temp).route(u, REF)
    for t in range(T):
        d1 = dict(zip(i1[t].tolist(), w1[t].tolist()))
        d2 = dict(zip(i2[t].tolist(), w2[t].tolist()))
        assert d1.keys() == d2.keys() == {0, 5, 7}
        for e in d1:
            assert d1[e] == pytest.approx(d2[e], rel=1e-6)
            assert d1[e] == pytest.approx(float(s[t, e] / s[t, [0, 5, 7]].sum() * 1.5), rel=1e-5)


def test_route_zero_scores_and_ties():
    E, D = 8, 4
    # gate logits so negative that softplus underflows to 0: the +1e-20 keeps weights finite
    u = torch.ones(1, D)
    moe = _bare_moe(torch.full((E, D), -100.0), torch.zeros(E), 2)
    idx, w = moe.route(u, REF)
    assert torch.isfinite(w).all() and (w == 0).all()
    assert idx.tolist() == [[0, 1]]  # all tied -> lowest indices
    # ties in the biased score go to the lowest expert id
    moe = _bare_moe(torch.zeros(E, D), torch.tensor([0.0, 1.0, 0.0, 2.0, 0.0, 1.0, 1.0, 0.0]), 3)
    idx, w = moe.route(u, REF)
    assert set(idx[0].tolist()) == {3, 1, 5}
    torch.testing.assert_close(w, torch.full((1, 3), 0.5))  # equal unbiased scores


def test_swiglu_clamps():
    g = torch.tensor([-30.0, -12.0, -3.0, 0.0, 4.0, 12.0, 30.0])
    v = torch.tensor([-30.0, 7.0, -12.0, 3.0, 11.0, -2.0, 30.0])
    got = swiglu(g, v, 10.0)
    torch.testing.assert_close(got.double(), spec_swiglu(g, v, 10.0), atol=1e-6, rtol=1e-6)
    # g is clamped only from above: silu(-30) ≈ -2.8e-12, not silu(-10)
    assert abs(got[0].item()) < 1e-9
    assert got[6].item() == pytest.approx(10 * (10 / (1 + math.exp(-10))), rel=1e-6)
    assert got[2].item() == pytest.approx(-10 * (-3 / (1 + math.exp(3))), rel=1e-6)


def _expert_reference(x, idx, weight, experts, quantize):
    """Σ_slots W2_e(swiglu(W1_e x, W3_e x)·w) with the stack's dequantized weights."""
    W1, W3, W2 = (experts.dense(n, torch.float32).double() for n in ("w1", "w3", "w2"))
    lim = experts.limit
    xq = fp8_act_qdq(x) if quantize else x
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for s in range(idx.shape[1]):
            e = int(idx[t, s])
            a = spec_swiglu(W1[e] @ xq[t].double(), W3[e] @ xq[t].double(), lim) * float(weight[t, s])
            if quantize:
                a = fp8_act_qdq(a.float()).double()
            out[t] += W2[e] @ a  # the routing weight is applied BEFORE w2
    return out


@pytest.mark.parametrize("T", [2, 12])  # the gather path (T·k <= 16) and the grouped path
def test_expert_stack_forward_matches_hand_computation(tiny_reference, T):
    experts = tiny_reference.layers[0].ffn.experts
    assert experts.quantized
    k = 2
    assert (T * k <= GATHER_PAIRS) == (T == 2)
    gen = torch.Generator().manual_seed(42)
    D = tiny_reference.cfg.hidden_size
    x = torch.randn(T, D, generator=gen) * 12  # large enough that the clamps bite
    E = experts.n_experts
    first = (3 + torch.arange(T)) % E
    idx = torch.stack((first, (first + 1 + torch.arange(T) % 3) % E), dim=1)  # 2 experts/token
    weight = 0.3 + torch.rand(T, k, generator=gen)
    W1 = experts.dense("w1", torch.float32).double()
    W3 = experts.dense("w3", torch.float32).double()
    g_all = torch.stack([W1[int(idx[t, s])] @ x[t].double() for t in range(T) for s in range(k)])
    v_all = torch.stack([W3[int(idx[t, s])] @ x[t].double() for t in range(T) for s in range(k)])
    assert (g_all > 10).any() and (g_all < -10).any()  # both clamps and the open side of g
    assert (v_all > 10).any() and (v_all < -10).any()
    ref = _expert_reference(x, idx, weight, experts, quantize=False)
    got = experts.forward(x, idx, weight, Numerics(mode="reference"))
    torch.testing.assert_close(got.double(), ref, atol=2e-4, rtol=1e-4)
    # the test would see a symmetric clamp on g
    W2 = experts.dense("w2", torch.float32).double()
    sym = torch.zeros_like(ref)
    for t in range(T):
        for s in range(k):
            e = int(idx[t, s])
            g = (W1[e] @ x[t].double()).clamp(-10, 10)
            v = (W3[e] @ x[t].double()).clamp(-10, 10)
            sym[t] += W2[e] @ (F.silu(g) * v * float(weight[t, s]))
    assert (sym - ref).abs().max() > 1e-3
    # vendor numerics: fp8 activation before w1/w3 and before w2, on the WEIGHTED activation
    vref = _expert_reference(x, idx, weight, experts, quantize=True)
    vgot = experts.forward(x, idx, weight, Numerics(mode="vendor"))
    err = (vgot.double() - vref).abs().max().item()
    after = torch.zeros_like(vref)  # weight applied after w2 instead
    xq = fp8_act_qdq(x).double()
    for t in range(T):
        for s in range(k):
            e = int(idx[t, s])
            a = spec_swiglu(W1[e] @ xq[t], W3[e] @ xq[t], experts.limit)
            after[t] += (W2[e] @ fp8_act_qdq(a.float()).double()) * float(weight[t, s])
    err_after = (vgot.double() - after).abs().max().item()
    print(f"vendor expert error {err:.2e}; weight-after-w2 would be {err_after:.2e}")
    assert err < 2e-3 and err_after > 5 * max(err, 1e-4), (err, err_after)


# ------------------------------------------------------------------------------------------
# 6. Engram gate
# ------------------------------------------------------------------------------------------
class _RowsTable:
    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows[ids]


def _bare_engram(H, D, n_ids, hd, gen, zero_key_copy=None):
    eng = object.__new__(Engram)
    eng.cfg = v41_flash_config()  # rms_norm_eps = 1e-20
    eng.table = _RowsTable(torch.randn(10, hd, generator=gen))
    W = torch.randn((H + 1) * D, n_ids * hd, generator=gen) * 0.2
    if zero_key_copy is not None:
        W[zero_key_copy * D:(zero_key_copy + 1) * D] = 0
    eng.wkv = DenseLinear(W)
    eng.qk_weight = (1 + 0.3 * torch.randn(H, D, generator=gen)) * (1 + 0.3 * torch.randn(H, D, generator=gen))
    return eng, W


def _engram_reference(eng, W, h, ids, D):
    T, H, _ = h.shape
    out = torch.empty(T, H, D, dtype=torch.float64)
    gates = torch.empty(T, H, dtype=torch.float64)
    for t in range(T):
        mem = eng.table.rows[ids[t]].double().flatten()
        kv = W.double() @ mem
        value = kv[H * D:]
        for i in range(H):
            key = kv[i * D:(i + 1) * D]
            hi = h[t, i].double()
            dot = float((hi * eng.qk_weight[i].double() * key).sum())
            dot *= 1 / math.sqrt(float((hi * hi).mean()) + EPS)
            dot *= 1 / math.sqrt(float((key * key).mean()) + EPS)
            dot /= math.sqrt(D)
            z = math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot)
            gates[t, i] = 1 / (1 + math.exp(-z))
            out[t, i] = hi + gates[t, i] * value
    return out, gates


def test_engram_gate_matches_spec():
    H, D, n_ids, hd = 4, 8, 3, 4
    gen = torch.Generator().manual_seed(61)
    eng, W = _bare_engram(H, D, n_ids, hd, gen)
    h = torch.randn(5, H, D, generator=gen) * 3
    ids = torch.randint(0, 10, (5, n_ids), generator=gen)
    got = eng.forward(h, ids, REF)
    exp, gates = _engram_reference(eng, W, h, ids, D)
    torch.testing.assert_close(got.double(), exp, atol=1e-5, rtol=1e-5)
    assert (gates < 0.5).any() and (gates > 0.5).any()  # both signs of dot exercised


def test_engram_gate_at_zero_dot():
    H, D, n_ids, hd = 4, 8, 3, 4
    gen = torch.Generator().manual_seed(62)
    eng, W = _bare_engram(H, D, n_ids, hd, gen, zero_key_copy=0)
    eng.qk_weight = eng.qk_weight.abs()
    h = torch.randn(2, H, D, generator=gen).abs() + 0.1  # h·w·key = +0 exactly for copy 0
    ids = torch.randint(0, 10, (2, n_ids), generator=gen)
    got = eng.forward(h, ids, REF)
    value = torch.stack([W[H * D:].double() @ eng.table.rows[ids[t]].double().flatten()
                         for t in range(2)])
    gate0 = 1 / (1 + math.exp(-1e-3))  # copysign(sqrt(1e-6), +0) = +1e-3
    torch.testing.assert_close(got[:, 0].double(), h[:, 0].double() + gate0 * value,
                               atol=1e-6, rtol=1e-6)
    exp, _ = _engram_reference(eng, W, h, ids, D)
    torch.testing.assert_close(got.double(), exp, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------
# 7. The lagged pre (V4.1 §2.2)
# ------------------------------------------------------------------------------------------
def _with_pre_logits(hc: HcWeights, H: int, delta: torch.Tensor) -> HcWeights:
    base = hc.base.clone()
    base[:H] += delta
    return HcWeights(fn=hc.fn, base=base, scale=hc.scale)


def _sublayer_inputs(model, tokens, patch=None):
    """Run a fresh forward; return {(layer, 'attn'|'ffn'): input u} and the logits."""
    got = {}
    with contextlib.ExitStack() as stack:
        for l in (0, 1):
            block = model.layers[l]
            for kind, obj in (("attn", block.attn), ("ffn", block.ffn)):
                store = got.setdefault((l, kind), [])
                _capture(stack, obj, "forward", store)
        if patch is not None:
            layer, which, delta = patch
            block = model.layers[layer]
            stack.enter_context(_set_attr(block, which, _with_pre_logits(
                getattr(block, which), model.cfg.hc_mult, delta)))
        logits, _ = model.forward(tokens, model.new_state(16))
    return {key: v[0][0].clone() for key, v in got.items()}, logits


def test_lagged_pre(tiny_reference):
    model = tiny_reference
    cfg = model.cfg
    toks = random_tokens(6, seed=8, vocab=cfg.vocab_size)
    delta = torch.tensor([2.0, -1.5, 0.7, -3.0])
    base, _ = _sublayer_inputs(model, toks)

    # layer 0's attention input: one-hot pre -> RMSNorm(embedding; attn_norm)
    e = model.embed[toks].double()
    torch.testing.assert_close(base[(0, "attn")].double(),
                               spec_rms_norm(e, model.layers[0].attn_norm), atol=1e-5, rtol=1e-5)

    def differs(a, b):
        return (a - b).abs().max().item() > 1e-3 * b.abs().max().item()

    # changing layer 0's hc_attn pre logits: attention input unchanged, FFN input changed
    mod, _ = _sublayer_inputs(model, toks, (0, "hc_attn", delta))
    assert torch.equal(mod[(0, "attn")], base[(0, "attn")])
    assert differs(mod[(0, "ffn")], base[(0, "ffn")])

    # same one layer later, where the copies differ
    mod, _ = _sublayer_inputs(model, toks, (1, "hc_attn", delta))
    assert torch.equal(mod[(1, "attn")], base[(1, "attn")])
    assert differs(mod[(1, "ffn")], base[(1, "ffn")])

    # layer 0's FFN pre is used by layer 1's attention, not by layer 0's FFN
    mod, _ = _sublayer_inputs(model, toks, (0, "hc_ffn", delta))
    assert torch.equal(mod[(0, "ffn")], base[(0, "ffn")])
    assert differs(mod[(1, "attn")], base[(1, "attn")])


def test_instances_left_unpatched(tiny_reference):
    """The capture helpers above leave no instance attribute behind on the shared model."""
    for block in tiny_reference.layers:
        assert "forward" not in vars(block.attn) and "forward" not in vars(block.ffn)
        if block.attn.indexer is not None:
            assert "select" not in vars(block.attn.indexer)
