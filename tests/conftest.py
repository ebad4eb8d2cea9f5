"""Shared fixtures: deterministic tiny checkpoints generated once per test session."""
from __future__ import annotations

import os

os.environ.setdefault("ATEN_CPU_CAPABILITY", "default")  # before torch: see strata/__init__.py
import pytest
import torch

# Without a GPU the Triton kernels run in the interpreter; triton.jit reads this when a kernel
# is defined, so it must be set before any strata.kernels module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("STRATA_RECORD_LAUNCHES"):  # scripts/compile_check.py: record each launch
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    from compile_check import record_launches
    record_launches(os.environ["STRATA_RECORD_LAUNCHES"])

from strata.checkpoint.tiny import make_tiny
from strata.model.model import Model
from strata.model.numerics import Numerics


def pytest_sessionstart(session):
    cap = torch.backends.cpu.get_cpu_capability()
    if cap != "DEFAULT":
        raise pytest.UsageError(
            f"torch was imported with CPU capability {cap}; the batch-invariance tests need "
            "ATEN_CPU_CAPABILITY=default set before torch is first imported")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The small-vocabulary fixture (320 ids, every layer role)."""
    return make_tiny(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


@pytest.fixture(scope="session")
def real_vocab_dir(tmp_path_factory):
    """The real-tokenizer fixture (129,280 ids)."""
    return make_tiny(tmp_path_factory.mktemp("realvocab"), "real-vocab", seed=0)


@pytest.fixture(scope="session", params=["reference", "vendor"])
def tiny_model(request, tiny_dir):
    """The tiny model in each numerics mode (fp32 activations on CPU)."""
    return Model.load(tiny_dir, "cpu", Numerics(mode=request.param))


@pytest.fixture(scope="session")
def tiny_reference(tiny_dir):
    return Model.load(tiny_dir, "cpu", Numerics(mode="reference"))
