"""The Engram kernels (strata.kernels.engram) under TRITON_INTERPRET=1: the gate and its update
of the stream against the torch steps (strata.model.engram.gate_update on CPU), and the n-gram
row ids against the host hash (NgramHasher.ids), alone and inside a forward
(tests/gpu/test_kernels_fused_ops_gpu.py runs them compiled)."""
from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is first launched

from strata.bench.synthetic import synthetic_hasher  # noqa: E402
from strata.config import v41_flash_config  # noqa: E402
from strata.kernels import engram as kernels  # noqa: E402
from strata.model.engram import gate_update as torch_gate  # noqa: E402
from strata.model.model import Model  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gate_and_update_give_the_torch_steps_values(dtype):
    """Copies of a stream whose row width is past a power of two, the keys and value views of
    one projection (strided rows), a row whose dot is exactly zero (copysign keeps +0 at
    +1e-3) and one with a negative dot; each row alone gives its bits in the batch."""
    g = torch.Generator().manual_seed(5)
    T, H, D = 5, 4, 1100
    h = (torch.randn(T, H, D, generator=g) * 2).to(dtype)
    w = torch.randn(H, D, generator=g)
    kv = torch.randn(T, (H + 1) * D, generator=g)
    kv[0, :D] = 0  # row 0, copy 0: the dot is +0
    key, value = kv[:, :H * D].view(T, H, D), kv[:, H * D:]
    got = kernels.gate_update(h, w, key, value, 1e-20)
    want = torch_gate(h, w, key, value, 1e-20)
    assert got.dtype == dtype and got.shape == (T, H, D)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    one = kernels.gate_update(h[3:4], w, key[3:4], value[3:4], 1e-20)
    assert torch.equal(one[0], got[3])


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="engram gate"):
        kernels.gate_update(torch.zeros(2, 4, 8), torch.zeros(4, 8), torch.zeros(2, 4, 8),
                            torch.zeros(2, 7), 1e-6)


def _padded(history: list[int], span: int) -> torch.Tensor:
    return torch.tensor([-1] * (span - len(history)) + history, dtype=torch.long)


@pytest.mark.parametrize("T, history", [(1, [17, 99_000, 5]), (3, [4]), (2, []),
                                        (5, [8, -1, 12]), (150, [1, 2, 3])])
def test_device_ngram_ids_are_the_host_hash(T, history):
    """V4.1's hashing constants (both Engram layers; a stand-in token map): one decode token
    after a full history, the sequence's first tokens (short or no history: the pad class
    from the start backwards), a dead id (negative) in the history and one among the tokens
    (the n-grams reaching it or past it take the pad class), and more tokens than a program's
    block."""
    cfg = v41_flash_config()
    hasher = synthetic_hasher(cfg)
    g = torch.Generator().manual_seed(T)
    tokens = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    if T == 5:
        tokens[2] = -1
    want = hasher.ids(tokens, torch.tensor(history, dtype=torch.long))
    got = hasher.device_ids(_padded(history, cfg.engram_max_ngram_size - 1), tokens)
    assert set(got) == set(want) == set(cfg.engram_layer_ids)
    for layer in want:
        assert got[layer].dtype == torch.int64 and torch.equal(got[layer], want[layer]), layer


def test_a_forward_hashing_on_the_device_gives_the_host_hashs_logits(tiny_dir, monkeypatch):
    """The tiny model with every layer role, once hashing its Engram ids on the host and once
    inside the forward (Model.hashes_on_device, forced: on a GPU it is the default; the kernel
    runs under the interpreter here): a prompt from position 0 (no history) and two decode
    steps give the same logits bit for bit."""
    model = Model.load(tiny_dir, "cpu")
    assert model.cfg.engram_layer_ids
    tokens = torch.tensor([5, 17, 3, 200, 41, 9, 77, 150, 2, 64])

    def run():
        state = model.new_state(32)
        out = [model.forward(tokens[:8], state, logits="all")[0]]
        for t in tokens[8:]:
            out.append(model.forward(t.view(1), state, logits="last")[0])
        return out
    host = run()
    monkeypatch.setattr(Model, "hashes_on_device", property(lambda self: True))
    device = run()
    for a, b in zip(host, device):
        assert torch.equal(a, b)


def test_mismatched_hash_tables_are_refused():
    with pytest.raises(ValueError, match="ngram ids"):
        kernels.ngram_ids(torch.full((3,), -1), torch.zeros(2, dtype=torch.long),
                          torch.zeros(10, dtype=torch.long), torch.ones(2, 4, dtype=torch.long),
                          torch.ones(2, 3, 8, dtype=torch.long),
                          torch.zeros(2, 2, 8, dtype=torch.long), 0)
