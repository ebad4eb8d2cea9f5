"""The CUDA-graph readiness check (strata/graph_check.py) and what it says of a decode step
today: the mHC, MoE, Engram and head parts run the same ops, shapes and scalar arguments at
every position — they can be captured once and replayed — while attention (window start,
ring offsets, compression groups) and the forward's set-up still take positions as host ints,
which is what the graph capture of the whole step must change first."""
from __future__ import annotations

import torch

from strata import trace
from strata.graph_check import differing_scopes, op_signature
from strata.model.model import Model
from strata.model.numerics import Numerics
from strata.runtime.session import Session
from util import random_tokens

STATIC = {"mhc", "moe", "engram", "head"}


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


def test_the_ffn_half_of_a_decode_step_and_a_verify_window_is_position_independent(tiny_dir):
    model = Model.load(tiny_dir, "cpu", Numerics("vendor"))
    s = Session(model, 512)
    s.prefill(random_tokens(150, seed=3))  # the rings have wrapped
    for T in (1, 6):
        sigs = []
        for i in range(4):  # four consecutive steps: every compression phase of ratio ≤ 4
            tokens = model.check_forward(random_tokens(T, seed=10 + i), s.state, "last")
            sigs.append(op_signature(lambda: model.forward(tokens, s.state, logits="last")))
        scopes = {sc for sc, _, _ in sigs[0]}
        assert STATIC <= scopes
        for other in sigs[1:]:
            differing = differing_scopes(sigs[0], other)
            assert not differing.keys() & STATIC, differing
