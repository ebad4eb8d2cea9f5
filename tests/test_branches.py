"""runtime.branches: a layer's independent chains on side streams (the streams themselves need
a GPU: tests/gpu/test_branches_gpu.py compares a model's bits with and without them). Here:
what runs where, the lanes the chains see, and the per-lane scratch of the EXL3 kernels."""
from __future__ import annotations

import pytest
import torch

from strata.kernels import exl3
from strata.runtime import branches


def test_chains_run_in_order_on_the_current_stream_off_the_gpu(monkeypatch):
    monkeypatch.setattr(branches, "ENABLED", True)
    seen = []

    def chain(name):
        def run():
            seen.append((name, branches.lane()))
            return name
        return run

    out = branches.parallel(torch.device("cpu"), chain("q"), chain("kv"), chain("publish"))
    assert out == ["q", "kv", "publish"]
    assert seen == [("q", 0), ("kv", 0), ("publish", 0)]  # no side lanes without CUDA
    assert not branches.active(torch.device("cpu"))


def test_at_most_three_chains():
    with pytest.raises(ValueError, match="4 chains, at most 3"):
        branches.parallel(torch.device("cpu"), *[lambda: None] * 4)


def test_a_side_lane_never_forks_again(monkeypatch):
    monkeypatch.setattr(branches, "ENABLED", True)
    token = branches._LANE.set(2)
    try:
        assert branches.lane() == 2
        assert not branches.active(torch.device("cuda", 0))  # (no stream is touched)
    finally:
        branches._LANE.reset(token)
    assert branches.active(torch.device("cuda", 0))


def test_each_lane_has_its_own_exl3_arrival_counters(monkeypatch):
    """Two lanes' EXL3 launches may run at once: sharing one counter buffer, a block's
    arrivals would mix two launches' programs."""
    monkeypatch.setattr(exl3, "_COUNTERS", {})
    dev = torch.device("cpu")
    main = exl3._counters(dev, 64)
    token = branches._LANE.set(1)
    try:
        side = exl3._counters(dev, 64)
        assert exl3._counters(dev, 64) is side
    finally:
        branches._LANE.reset(token)
    assert side.data_ptr() != main.data_ptr()
    assert exl3._counters(dev, 64) is main
    assert not main.any() and not side.any()
