"""strata.streams.both off a GPU: the two pieces run in order on the current stream (first,
then second — what a journal of their writes records), their results returned as a pair.
The side stream itself runs on the GPU: tests/gpu/test_streams_gpu.py."""
from __future__ import annotations

import torch

from strata import streams


def test_both_runs_first_then_second_off_a_gpu():
    calls = []

    def piece(name, value):
        def run():
            calls.append(name)
            return value
        return run
    a, b = streams.both(piece("first", torch.ones(2)), piece("second", 7), torch.device("cpu"))
    assert calls == ["first", "second"]
    assert torch.equal(a, torch.ones(2)) and b == 7
    assert not streams.on_side(torch.device("cpu"))
