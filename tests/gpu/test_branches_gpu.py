"""runtime.branches on the GPU: a layer's independent chains (attention's query and key/value
projections and the compressor's update; the shared expert beside the routed ones) issued on
side streams give the one-stream forward's logits bit for bit — prefill, decode steps and a
6-row window, eager and replayed from CUDA graphs — and graphed decoding gives the same tokens
(the fork and join become graph edges)."""
from __future__ import annotations

import pytest
import torch

from strata.checkpoint.tiny import make_tiny
from strata.model.model import Model
from strata.model.numerics import Numerics
from strata.runtime import branches
from strata.runtime.session import Session
from util import random_tokens

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def exl3_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("exl3"), "tiny", seed=0, fmt="exl3")


def _forwards(model: Model, on: bool, monkeypatch) -> list[torch.Tensor]:
    monkeypatch.setattr(branches, "ENABLED", on)
    s = Session(model, 512)
    out = [model.forward(random_tokens(150, seed=3), s.state, logits="last")[0]]
    for i in range(4):
        out.append(model.forward(random_tokens(1, seed=20 + i), s.state, logits="last")[0])
    out.append(model.forward(random_tokens(6, seed=30), s.state, logits="all")[0])
    return out


@pytest.mark.parametrize("fixture", ["tiny_dir", "exl3_dir"])
def test_side_streams_give_one_streams_bits(cuda, request, fixture, monkeypatch):
    model = Model.load(request.getfixturevalue(fixture), cuda, Numerics.for_device(cuda))
    want = _forwards(model, False, monkeypatch)
    branches._STREAMS.clear()
    got = _forwards(model, True, monkeypatch)
    assert {lane for _, lane in branches._STREAMS} == {1, 2}  # both side lanes ran chains
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"forward {i}"


@pytest.mark.parametrize("fixture", ["tiny_dir", "exl3_dir"])
def test_graphed_decode_with_side_streams_gives_the_eager_tokens(cuda, request, fixture,
                                                                 monkeypatch):
    model = Model.load(request.getfixturevalue(fixture), cuda, Numerics.for_device(cuda))
    prompt = random_tokens(100, seed=5)
    monkeypatch.setattr(branches, "ENABLED", False)
    want = Session(model, 200).run(prompt, 30, mode="plain").tokens
    monkeypatch.setattr(branches, "ENABLED", True)
    s = Session(model, 200, graphs=True)
    assert s.run(prompt, 30, mode="plain").tokens == want
    assert s.graphed.replays > 20
