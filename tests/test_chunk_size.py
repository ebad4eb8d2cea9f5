"""`--prefill-chunk auto` (runtime/chunk_size.py): the sizing rule, the measurement's
arithmetic and the CPU fallback. The real measurement runs on a GPU:
tests/gpu/test_chunk_size_gpu.py."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from strata.device_memory import DeviceMemory, device_memory
from strata.model.indexer import SCORE_SCRATCH
from strata.runtime.chunk_size import (SLACK_BYTES, choose_prefill_chunk, fitting_chunk,
                                       resolve_prefill_chunk)
from strata.runtime.session import PREFILL_CHUNK

G = 1 << 30


def test_the_chunk_doubles_while_every_device_has_room():
    # a 4,096-row scratch of 2 GiB: 8,192 rows need 4 GiB beside the 2 GiB kept
    assert fitting_chunk(4096, [2 * G], [6 * G], [2 * G], 8192) == 8192  # (exactly fits)
    assert fitting_chunk(4096, [2 * G], [6 * G - 1], [2 * G], 8192) == 4096
    # the tightest device decides
    assert fitting_chunk(4096, [G, 2 * G], [40 * G, 5 * G], [2 * G, 2 * G], 8192) == 4096
    assert fitting_chunk(4096, [G, 2 * G], [40 * G, 5 * G], [2 * G, G], 8192) == 8192
    # capped at the largest (a power-of-two multiple of the base only)
    assert fitting_chunk(4096, [2 * G], [80 * G], [2 * G], 8192) == 8192
    assert fitting_chunk(4096, [2 * G], [80 * G], [2 * G], 32768) == 32768
    assert fitting_chunk(4096, [2 * G], [80 * G], [2 * G], 6000) == 4096
    # where not even the base fits, the base: the size every box is planned for
    assert fitting_chunk(4096, [2 * G], [1 * G], [2 * G], 8192) == 4096


class ScriptedDevice:
    """The tiny model (its real prefill, on the CPU) reporting itself on CUDA, with scripted
    memory readings: there is no CUDA here to read. The GPU test reads real ones."""

    def __init__(self, model, readings, cache=None):
        self._model, self._readings = model, list(readings)
        self.device = torch.device("cuda")
        self.draft_expert_cache = cache
        self.resets, self.rows = [], []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def memory(self, reset_peak=False):
        self.resets.append(reset_peak)
        return self._readings.pop(0)

    def forward(self, tokens, state, **kw):
        self.rows.append((state.capacity, tokens.numel()))
        return self._model.forward(tokens, state, **kw)


def test_the_measurement_reads_scratch_and_free_memory_per_device(tiny_reference):
    # device 0 holds 10 GiB before the chunk and peaks at 13 during it: a 3 GiB scratch;
    # device 1 a 1 GiB one; free beside the state: 40 and 9 GiB
    before = [DeviceMemory(60 * G, 10 * G, 12 * G), DeviceMemory(20 * G, 5 * G, 5 * G)]
    after = [DeviceMemory(40 * G, 11 * G, 13 * G), DeviceMemory(9 * G, 6 * G, 6 * G)]
    cache = SimpleNamespace(budget=3 * G, resident_bytes=G)  # (2 GiB more to grow on device 0)
    model = ScriptedDevice(tiny_reference, [before, after], cache)
    choice = choose_prefill_chunk(model, 200, keep_bytes=G, base=32, largest=128)
    assert model.resets == [True, False]  # (the peak starts at the chunk)
    assert model.rows == [(200, 32)]      # one base chunk, into a state of the capacity
    assert choice.scratch == [3 * G, G] and choice.free == [40 * G, 9 * G]
    fixed = G + SCORE_SCRATCH + SLACK_BYTES
    assert choice.keep == [fixed + 2 * G, fixed]
    # device 1: 2 GiB scratch at 64 rows + 3 GiB kept fits 9; 4 + 3 at 128 fits too;
    # device 0: 12 + 5 at 128 fits 40
    assert choice.chunk == 128
    text = choice.describe()
    assert text.startswith("prefill chunk 128 rows (device 0: 32-row scratch 3.00 GiB, "
                           "free 40.0 GiB beside the state, 5.0 GiB kept; device 1:")
    # the same memory with a prefix cache budget of 4 GiB: device 1 stops at 64 rows
    model = ScriptedDevice(tiny_reference, [before, after], cache)
    assert choose_prefill_chunk(model, 200, keep_bytes=4 * G, base=32, largest=128).chunk == 64


def test_nothing_is_measured_off_cuda_or_where_a_prompt_is_one_chunk(tiny_reference, capsys):
    choice = choose_prefill_chunk(tiny_reference, 100_000)
    assert (choice.chunk, choice.scratch) == (PREFILL_CHUNK, [])
    assert choice.describe() == f"prefill chunk {PREFILL_CHUNK} rows (not measured off CUDA)"
    model = ScriptedDevice(tiny_reference, [])  # (no reading to take)
    choice = choose_prefill_chunk(model, 33, base=32)
    assert choice.chunk == 32 and model.rows == [] and model.resets == []
    assert "a prompt of at most 32 rows is one chunk" in choice.describe()
    # the flag: a number is taken as it is; auto says what it chose and why
    assert resolve_prefill_chunk(7, tiny_reference, 100) == 7
    assert capsys.readouterr().err == ""
    assert resolve_prefill_chunk("auto", tiny_reference, 100) == PREFILL_CHUNK
    assert capsys.readouterr().err == (f"strata: prefill chunk {PREFILL_CHUNK} rows "
                                       "(not measured off CUDA)\n")
    assert device_memory("cpu", reset_peak=True) == DeviceMemory(0, 0, 0)
    assert tiny_reference.memory() == [DeviceMemory(0, 0, 0)]
