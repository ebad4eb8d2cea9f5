"""Programmatic dependent launch (sm_90 and later) for the decode step's small Triton kernels.

A decode step is ~70 kernels a layer, most of them a few microseconds long, and in a CUDA
graph the time between one ending and the next starting (launch, block scheduling) is 15–22 %
of the step (bench/results/performance.md). Launched with `launch_pdl`, a kernel may start
while the one before it is still running: its programs begin, wait (`gdc_wait`) until the
previous kernel has finished and its writes are visible, then let the next kernel start
(`gdc_launch_dependents`) and do their work. Because each such kernel waits before it reads
or writes anything, stream order is kept exactly: only the launch overlaps, never the work.
A kernel after one that does not signal (a torch op, a CUDA kernel) starts as it would
without PDL.

A kernel takes part with a `PDL: tl.constexpr` parameter and `wait_then_release(PDL)` as its
first statement, and is launched with `**args(device)` (its PDL value and launch option).
On by default: on one H200 it made the synthetic V4.1's graphed decode 4–6 % faster with the
same tokens (bench/results/performance.md, session 14). `ENABLED` False (environment
STRATA_PDL=0): plain stream order, for A/B measurements. The EXL3 kernels' own early launch
(strata.kernels.exl3.PDL) is separate and on.
"""
from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: no Triton kernels run
    triton = None

ENABLED = os.environ.get("STRATA_PDL", "1") != "0"

if triton is not None:
    try:  # Triton ≥ 3.3
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
        HAS_GDC = True
    except ImportError:
        HAS_GDC = False

        @triton.jit
        def gdc_wait():
            pass

        @triton.jit
        def gdc_launch_dependents():
            pass

    @triton.jit
    def wait_then_release(PDL: tl.constexpr):
        """A PDL kernel's first statement: wait for the previous kernel, then let the next
        one launch (it waits in turn)."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def prefetch_l2(ptrs, PDL: tl.constexpr):
        """Ask L2 for the lines at ptrs (a block of pointers, one a line) — before
        `wait_then_release`, for an operand no kernel of the step writes (a weight): an
        early-launched kernel then fetches it while the kernel before it still runs, not after
        its wait. Changes no value. Without an early launch (PDL False: the interpreter, or
        PDL off) nothing is asked."""
        if PDL:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l",
                                      [ptrs], dtype=tl.int32, is_pure=False, pack=1)
else:
    HAS_GDC = False


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1: CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def capable(index: int | None) -> bool:
    """Whether Triton can launch early on this GPU (GDC and its launch option, Hopper+)."""
    if not HAS_GDC or torch.cuda.get_device_capability(index) < (9, 0):
        return False
    from triton.backends.nvidia.compiler import CUDAOptions
    return "launch_pdl" in CUDAOptions.__dataclass_fields__


def launch(device: torch.device, on: bool | None = None) -> dict:
    """The launch option of a kernel that waits first (`wait_then_release`): early launch
    where it exists and is switched on (`on`: the switch, ENABLED by default)."""
    on = ENABLED if on is None else on
    if on and device.type == "cuda" and not interpreting() and capable(device.index):
        return {"launch_pdl": True}
    return {}


def args(device: torch.device) -> dict:
    """A waiting-first kernel's launch arguments: PDL (its constexpr) and the launch option."""
    opt = launch(device)
    return {"PDL": bool(opt), **opt}
