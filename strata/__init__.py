"""Strata: a DeepSeek-V4.1-Flash inference engine."""

import os

# Batch invariance on CPU: torch's vectorised elementwise kernels (exp, softplus, ...) use a
# different formula for a tensor's SIMD body than for its tail, so a row's result would depend
# on how many rows share the tensor. The portable kernels compute every element the same way,
# which makes prefill, verify and decode bit-identical on CPU. It only takes effect when torch
# is first imported after this line (the CLI and the tests make sure of that).
os.environ.setdefault("ATEN_CPU_CAPABILITY", "default")

__version__ = "0.1.0"
