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


# ---- wired into the model: the DSpark stages' experts behind the cache ------------------------
@pytest.fixture(scope="module", params=["official", "exl3"])
def draft_dir(request, tmp_path_factory, tiny_dir):
    from strata.checkpoint.tiny import make_tiny
    if request.param == "official":
        return tiny_dir
    return make_tiny(tmp_path_factory.mktemp("tiny-exl3"), "tiny", seed=0, fmt="exl3")


def test_draft_experts_behind_a_small_cache_draft_the_same(draft_dir):
    """Model.load(draft_experts='cache') with room for a few experts: identical drafts and
    tokens to the model holding every draft expert, the budget never exceeded, and only
    draft experts ever cached."""
    from strata.model.model import Model
    from strata.runtime.expert_cache import CachedExperts
    from strata.runtime.session import Session
    from strata.runtime.speculative import SpecConfig
    full = Model.load(draft_dir, "cpu", Numerics(mode="reference"))
    cfg = full.cfg
    one = sum(full.dspark.stages[0].ffn.experts.linears[n][0].nbytes() for n in ("w1", "w3", "w2"))
    per_step = min(cfg.dspark_block_size * cfg.dspark_num_experts_per_tok,
                   cfg.dspark_n_routed_experts)  # distinct experts of one stage, at most
    budget = one * per_step + 1
    cached = Model.load(draft_dir, "cpu", Numerics(mode="reference"), draft_experts="cache",
                        draft_cache_bytes=budget)
    assert all(isinstance(s.ffn.experts, CachedExperts) for s in cached.dspark.stages)
    assert not any(isinstance(b.ffn.experts, CachedExperts) for b in cached.layers)
    cache = cached.draft_expert_cache
    prompt = torch.randint(3, 320, (10,), generator=torch.Generator().manual_seed(2))
    run = dict(max_tokens=14, stop_ids=frozenset(), mode="dspark")
    a = Session(full, 64, speculative=SpecConfig(length=4))
    b = Session(cached, 64, speculative=SpecConfig(length=4))
    assert b.run(prompt, **run).tokens == a.run(prompt, **run).tokens
    assert b.stats.accepted == a.stats.accepted and b.stats.windows == a.stats.windows
    st = cache.stats()
    assert st["misses"] > 0 and st["evictions"] > 0 and st["resident_bytes"] <= budget
    assert all(key[0].startswith("mtp.") for key in cache._entries)
    # The draft itself is bit-identical (logits and confidences), not just the tokens.
    drafts = []
    for m in (full, cached):
        s = m.new_state(32)
        _, ctx = m.forward(prompt, s)
        m.dspark.commit_context(m.dspark.main_hidden(ctx), 0, s, m.numerics)
        drafts.append(m.dspark.draft(m.embed, m.head, 7, s, m.numerics,
                                     lambda lg, positions: lg.argmax(dim=-1)))
    assert torch.equal(drafts[0].logits, drafts[1].logits)
    assert torch.equal(drafts[0].confidence, drafts[1].confidence)


def test_draft_cache_too_small_for_one_step_names_the_budget(tiny_dir):
    from strata.model.model import Model
    from strata.runtime.session import Session
    from strata.runtime.speculative import SpecConfig
    m = Model.load(tiny_dir, "cpu", Numerics(mode="reference"), draft_experts="cache",
                   draft_cache_bytes=1)
    with pytest.raises(ExpertCacheError, match="cache budget"):
        Session(m, 64, speculative=SpecConfig(length=3)).run(
            torch.arange(3, 12), max_tokens=4, mode="dspark", stop_ids=frozenset())
