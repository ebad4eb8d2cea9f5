"""strata.streams.both: two pieces of a forward at once on the GPU give the bits they give in
order — two EXL3 launches side by side (each stream lane its own arrival counters), eager and
replayed from a CUDA graph, and the model's forwards (a sublayer's mHC mixes beside the
sublayer, a MoE's shared expert beside its routed experts) on the fp8/fp4 and EXL3 fixtures;
test_cuda_graph_gpu.py runs them captured (graphed decode, windows, drafts)."""
from __future__ import annotations

import pytest
import torch

import strata.model.block as block_module
import strata.model.moe as moe_module
from strata import streams
from strata.kernels import exl3 as X
from strata.model.model import Model
from strata.model.numerics import Numerics
from strata.runtime.session import Session
from test_kernels_exl3_gpu import decode_case
from util import random_tokens

pytestmark = pytest.mark.gpu


def test_two_exl3_pieces_side_by_side_give_their_bits_in_order(cuda):
    """A dense linear's decode rows (arrival counters: the last program of a block finishes
    it) on the side stream while grouped expert launches run on the current one — eager 20
    times and replayed 20 times from one captured graph: each output bit for bit its own."""
    (tr, suh, svh), sets, idx, x = decode_case(cuda, seed=80)

    def dense():
        return [X.exl3_linear(x[i:i + 1], tr, suh, svh, "mul1") for i in range(3)]

    def grouped():
        return [y for _ in range(3) for y in X.exl3_moe_linear(x, idx, sets, "mul1")]

    want = dense() + grouped()
    for _ in range(20):
        a, b = streams.both(dense, grouped, cuda)
        torch.cuda.synchronize()
        assert all(torch.equal(u, v) for u, v in zip(a + b, want))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a, b = streams.both(dense, grouped, cuda)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(u, v) for u, v in zip(a + b, want))


@pytest.mark.parametrize("fixture", ["tiny_dir", "exl3_dir"])
@pytest.mark.parametrize("T", [1, 6])
def test_a_forward_with_pieces_beside_each_other_gives_the_in_order_logits(
        cuda, request, monkeypatch, fixture, T):
    """A decode step's and a window's forward (eager) with the pieces beside each other (a
    sublayer's mixes beside the sublayer, a MoE's shared expert beside its routed experts)
    and with streams off: the same logits and compressed state bit for bit, both runs
    through the same forks."""
    model = Model.load(request.getfixturevalue(fixture), cuda, Numerics.for_device(cuda))
    s = Session(model, 512)
    s.prefill(random_tokens(150, seed=3))
    tokens = random_tokens(T, seed=21)
    forks = []

    def counted(module):
        def fork(*args):
            forks.append((module.__name__, streams.ENABLED))
            return streams.both(*args)
        monkeypatch.setattr(module, "both", fork)
    counted(moe_module)
    counted(block_module)
    state_beside, state_in_order = s.state.clone(), s.state.clone()
    beside, _ = model.forward(tokens, state_beside, logits="all")
    monkeypatch.setattr(streams, "ENABLED", False)
    in_order, _ = model.forward(tokens, state_in_order, logits="all")
    for module in (moe_module, block_module):
        on = forks.count((module.__name__, True))
        assert on == forks.count((module.__name__, False)) > 0, module.__name__
    assert torch.equal(beside, in_order)
    for got, want in ((state_beside.comp_kv, state_in_order.comp_kv),
                      (state_beside.index_k, state_in_order.index_k)):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
