"""EXL3 decoding against the format's definition (exl3.md §1), written out independently here
with plain Python integers, and the Exl3 linear against a dense product."""
from __future__ import annotations

import struct

import pytest
import torch

from strata.checkpoint.safetensors_io import CheckpointFolder, write_safetensors
from strata.checkpoint.weights import WeightReader
from strata.errors import CheckpointError
from strata.model.numerics import Numerics
from strata.quant.exl3 import (MARKERS, Exl3Linear, bits_per_weight, codebook_lut, decode_trellis,
                               hadamard128)


def f16(bits: int) -> float:
    return struct.unpack("<e", struct.pack("<H", bits & 0xFFFF))[0]


def to_f16(v: float) -> float:
    return struct.unpack("<e", struct.pack("<e", v))[0]


def cb_by_formula(codebook: str, s: int) -> float:
    """exl3.md §1.4, one state at a time."""
    if codebook == "mul1":
        x = (s * 0x83DCD12D) % 2**32
        b = sum((x >> (8 * i)) & 0xFF for i in range(4))
        return to_f16((1024 + b) * f16(0x1EEE) + f16(0xC931))
    x = (s * 89226354 + 64248484) % 2**32 if codebook == "3inst" else (s * 0xCBAC1FED) % 2**32
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    return to_f16(f16(x) + f16(x >> 16))


@pytest.mark.parametrize("codebook", ["3inst", "mcg", "mul1"])
def test_codebooks_match_their_formulas(codebook):
    lut = codebook_lut(codebook)
    for s in [0, 1, 2, 255, 256, 4097, 12345, 32768, 65534, 65535] + list(range(1000, 66000, 997)):
        s &= 0xFFFF
        assert float(lut[s]) == cb_by_formula(codebook, s), (codebook, s)


def test_codebook_statistics():
    """Published facts: MUL1 has 913 distinct values and std ≈ 1.000; 3INST/MCG std ≈ 1.244."""
    assert len(torch.unique(codebook_lut("mul1"))) == 913
    assert abs(float(codebook_lut("mul1").float().std()) - 1.000) < 2e-3
    for cb in ("3inst", "mcg"):
        assert abs(float(codebook_lut(cb).float().std()) - 1.244) < 2e-3


def ring_position(r: int, c: int) -> int:
    t = 4 * (c & 7) + ((r & 7) >> 1)
    j = (r & 1) | ((r >> 3) & 1) << 1 | (c >> 3) << 2
    return 8 * t + j


