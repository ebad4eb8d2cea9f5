"""What the GPU suite's files share: the CUDA device fixture, the tiny model's EXL3 fixture and
the optional results log."""
from __future__ import annotations

import json
import os

import pytest
import torch

from strata.checkpoint.tiny import make_tiny

RESULTS = os.environ.get("STRATA_GPU_RESULTS")  # optional JSON lines file for bench/results


def record(**row) -> None:
    """Append one measurement to $STRATA_GPU_RESULTS (when set)."""
    if RESULTS:
        with open(RESULTS, "a") as f:
            f.write(json.dumps(row) + "\n")


@pytest.fixture(scope="module")
def cuda():
    """The CUDA device with TF32 off (fails, not skips, without one)."""
    assert torch.cuda.is_available(), "the GPU suite needs a CUDA device"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda")


@pytest.fixture(scope="module")
def exl3_dir(tmp_path_factory):
    """The tiny model's fixture in EXL3 (tiny_dir: its fp8/fp4 form)."""
    return make_tiny(tmp_path_factory.mktemp("exl3"), "tiny", seed=0, fmt="exl3")
