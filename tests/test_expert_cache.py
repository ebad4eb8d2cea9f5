"""The DSpark expert cache: exact results at any budget, LRU order, the budget never exceeded."""
from __future__ import annotations

import pytest
import torch

from strata.checkpoint.loader import TensorLoader
from strata.checkpoint.safetensors_io import CheckpointFolder
from strata.checkpoint.weights import WeightReader
from strata.config import ModelConfig
from strata.model.moe import swiglu
from strata.model.numerics import Numerics
from strata.runtime.expert_cache import ExpertCache, ExpertCacheError


@pytest.fixture(scope="module")
def stage_experts(tiny_dir):
    """fetch(key) for (stage, expert) of the tiny fixture, and the fully loaded reference."""
    cfg = ModelConfig.from_model_dir(tiny_dir)
    folder = CheckpointFolder(tiny_dir)
    reader = WeightReader(folder, "cpu", TensorLoader("cpu", buffer_bytes=4096))
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    fetched = []

    def fetch(key):
        stage, e = key
        fetched.append(key)
        p = f"mtp.{stage}.ffn.experts.{e}"
        lins = (reader.linear(f"{p}.w1", I, D), reader.linear(f"{p}.w3", I, D),
                reader.linear(f"{p}.w2", D, I))
        return lins, sum(l.nbytes() for l in lins)

    keys = [(s, e) for s in range(cfg.num_nextn_predict_layers)
            for e in range(cfg.dspark_n_routed_experts)]
    reference = {k: fetch(k)[0] for k in keys}
    fetched.clear()
    return cfg, fetch, reference, keys, fetched


def expert_out(lins, x, nx, limit):
    w1, w3, w2 = lins
    return w2(swiglu(w1(x, nx), w3(x, nx), limit).to(nx.act_dtype), nx, torch.float32)


@pytest.mark.parametrize("capacity", [1, 2, 5])
def test_results_are_exact_whatever_the_cache_holds(stage_experts, capacity):
    cfg, fetch, reference, keys, fetched = stage_experts
    one = sum(l.nbytes() for l in reference[keys[0]])
    fetched.clear()
    cache = ExpertCache(fetch, budget_bytes=capacity * one)
    nx = Numerics(mode="vendor")
    g = torch.Generator().manual_seed(capacity)
    x = torch.randn(3, cfg.hidden_size, generator=g)
    # Random experts, each asked for twice in a row (a draft step and the next one often
    # share experts), so every budget sees hits as well as misses and evictions.
    seq = [keys[int(i)] for i in torch.randint(len(keys), (20,), generator=g) for _ in range(2)]
    for key in seq:
        got = expert_out(cache.get(key), x, nx, cfg.swiglu_limit)
        assert torch.equal(got, expert_out(reference[key], x, nx, cfg.swiglu_limit)), key
        assert cache.resident_bytes <= cache.budget and len(cache) <= capacity
    s = cache.stats()
    assert s["hits"] > 0 and s["misses"] == len(fetched) and s["misses"] + s["hits"] == 40
    if capacity < len(keys):
        assert s["evictions"] > 0
    fetched.clear()


def test_least_recently_used_goes_first(stage_experts):
    _, fetch, reference, keys, fetched = stage_experts
    fetched.clear()
    one = sum(l.nbytes() for l in reference[keys[0]])
    cache = ExpertCache(fetch, budget_bytes=2 * one)
    a, b, c = keys[:3]
    cache.get(a), cache.get(b), cache.get(a)  # b is now the least recently used
    cache.get(c)
    assert a in cache and c in cache and b not in cache
    assert fetched == [a, b, c]
    # A step's experts stay resident together: both fit, and c (not in the step) makes room.
    cache.get_many([b, a, b])
    assert a in cache and b in cache and c not in cache
    with pytest.raises(ExpertCacheError, match="need more than the cache budget"):
        cache.get_many([a, b, c])
    fetched.clear()


def test_expert_bigger_than_the_budget_is_named(stage_experts):
    _, fetch, _, keys, fetched = stage_experts
    cache = ExpertCache(fetch, budget_bytes=100)
    with pytest.raises(ExpertCacheError, match=r"expert \(0, 0\) holds"):
        cache.get(keys[0])
    assert cache.resident_bytes == 0
    fetched.clear()