def scalar_decode(trellis: torch.Tensor, codebook: str) -> list[list[float]]:
    """The §1.3 bitstream read literally: u32 = lo | hi << 16, bit q = bit 31 - q%32 of
    word q//32, the state of weight p is the 16 bits ending at E(p), wrapping around."""
    kt, nt, L = trellis.shape
    K = bits_per_weight(L)
    R = int(256 * K)
    out = [[0.0] * (16 * nt) for _ in range(16 * kt)]
    for ti in range(kt):
        for tj in range(nt):
            u16 = [int(v) & 0xFFFF for v in trellis[ti, tj]]
            u32 = [u16[2 * w] | u16[2 * w + 1] << 16 for w in range(L // 2)]
            bit = [(u32[q // 32] >> (31 - q % 32)) & 1 for q in range(R)]
            for r in range(16):
                for c in range(16):
                    p = ring_position(r, c)
                    if K == int(K):
                        end = (p + 1) * int(K)
                    else:
                        KA = int(K - 0.5)
                        end = sum(KA + (i % 2) for i in range(p + 1))
                    s = 0
                    for b in range(16):
                        s = (s << 1) | bit[(end - 16 + b) % R]
                    out[16 * ti + r][16 * tj + c] = cb_by_formula(codebook, s)
    return out


@pytest.mark.parametrize("K,codebook", [(1, "3inst"), (2, "mcg"), (3, "mul1"), (4, "3inst"),
                                        (8, "mcg"), (1.5, "mul1"), (2.5, "mul1"), (3.5, "mul1")])
def test_decoder_matches_the_bitstream_definition(K, codebook):
    L = int(16 * K) if K == int(K) else int(16 * (K - 0.5)) + 8
    g = torch.Generator().manual_seed(int(K * 10))
    trellis = torch.randint(-2**15, 2**15, (1, 2, L), generator=g, dtype=torch.int32).to(torch.int16)
    got = decode_trellis(trellis, codebook)
    assert got.dtype == torch.float16 and got.shape == (16, 32)
    assert got.float().tolist() == scalar_decode(trellis, codebook)


def test_hand_worked_states():
    """All-zero bits: every state is 0; all-one bits: every state is 0xFFFF. One set bit at
    stream position 15 (K=1): weight p=0 ends at bit 1, window [-15, 1) → bit 15 is outside;
    the weight whose window ends at bit 16 (p = 15) reads it as its least significant bit."""
    zero = torch.zeros(1, 1, 16, dtype=torch.int16)
    assert torch.equal(decode_trellis(zero, "mcg"), codebook_lut("mcg")[0].expand(16, 16))
    ones = torch.full((1, 1, 16), -1, dtype=torch.int16)
    assert torch.equal(decode_trellis(ones, "mcg"), codebook_lut("mcg")[0xFFFF].expand(16, 16))
    one_bit = torch.zeros(1, 1, 16, dtype=torch.int16)
    one_bit[0, 0, 0] = 1 << 0  # u32[0] bit 0 (the low int16's bit 0) = stream bit 31
    w = decode_trellis(one_bit, "3inst")
    # stream bit 31 is in the windows of p = 15..30 (ends at 16..31): state bit 15-(31-(E-16))
    lut = codebook_lut("3inst")
    for p in range(256):
        end = p + 1
        s = 1 << (end - 32) if 31 < end <= 47 else 0
        r, c = next((r, c) for r in range(16) for c in range(16) if ring_position(r, c) == p)
        assert float(w[r, c]) == float(lut[s]), p


def test_bits_per_weight():
    assert bits_per_weight(32) == 2 and bits_per_weight(40) == 2.5 and bits_per_weight(128) == 8
    for bad in (0, 8, 20, 136):
        with pytest.raises(ValueError):
            bits_per_weight(bad)
    with pytest.raises(ValueError, match="mul1"):
        decode_trellis(torch.zeros(1, 1, 40, dtype=torch.int16), "mcg")


def test_hadamard():
    H = hadamard128()
    assert torch.allclose(H @ H, torch.eye(128), atol=1e-6) and torch.equal(H, H.T)
    assert float(H[3, 5]) * 128 ** 0.5 == pytest.approx((-1) ** bin(3 & 5).count("1"))
    assert float(H[6, 5]) * 128 ** 0.5 == pytest.approx((-1) ** bin(6 & 5).count("1"))


def random_exl3(out_f: int, in_f: int, K: int, codebook: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    kp, np_ = -(-in_f // 128) * 128, -(-out_f // 128) * 128
    trellis = torch.randint(-2**15, 2**15, (kp // 16, np_ // 16, 16 * K), generator=g,
                            dtype=torch.int32).to(torch.int16)
    suh = (torch.randn(kp, generator=g) * 0.05).half()
    svh = (torch.randn(np_, generator=g) * 0.05).half()
    return trellis, suh, svh


@pytest.mark.parametrize("out_f,in_f", [(256, 128), (200, 160)])
def test_linear_matches_dense_product(out_f, in_f):
    trellis, suh, svh = random_exl3(out_f, in_f, 3, "mul1")
    lin = Exl3Linear(trellis, suh, svh, "mul1", out_f, in_f)
    W = lin.dequantize()  # [out, in]
    assert W.shape == (out_f, in_f)
    # the definition, densely: W_(in,out) = diag(suh) H Ŵ H diag(svh)
    Hb = torch.block_diag(*[hadamard128()] * (suh.numel() // 128))
    Hn = torch.block_diag(*[hadamard128()] * (svh.numel() // 128))
    dense = torch.diag(suh.float()) @ Hb @ lin.w_hat().float() @ Hn @ torch.diag(svh.float())
    torch.testing.assert_close(W, dense[:in_f, :out_f].T, rtol=1e-5, atol=1e-6)
    x = torch.randn(5, in_f, generator=torch.Generator().manual_seed(1))
    y = lin(x, Numerics())
    ref = x @ W.T
    rel = float((y - ref).abs().max() / ref.abs().max())
    assert rel < 5e-3, rel  # fp16 rounding of the rotated activation, as in exllamav3


def write_linear(path, prefix, trellis, suh, svh, marker=None, marker_value=None, extra=None):
    tensors = {f"{prefix}.trellis": trellis, f"{prefix}.suh": suh, f"{prefix}.svh": svh}
    if marker:
        tensors[f"{prefix}.{marker}"] = torch.tensor(marker_value, dtype=torch.int32)
    tensors.update(extra or {})
    write_safetensors(path / "model.safetensors", tensors)
    return WeightReader(CheckpointFolder(path))


@pytest.mark.parametrize("marker,codebook", [(None, "3inst"), ("mcg", "mcg"), ("mul1", "mul1")])
def test_reader_builds_exl3_linears(tmp_path, marker, codebook):
    trellis, suh, svh = random_exl3(128, 256, 2, codebook)
    r = write_linear(tmp_path, "layers.0.attn.wq_a", trellis, suh, svh, marker,
                     MARKERS.get(marker))
    lin = r.linear("layers.0.attn.wq_a", 128, 256)
    assert isinstance(lin, Exl3Linear) and lin.codebook == codebook and lin.K == 2


@pytest.mark.parametrize("case,needle", [
    ("wrong_marker_value", "locked multiplier"),
    ("unknown_marker", "unknown tensor"),
    ("missing_svh", ".svh"),
    ("bad_shape", "padded to 128"),
])
def test_reader_errors(tmp_path, case, needle):
    trellis, suh, svh = random_exl3(128, 256, 2, "mcg")
    p = "layers.0.attn.wq_a"
    if case == "wrong_marker_value":
        r = write_linear(tmp_path, p, trellis, suh, svh, "mcg", 12345)
    elif case == "unknown_marker":
        r = write_linear(tmp_path, p, trellis, suh, svh,
                         extra={f"{p}.xyz": torch.tensor(7, dtype=torch.int32)})
    elif case == "missing_svh":
        write_safetensors(tmp_path / "model.safetensors", {f"{p}.trellis": trellis, f"{p}.suh": suh})
        r = WeightReader(CheckpointFolder(tmp_path))
    else:
        r = write_linear(tmp_path, p, trellis[:, :4], suh, svh[:64])
    with pytest.raises(CheckpointError, match=needle):
        r.linear(p, 128, 256)


@pytest.fixture(scope="module", params=["exl3", "exl3-routed"])
def exl3_model(request, tmp_path_factory):
    from strata.checkpoint.tiny import make_tiny
    from strata.model.model import Model
    d = make_tiny(tmp_path_factory.mktemp(request.param), "tiny", seed=1, fmt=request.param)
    return request.param, Model.load(d)


def test_exl3_fixture_uses_each_convention(exl3_model):
    from strata.quant.linear import Fp8Block32Linear
    fmt, m = exl3_model
    attn = m.layers[1].attn
    expert = m.layers[1].ffn.experts.linears["w1"][0]
    assert isinstance(expert, Exl3Linear)
    if fmt == "exl3":
        assert isinstance(attn.wq_a, Exl3Linear) and isinstance(m.head, Exl3Linear)
        assert all(isinstance(g, Exl3Linear) for g in attn.wo_a) and expert.K == 2.5
        assert isinstance(attn.compressor.wkv, Exl3Linear) and expert.codebook == "mul1"
    else:
        assert isinstance(attn.wq_a, Fp8Block32Linear) and expert.K == 2
        assert expert.codebook == "mcg"


def test_exl3_fixture_parity_and_dspark(exl3_model):
    from strata.runtime.session import Session
    from strata.runtime.speculative import SpecConfig
    from util import random_tokens
    _, m = exl3_model
    tokens = random_tokens(40, seed=2)
    full, _ = m.forward(tokens, m.new_state(64))
    state = m.new_state(64)
    dec = torch.cat([m.forward(tokens[i:i + 1], state)[0] for i in range(40)])
    assert torch.equal(dec, full)
    plain = Session(m, 96).run(tokens, 20, stop_ids=frozenset()).tokens
    spec = Session(m, 96, speculative=SpecConfig(length=4)).run(tokens, 20,
                                                                  stop_ids=frozenset()).tokens
    assert spec == plain


def test_inspect_reports_exl3_bits(tmp_path, capsys):
    from strata.checkpoint.tiny import make_tiny
    from strata.cli import main
    d = make_tiny(tmp_path / "x", "tiny", seed=0, fmt="exl3")
    assert main(["inspect", str(d)]) == 0
    out = capsys.readouterr().out
    assert ": EXL3;" in out
    experts = next(line for line in out.splitlines() if "routed experts" in line)
    assert "2.5: 192" in experts  # 8 layers × 8 experts × (w1, w2, w3) at K = 2.5
    head = next(line for line in out.splitlines() if "embed/head" in line)
    assert "6: 1" in head
