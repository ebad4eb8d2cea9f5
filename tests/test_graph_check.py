"""The CUDA-graph readiness check (strata/graph_check.py) and what it says of a decode step
today. The region a graph would capture — embedding, layers, head, given the forward's context
(positions, Engram ids) prepared before it — runs the same ops, shapes and scalar arguments at
every position within an entry bucket — embedding, mHC, MoE, Engram, head and every layer's
attention, compressors and indexers included. What a graph capture still needs is in
docs/ARCHITECTURE.md, "CUDA graphs"."""
from __future__ import annotations

import torch

from strata import trace
from strata.graph_check import differing_scopes, op_signature
from strata.model.model import Model
from strata.model.numerics import Numerics
from strata.runtime.session import Session
from util import random_tokens

STATIC = {"embed", "mhc", "attention", "moe", "engram", "head"}


def test_differences_are_found_per_scope():
    x = torch.randn(4, 8)

    def step(n):
        def run():
            with trace.scope("moe"):
                (x @ x.T).sum()
            with trace.scope("attention"):
                x[:n].sum()
        return run
    a, b, c = op_signature(step(2)), op_signature(step(2)), op_signature(step(3))
    assert differing_scopes(a, b) == {}
    diff = differing_scopes(a, c)
    assert set(diff) == {"attention"} and "2" in diff["attention"] and "3" in diff["attention"]
    assert not trace.enabled()


def test_the_captured_region_is_position_independent(tiny_dir):
    model = Model.load(tiny_dir, "cpu", Numerics("vendor"))
    cfg, nx = model.cfg, model.numerics
    assert any(cfg.is_kv_source(b.layer) and cfg.ratio(b.layer) > 1 for b in model.layers)
    assert any(cfg.is_kv_source(b.layer) and cfg.ratio(b.layer) == 1 for b in model.layers)
    s = Session(model, 512)
    s.prefill(random_tokens(150, seed=3))  # the rings have wrapped
    for T in (1, 6):
        sigs = []
        for i in range(4):  # four consecutive forwards: every compression phase of ratio ≤ 4
            tokens = model.check_forward(random_tokens(T, seed=10 + i), s.state, "last")
            ctx = model.new_context(tokens, s.state, nx)  # prepared outside a graph

            def region():
                with trace.scope("embed"):
                    h, pre = model.embed_stream(tokens, nx)
                h, pre, _ = model.run_layers(h, pre, ctx, s.state)
                with trace.scope("head"):
                    model.logits(h, pre, "last", nx)
            sigs.append(op_signature(region))
            model.end_forward(ctx, s.state)
        assert STATIC <= {sc.split("#")[0] for sc, _, _ in sigs[0]}
        for other in sigs[1:]:
            differing = differing_scopes(sigs[0], other)
            assert not differing.keys() & STATIC, differing


def test_a_static_step_rerun_on_its_buffers_gives_the_eager_logits(tiny_dir):
    """What a CUDA-graph replay does — the same region run again on the first step's buffers,
    the next step's inputs copied into them — gives the eager forward's logits bit for bit,
    step after step (plain decode and 6-row windows). The capture itself is GPU-only:
    tests/gpu/test_cuda_graph_gpu.py."""
    from strata.runtime.static_step import StaticStep
    model = Model.load(tiny_dir, "cpu", Numerics("vendor"))
    for T, mode in ((1, "last"), (6, "all")):
        s = Session(model, 512)
        s.prefill(random_tokens(150, seed=3))
        ref = s.state.clone()
        step = StaticStep(model, s.state, T, mode)
        for i in range(5):
            tokens = random_tokens(T, seed=20 + i)
            want, _ = model.forward(tokens, ref, logits=mode)
            ctx = step.prepare(tokens)
            step.run()
            step.finish(ctx)
            assert torch.equal(step.logits, want), (T, i)
        assert s.state.position == ref.position


def test_a_static_step_refuses_what_it_cannot_replay(tiny_dir):
    import pytest

    from strata.runtime.static_step import StaticStep
    model = Model.load(tiny_dir, "cpu", Numerics("vendor"))
    s = Session(model, 64)
    s.prefill(random_tokens(10, seed=3))
    step = StaticStep(model, s.state, 1)
    with pytest.raises(ValueError, match="takes 1 tokens, got 2"):
        step.prepare(random_tokens(2, seed=4))
    quirk = Model.load(tiny_dir, "cpu", Numerics("vendor", vendor_stale_index_k=True))
    with pytest.raises(ValueError, match="stale-index-key quirk"):
        StaticStep(quirk, quirk.new_state(64), 1)


def test_graph_keys_change_at_entry_bucket_edges_only(tiny_dir):
    """The graph key of a forward (Model.graph_key) is the entry bucket of every indexer
    ratio at the forward's end: constant within a bucket, new past its edge."""
    model = Model.load(tiny_dir, "cpu", Numerics("vendor"))
    assert model.index_ratios == sorted({model.cfg.ratio(b.layer) for b in model.layers
                                         if model.cfg.is_index_source(b.layer)})
    r = min(model.index_ratios)
    edge = 257 * r - 1  # the first position whose step has 257 entries of ratio r: bucket 512
    keys = {model.graph_key(p, 1) for p in range(max(model.index_ratios), edge)}
    assert len(keys) == 1
    assert model.graph_key(edge, 1) != model.graph_key(edge - 1, 1)
    assert model.graph_key(100, 6) == model.graph_key(101, 6)


def test_graphed_decode_falls_back_to_eager_where_no_graph_can_run(tiny_dir):
    """On a CPU model (no CUDA graphs) Session(graphs=True) decodes eagerly, the same tokens;
    the capture and replay themselves are GPU tests (tests/gpu/test_cuda_graph_gpu.py)."""
    model = Model.load(tiny_dir, "cpu", Numerics("vendor"))
    prompt = random_tokens(40, seed=5)
    want = Session(model, 64).run(prompt, 6, mode="plain").tokens
    s = Session(model, 64, graphs=True)
    assert s.run(prompt, 6, mode="plain").tokens == want
    assert (s.graphed.captures, s.graphed.replays) == (0, 0)
