"""Sampling is a pure function of (seed, position, logits); sessions prefill in chunks."""
from __future__ import annotations

import pytest
import torch

from strata.errors import CapacityError, StrataError
from strata.runtime.sampling import SamplingParams, sample, uniform_noise
from strata.runtime.session import Session
from util import random_tokens


def test_noise_is_keyed_by_seed_position_and_token():
    pos = torch.tensor([0, 1, 2**40 + 5])
    a = uniform_noise(7, pos, 1000)
    assert torch.equal(a, uniform_noise(7, pos, 1000))
    assert torch.equal(a[1], uniform_noise(7, pos[1:2], 1000)[0])  # row alone == in a batch
    assert not torch.equal(a[0], a[1]) and not torch.equal(a, uniform_noise(8, pos, 1000))
    assert float(a.min()) > 0.0 and float(a.max()) < 1.0
    # roughly uniform: mean 1/2, variance 1/12 over 3000 draws
    assert abs(float(a.mean()) - 0.5) < 0.02 and abs(float(a.var()) - 1 / 12) < 0.01


def test_cpu_noise_is_the_device_paths_integer_hash():
    """On CPU the hash runs in numpy's wrapping uint32; elsewhere in torch's int64 limbs. Both
    give the same bits (a CPU run and a GPU run sample alike), seeds and positions past 2³²
    included; MurmurHash3's finaliser maps 1 to 0x514E28B7."""
    from strata.runtime.sampling import _fmix32, _fmix32_numpy, _uniform_noise_torch
    import numpy as np
    assert int(_fmix32(torch.tensor([1]))[0]) == 0x514E28B7
    assert int(_fmix32_numpy(np.array([1], dtype=np.uint32))[0]) == 0x514E28B7
    pos = torch.tensor([0, 1, 77, 2**32 - 1, 2**32, 2**40 + 5, 2**62 + 3])
    for seed in (0, 1, 0xFFFFFFFF, 2**32, 2**40 + 3, 2**63 - 1):
        want = _uniform_noise_torch(seed, pos, 5000)
        assert torch.equal(uniform_noise(seed, pos, 5000), want), seed
        assert torch.equal(uniform_noise(torch.tensor(seed), pos, 5000), want), seed
        assert torch.equal(uniform_noise(seed, pos[:3].int(), 5000), want[:3]), seed
    assert torch.equal(uniform_noise(3, pos, 129280)[:, :5000], _uniform_noise_torch(3, pos, 5000))


def test_greedy_is_argmax_lowest_id_on_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0]])
    assert sample(logits, torch.tensor([9]), SamplingParams()).tolist() == [1]


def test_sampled_tokens_depend_only_on_seed_position_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    pos = torch.arange(100, 106)
    p = SamplingParams(temperature=0.9, top_p=0.8, seed=11)
    batch = sample(logits, pos, p)
    single = torch.cat([sample(logits[i:i + 1], pos[i:i + 1], p) for i in range(6)])
    assert torch.equal(batch, single)


def test_top_p_keeps_the_nucleus_only():
    # probs 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps ids 0 and 1 (mass before id 1 is 0.5 < 0.7)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = SamplingParams(temperature=1.0, top_p=0.7, seed=0)
    seen = {int(sample(logits, torch.tensor([i]), p)[0]) for i in range(400)}
    assert seen == {0, 1}


def test_sampling_frequencies_follow_softmax():
    """A sampler error (wrong temperature, biased noise) shifts these frequencies."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = SamplingParams(temperature=0.7, seed=5)
    n = 4000
    counts = torch.bincount(torch.cat([sample(logits, torch.tensor([i]), p) for i in range(n)]),
                            minlength=4).double()
    expect = torch.softmax(logits[0].double() / 0.7, -1) * n
    chi2 = float(((counts - expect) ** 2 / expect).sum())
    assert chi2 < 16.27  # 3 degrees of freedom, p = 0.001


def test_bad_sampling_params():
    for kw in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"seed": -1}):
        with pytest.raises(StrataError):
            SamplingParams(**kw)


@pytest.mark.parametrize("chunk", [1, 5, 512])
def test_session_generate_equals_manual_decode(tiny_reference, chunk):
    prompt = random_tokens(40, seed=8)
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
    out = Session(tiny_reference, 64, prefill_chunk=chunk).run(prompt, 10, p, stop_ids=frozenset())
    # by hand: one prefill, then sample(row of position p-1, p) and feed
    state = tiny_reference.new_state(64)
    logits, _ = tiny_reference.forward(prompt, state, logits="last")
    toks = []
    for _ in range(10):
        t = int(sample(logits, torch.tensor([state.position]), p)[0])
        toks.append(t)
        logits, _ = tiny_reference.forward(torch.tensor([t]), state, logits="last")
    assert out.tokens == toks and out.finish_reason == "length" and out.prompt_tokens == 40


def test_session_stops_on_stop_id(tiny_reference):
    prompt = random_tokens(10, seed=9)
    first = Session(tiny_reference, 64).run(prompt, 5).tokens
    out = Session(tiny_reference, 64).run(prompt, 5, stop_ids=frozenset({first[1]}))
    assert out.tokens == first[:2] and out.finish_reason == "stop"


def test_session_capacity(tiny_reference):
    s = Session(tiny_reference, 20)
    with pytest.raises(CapacityError, match="20"):
        list(s.generate(random_tokens(15, seed=1), 10))
    assert s.position == 0


def test_the_noise_of_a_seed_held_in_a_tensor_is_the_seeds():
    """A graph replays the Markov picks with the seed in a device buffer (runtime/graphs.py):
    the same integer ops on a 0-d int64 tensor give the int seed's noise bit for bit."""
    pos = torch.tensor([0, 5, 2 ** 33 + 7])
    for seed in (0, 7, 2 ** 40 + 3, 2 ** 63 - 1):
        assert torch.equal(uniform_noise(torch.tensor(seed), pos, 500),
                           uniform_noise(seed, pos, 500))
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(0.7, 0.9, seed=12345)
    assert torch.equal(sample(logits, pos, params, seed=torch.tensor(12345)),
                       sample(logits, pos, params))
