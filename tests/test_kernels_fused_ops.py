"""The fused small-op kernels — mHC (strata.kernels.mhc) and RMSNorm (strata.kernels.norm) —
against the torch definitions (strata.model.mhc, numerics.rms_norm), under TRITON_INTERPRET=1
on CPU. collapse and hc_update repeat the torch operations in order and
must give its bits; hc_mix sums in its own fixed order and hc_coeffs uses Triton's exp /
sigmoid / rsqrt, so they are held to a few fp32 ulps, and each of their rows must not depend
on the other rows of the call."""
from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first launched

from strata.kernels import mhc as K  # noqa: E402
from strata.model import mhc as ref  # noqa: E402
from strata.model.mhc import HcWeights  # noqa: E402


def weights(H: int, D: int, seed: int) -> HcWeights:
    g = torch.Generator().manual_seed(seed)
    n = (2 + H) * H
    return HcWeights(fn=torch.randn(n, H * D, generator=g) * (H * D) ** -0.5,
                     base=torch.randn(n, generator=g) * 0.5,
                     scale=torch.rand(3, generator=g) + 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_mix_matches_the_products_and_rows_stand_alone(dtype):
    """The mixing products and the sum of squares in one pass (K past one chunk, the stream in
    its stored dtype): the torch values to fp32 rounding, and each row's bits the same alone
    (a decode step) as among a prefill's rows, in a program's first rows and past its first
    program. (Under the interpreter the IEEE products are numpy's matmul, whose bits for a
    row can change with its place from the sixth row of a tile on; the GPU forms' rows are
    checked in place by tests/gpu and scripts/probe_mhc_prefill.py.)"""
    H, D, T = 4, 300, 70  # (the IEEE products: 16 rows a program at every size)
    w = weights(H, D, 11)
    g = torch.Generator().manual_seed(12)
    h = torch.randn(T, H, D, generator=g).to(dtype)
    m, sq = K.hc_mix(h, w.fn)
    x = h.float().flatten(1)
    torch.testing.assert_close(m, x @ w.fn.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sq, (x * x).sum(-1), rtol=1e-5, atol=0)
    for i in (0, 17, 69):
        mi, sqi = K.hc_mix(h[i:i + 1], w.fn)
        assert torch.equal(mi, m[i:i + 1]) and torch.equal(sqi, sq[i:i + 1])
    with pytest.raises(ValueError, match="does not match"):
        K.hc_mix(h, w.fn[:, :-1])


@pytest.mark.parametrize("H", [4, 3])
def test_hc_coeffs_match_the_definition_and_rows_are_independent(H):
    D, T = 32, 21
    w = weights(H, D, seed=H)
    h = torch.randn(T, H, D, generator=torch.Generator().manual_seed(7)) * 3
    x = h.flatten(1)
    m, ms = x @ w.fn.T, (x * x).mean(-1, keepdim=True)
    got = K.hc_coeffs(m, ms, w.scale, w.base, H, 1e-6, 1e-6, 20)
    want = ref.hc_mixes(h, w, 1e-6, 1e-6, 20)
    for g_, w_, name in zip(got, want, ("pre", "post", "comb")):
        assert g_.shape == w_.shape, name
        assert torch.allclose(g_, w_, rtol=4e-6, atol=1e-7), (name, (g_ - w_).abs().max())
    comb = got[2]
    assert torch.allclose(comb.sum(-2), torch.ones(T, H), atol=1e-5)  # doubly stochastic
    alone = K.hc_coeffs(m[13:14], ms[13:14], w.scale, w.base, H, 1e-6, 1e-6, 20)
    for a, full in zip(alone, got):
        assert torch.equal(a[0], full[13])
    # a sum of squares divided in the kernel (hc_mix's form, a strided column) == the mean
    sq = torch.stack(((x * x).sum(-1), torch.zeros(T)), 1)[:, 0]
    by_count = K.hc_coeffs(m, sq, w.scale, w.base, H, 1e-6, 1e-6, 20, ms_count=H * D)
    by_mean = K.hc_coeffs(m, sq / (H * D), w.scale, w.base, H, 1e-6, 1e-6, 20)
    assert all(torch.equal(a, b) for a, b in zip(by_count, by_mean))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, H", [(3, 4), (20, 4), (20, 3)])
def test_collapse_and_update_give_the_definitions_bits(dtype, T, H):
    """(hc_update's programs take BLOCK_D / H columns for a decode's few rows, BLOCK_D for
    more; H 3: the copies padded to 4)"""
    D = 700  # not a multiple of BLOCK_D
    g = torch.Generator().manual_seed(1)
    h = torch.randn(T, H, D, generator=g).to(dtype)
    pre = torch.rand(T, H, generator=g)
    y = torch.randn(T, D, generator=g).to(dtype)
    post = torch.rand(T, H, generator=g) * 2
    comb = torch.softmax(torch.randn(T, H, H, generator=g), -1)
    assert torch.equal(K.collapse(h, pre), ref.collapse(h, pre))
    assert torch.equal(K.hc_update(y, h, post, comb), ref.hc_update(y, h, post, comb))
    # strided inputs (a view of a wider stream) are read correctly
    wide = torch.randn(T, H, D + 5, generator=g).to(dtype)[:, :, :D]
    assert torch.equal(K.collapse(wide, pre), ref.collapse(wide, pre))
    assert K.collapse(h[:0], pre[:0]).shape == (0, D)


def test_hc_coeffs_rejects_a_wrong_width():
    with pytest.raises(ValueError, match="expected 24"):
        K.hc_coeffs(torch.zeros(2, 20), torch.ones(2), torch.ones(3), torch.zeros(24), 4,
                    1e-6, 1e-6, 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_kernel_matches_the_definition_and_rows_are_independent(dtype):
    from strata.kernels import norm
    from strata.model.numerics import rms_norm as definition
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 3, 1500, generator=g) * 4).to(dtype)  # K spans two chunks, masked tail
    w = torch.rand(1500, generator=g) + 0.5
    for weight in (w, None):
        got, want = norm.rms_norm(x, weight, 1e-6), definition(x, weight, 1e-6)
        assert got.shape == x.shape and got.dtype == dtype
        if dtype == torch.float32:
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
        else:  # at most one bf16 ulp apart (the fp32 values straddle a rounding boundary)
            assert ((got.float() - want.float()).abs() <= want.float().abs() / 128 + 1e-6).all()
        alone = norm.rms_norm(x[4, 1:2], weight, 1e-6)
        assert torch.equal(alone[0], got[4, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_norm_and_its_rope_in_one_launch_are_the_two_kernels_bits(dtype):
    """rms_norm_rope = apply_rope(rms_norm(x)) through the two kernels, bit for bit — a
    window key's shape (512 wide, 64 roped channels), a row of two column blocks with the
    roped tail inside the second, and one whose roped tail straddles the blocks."""
    from strata.kernels import norm
    from strata.kernels import rope as rope_kernel
    from strata.model import rope
    g = torch.Generator().manual_seed(19)
    for K, rd in ((512, 64), (1300, 64), (1100, 128)):
        x = (torch.randn(5, K, generator=g) * 3).to(dtype)
        w = torch.rand(K, generator=g) + 0.5
        inv_freq = 10000.0 ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
        cos, sin = rope.rope_cos_sin(inv_freq, torch.tensor([3, 4, 90, 1000, 70_000]))
        got = norm.rms_norm_rope(x, w, 1e-6, cos, sin)
        want = rope_kernel.apply_rope(norm.rms_norm(x, w, 1e-6), cos, sin)
        assert got.dtype == dtype and torch.equal(got, want), (K, rd)
        assert torch.equal(norm.rms_norm_rope(x[2:3], w, 1e-6, cos[2:3], sin[2:3]), got[2:3])
    with pytest.raises(ValueError, match="rms_norm_rope"):
        norm.rms_norm_rope(x, w, 1e-6, cos[:4], sin[:4])


def test_rope_table_kernel_gives_the_definitions_bits():
    """cos/sin of a forward's positions in one launch: the fp64 angle, cos and sin, one
    rounding each — the torch definition's values (positions up to 1M, V4.1's YaRN table)."""
    from strata.config import v41_flash_config
    from strata.kernels import rope as kernel
    from strata.model import rope
    cfg = v41_flash_config()
    positions = torch.tensor([0, 1, 2, 127, 4096, 65_537, 524_287, 1_048_575])
    for ratio in (0, 2):
        inv_freq = rope.rope_inv_freq(cfg, ratio)
        got = kernel.cos_sin(inv_freq, positions)
        want = rope.rope_cos_sin(inv_freq, positions)
        assert all(g.dtype == torch.float32 for g in got)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), ratio
    empty = kernel.cos_sin(rope.rope_inv_freq(cfg, 0), positions[:0])
    assert empty[0].shape == (0, cfg.qk_rope_head_dim // 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("small", [256, 0])  # one row a program; kernel.ROWS rows a program
def test_rope_kernel_gives_the_definitions_bits(dtype, inverse, small, monkeypatch):
    from strata.kernels import rope as kernel
    from strata.model import rope
    monkeypatch.setattr(kernel, "SMALL", small)
    g = torch.Generator().manual_seed(6)
    inv_freq = 10000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    cos, sin = rope.rope_cos_sin(inv_freq, torch.tensor([3, 4, 90]))
    for shape in ((3, 40), (3, 5, 300), (3, 16)):  # [T, d], [T, heads, d] (head > BH), all-rope
        x = (torch.randn(*shape, generator=g) * 2).to(dtype)
        got = kernel.apply_rope(x, cos, sin, inverse)
        assert torch.equal(got, rope.apply_rope(x, cos, sin, inverse)), shape
        # written in bf16 by the kernel (the attention output's inverse rope): torch's cast
        # of the fp32 result, ties to even included (1 + 3·2⁻⁸ in a head channel rounds up)
        x.view(-1)[0] = 1 + 3 * 2 ** -8
        got = kernel.apply_rope(x, cos, sin, inverse, out_dtype=torch.bfloat16)
        want = rope.apply_rope(x, cos, sin, inverse).to(torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), shape
        assert torch.equal(rope.apply_rope(x, cos, sin, inverse, out_dtype=torch.bfloat16),
                           want)
        # in place (the queries): x itself, the copy's bits — through the kernel and torch
        want = rope.apply_rope(x, cos, sin, inverse)
        for fn in (kernel.apply_rope, rope.apply_rope):
            y = x.clone()
            assert fn(y, cos, sin, inverse, in_place=True) is y and torch.equal(y, want), shape
    # a layout [T, rows, d] cannot view (two middle dims that do not merge): rotated in a
    # copy, written back into x
    x = torch.randn(3, 2, 5, 40, generator=g).to(dtype).permute(0, 2, 1, 3)
    assert x.reshape(3, -1, 40).data_ptr() != x.data_ptr()
    want = rope.apply_rope(x, cos, sin, inverse)
    assert kernel.apply_rope(x, cos, sin, inverse, in_place=True) is x and torch.equal(x, want)
    with pytest.raises(ValueError, match="in place keeps"):
        rope.apply_rope(x, cos, sin, inverse, out_dtype=torch.float16, in_place=True)


@pytest.mark.parametrize("D", [300, 400])  # K = 1,200 or 1,600: 5 or 7 chunks of ≤ 256
def test_the_models_mix_and_coefficients_in_two_launches(D):
    """hc_mixed_coeffs (the coefficients kernel adding hc_mix's chunk partials itself, as
    one tile) gives hc_coeffs(*hc_mix(...)) (the chunks added in order) to fp32 rounding — K
    over several chunks, the last one partial — and every row alone gives its bits in the
    batch, wherever it sits."""
    H, T = 4, 21
    assert 4 * K.MIX_CHUNK < H * D  # more chunks than a power of two's padding leaves out
    w = weights(H, D, 13)
    h = torch.randn(T, H, D, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16)
    m, sq = K.hc_mix(h, w.fn)
    want = K.hc_coeffs(m, sq, w.scale, w.base, H, 1e-6, 1e-6, 20, ms_count=H * D)
    got = K.hc_mixed_coeffs(h, w.fn, w.scale, w.base, H, 1e-6, 1e-6, 20)
    for g_, w_, name in zip(got, want, ("pre", "post", "comb")):
        assert g_.shape == w_.shape, name
        assert torch.allclose(g_, w_, rtol=4e-6, atol=1e-7), (name, (g_ - w_).abs().max())
    for i in (0, 17, 20):
        alone = K.hc_mixed_coeffs(h[i:i + 1], w.fn, w.scale, w.base, H, 1e-6, 1e-6, 20)
        assert all(torch.equal(a[0], b[i]) for a, b in zip(alone, got)), i
    with pytest.raises(ValueError, match="columns"):
        K.hc_mixed_coeffs(h, w.fn[:-1], w.scale, w.base, H, 1e-6, 1e-6, 20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_collapse_and_its_norm_in_one_launch_are_the_two_kernels_bits(dtype):
    """collapse_rms_norm = rms_norm(collapse(h, pre)) through the two kernels, bit for bit —
    a row past one column block (masked tail), with and without a weight — and a row alone
    gives its bits in the batch."""
    from strata.kernels import norm
    g = torch.Generator().manual_seed(15)
    T, H, D = 5, 4, 1500
    h = (torch.randn(T, H, D, generator=g) * 3).to(dtype)
    pre = torch.rand(T, H, generator=g) + 0.1
    weight = torch.randn(D, generator=g).to(dtype)
    for w in (weight, None):
        got = norm.collapse_rms_norm(h, pre, w, 1e-6)
        want = norm.rms_norm(K.collapse(h, pre), w, 1e-6)
        assert got.dtype == dtype and torch.equal(got, want)
        assert torch.equal(norm.collapse_rms_norm(h[3:4], pre[3:4], w, 1e-6), got[3:4])
    with pytest.raises(ValueError, match="pre"):
        norm.collapse_rms_norm(h, pre[:, :3], weight, 1e-6)
