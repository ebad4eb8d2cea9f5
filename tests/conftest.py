"""Shared fixtures: deterministic tiny checkpoints generated once per test session."""
from __future__ import annotations

import os

os.environ.setdefault("ATEN_CPU_CAPABILITY", "default")  # before torch: see strata/__init__.py
# A pytest-xdist worker (the README's `pytest -n 2`) keeps to one intra-op thread, and so do the
# processes its tests start: two workers of two threads each on CI's two cores spin against each
# other (session 43, 2 cores: the suite took 17.5 min serial with two threads, 9.4–9.8 min as
# two workers of one thread).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
import pytest
import torch

# Without a GPU the Triton kernels run in the interpreter; triton.jit reads this when a kernel
# is defined, so it must be set before any strata.kernels module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _faster_interpreter() -> None:
    """Two costs of Triton's interpreter that change no result (CPU runs of the kernels):
    - it rebinds triton.language's builtins to interpreted ones when a kernel runs (undone
      when it ends), and again at every call of a @triton.jit helper from inside it — an
      inspect.getmembers walk of four modules each time, about half of an EXL3 kernel's
      interpreted time (its decode calls helpers per tile). A helper whose module the running
      kernel has already rebound now skips the walk; a module not yet seen is rebound as before;
    - with `sanitize_overflow` on it computes every 32-bit integer add and multiply again in 64
      bits and compares, for an assert that only its debug mode keeps (off here): the trellis
      decode is such arithmetic. Turned off while debug is off.
    Only where this Triton's interpreter has the names used; elsewhere nothing changes."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    import dataclasses
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and hasattr(options, "sanitize_overflow") \
            and not getattr(options, "debug", True):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)
    patch, empty = (getattr(interpreter, n, None) for n in ("_patch_lang", "_LangPatchScope"))
    if patch is None or empty is None:
        return
    run = {"depth": 0, "modules": set()}  # (one kernel runs at a time: the interpreter is serial)

    def patch_lang(fn):
        module = id(fn.__globals__)
        if run["depth"] and module in run["modules"]:
            return empty()
        scope = patch(fn)
        run["modules"].add(module)
        if run["depth"]:  # (a helper's new module: rebound until the kernel's scope ends)
            return scope
        run["depth"] = 1
        restore = scope.restore

        def restore_and_forget():
            run["depth"], run["modules"] = 0, set()
            restore()
        scope.restore = restore_and_forget
        return scope

    interpreter._patch_lang = patch_lang


def _ordered_interpreter_dot() -> None:
    """The interpreter's tl.dot is numpy's matmul, whose summation order is the BLAS build's
    and the CPU's: OpenBLAS's AVX2 kernels sum an output element differently by the matrix's
    width (seen 2026-12-05 on an AMD EPYC without AVX-512, where the fused and GEMM EXL3 paths
    then differed in the last bit). On the GPU each element of a tl.dot is one MMA chain whose
    order does not depend on the tile's shape, which is what the kernels' bit-identity tests
    rely on; so here each element is summed in one order too: the products in the
    accumulator's dtype, added in ascending k, then added to the accumulator. (A stand-in for
    the tensor cores' order where no GPU runs; fp8 operands keep the interpreter's own dot.)"""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    builder, handle = (getattr(interpreter, n, None) for n in ("InterpreterBuilder",
                                                                "TensorHandle"))
    original = getattr(builder, "create_dot", None)
    if original is None or handle is None:
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if any(t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating() for t in (a, b)):
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        x, y = a.data.astype(d.data.dtype), b.data.astype(d.data.dtype)
        total = x[..., :, 0, None] * y[..., None, 0, :]
        for k in range(1, x.shape[-1]):
            total = total + x[..., :, k, None] * y[..., None, k, :]
        return handle(total + d.data, d.dtype.scalar)

    builder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _faster_interpreter()
    _ordered_interpreter_dot()
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
