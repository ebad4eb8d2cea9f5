"""A decode step and a verify window read nothing back from the device inside the model, and
upload nothing to it.

On a GPU every value read back to the host (int(t), .item(), .nonzero(), torch.unique, a
boolean test of a tensor) waits for all the work queued before it, so the host cannot run ahead
of the GPU, and a step containing one cannot be captured in a CUDA graph. A tensor built from
host data inside the forward (torch.tensor(x, device=…), indexing with a Python list) is a copy
from pageable memory, which also waits for the stream. This probe counts the ATen ops that read
back (or size their output from data) or lift host data into a tensor while one forward runs
— on CPU, where the same Python code runs — and requires none. (Validating the caller's token
ids happens on the host before they move, in Model.check_forward, outside the probe; the
forward's inputs — token ids, positions, the Engram hash's ids or input — are host work by
design: numpy, wrapped as one tensor by Model.new_context and uploaded through pinned memory,
which waits for nothing — so the host hash's frames and new_context's wrapping are not
counted. Nor is mHC's Sinkhorn loop wrapping its numpy result: that branch runs on CPU
tensors only, and on a GPU the loop is torch's or a fused kernel's.)"""
from __future__ import annotations

import collections
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from strata.model.model import Model, ModelPart
from strata.model.numerics import Numerics
from strata.runtime.session import Session
from util import random_tokens

READS_BACK = {"_local_scalar_dense", "item", "nonzero", "unique", "_unique", "_unique2",
              "unique_consecutive", "unique_dim", "masked_select", "is_nonzero", "equal",
              "lift_fresh", "lift_fresh_copy"}  # (the last two: uploads of host data)


class HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in READS_BACK or (name == "repeat_interleave" and
                                  any(isinstance(a, torch.Tensor) for a in args[1:])):
            where = [f for f in traceback.extract_stack() if "/strata/" in f.filename][-1:]
            if where and (where[0].filename.endswith("model/ngram_hash.py") or (
                    where[0].name in ("new_context", "sinkhorn")
                    and name.startswith("lift_fresh"))):
                return func(*args, **(kwargs or {}))
            self.seen[(name, *(f"{f.filename.split('strata/')[-1]}:{f.lineno}"
                               for f in where))] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def exl3_dir(tmp_path_factory):
    from strata.checkpoint.tiny import make_tiny
    return make_tiny(tmp_path_factory.mktemp("exl3"), "tiny", seed=0, fmt="exl3")


@pytest.mark.parametrize("path, T", [("torch", 1), ("torch", 6), ("kernels", 1),
                                     ("kernels", 6), ("exl3-kernels", 1)])
def test_forward_layers_read_nothing_back(tiny_dir, exl3_dir, monkeypatch, path, T):
    """`kernels`: the quantized Triton kernels the GPU runs (forced onto CPU tensors, under
    the interpreter); `exl3-kernels`: the EXL3 fixture through the EXL3 kernels — one row, and
    layers 0 and 1 with the embedding and head (ModelPart): a window-only layer and a ratio-2
    source with its indexer and Engram hold every kind of EXL3 linear and MoE call the other
    layers make, and the interpreter's trellis decode takes ~2 min per forward of all 8; a
    6-row window runs the same kernels."""
    import strata.kernels.exl3  # noqa: F401 — imported before the probe (module constants)
    import strata.quant.exl3 as quant_exl3
    from strata.kernels import fp8fp4
    model = Model.load(exl3_dir if path == "exl3-kernels" else tiny_dir, "cpu",
                       Numerics("vendor"),
                       part=ModelPart(layers=[0, 1]) if path == "exl3-kernels" else None)
    s = Session(model, 256)
    s.prefill(random_tokens(150 if path == "torch" else 20, seed=3))  # torch: rings wrap
    tokens = model.check_forward(random_tokens(T, seed=4), s.state, "last")
    if path == "exl3-kernels":  # (only for the probed forward: the interpreter is slow)
        monkeypatch.setattr(quant_exl3, "KERNELS", "always")
    probe = HostReads()
    s.state.begin()
    with fp8fp4.forced(path != "torch"), probe:
        model._forward(tokens, s.state, "last", model.numerics)
    s.state.rollback()
    assert not probe.seen, dict(probe.seen)
