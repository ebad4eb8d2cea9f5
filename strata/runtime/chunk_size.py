"""`--prefill-chunk auto`: the largest prefill chunk the devices' memory leaves room for.

Bigger chunks prefill faster: each routed expert is decoded once for more rows. On one H100
8,192-row chunks prefill a 32K prompt at 10,117 tok/s against 9,638–9,833 at 4,096
(bench/results/performance.md, session 62), but their scratch is twice as large (3.86 GiB
against 1.96, session 57) and a fixed default has to fit every box. So at start-up one
4,096-row chunk is prefilled into a state of the real capacity (every layer on every row, the
most scratch a chunk makes), each device's scratch and the memory still free beside the state
are read, and the chunk doubles while the scaled scratch leaves what must stay free:

- the caller's keep (the server's prefix cache budget: retained states grow into it);
- the indexer's score pieces, up to SCORE_SCRATCH more at long context than at the
  measurement's position 0 (a chunk's other scratch does not grow with its position);
- the DSpark draft expert cache's room to grow to its budget (device 0);
- SLACK_BYTES for a live session's CUDA graph pools and the allocator's fragmentation.

Scratch grows linearly with the rows (the measured 4,096 → 8,192 ratio is 1.97), the score
pieces aside: session 65 (one H100, layers 0–13) measured 1.68 GiB at 4,096 rows at start-up
and 3.86 GiB at 8,192 over 32K and 128K prompts, within twice the first plus the 1 GiB kept.
The chunk stops at LARGEST_AUTO_CHUNK, the largest size measured faster. Off CUDA nothing is
measured: the base chunk.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from strata.model.indexer import SCORE_SCRATCH
from strata.runtime.session import PREFILL_CHUNK, Session
from strata.runtime.speculative import SpecConfig

LARGEST_AUTO_CHUNK = 8192
SLACK_BYTES = 1 << 30


def fitting_chunk(base: int, scratch: list[int], free: list[int], keep: list[int],
                  largest: int) -> int:
    """The largest base·2^k ≤ largest whose scratch (each device's base-chunk scratch scaled by
    the rows) plus that device's keep fits in its free memory; base when even 2·base does not
    fit (the base chunk is the one every box is planned for)."""
    chunk = base
    while chunk * 2 <= largest and all(s * (chunk * 2) // base + k <= f
                                       for s, f, k in zip(scratch, free, keep)):
        chunk *= 2
    return chunk


@dataclass(frozen=True)
class ChunkChoice:
    chunk: int
    base: int
    scratch: list[int]  # per device: the base chunk's measured scratch (empty: not measured)
    free: list[int]     # per device: free with the state held
    keep: list[int]     # per device: what must stay free besides the chunk's scratch
    why: str = ""       # where nothing was measured: why

    def describe(self) -> str:
        if not self.scratch:
            return f"prefill chunk {self.chunk} rows ({self.why})"
        gib = 1 << 30
        devices = "; ".join(
            f"device {i}: {self.base}-row scratch {s / gib:.2f} GiB, free {f / gib:.1f} GiB "
            f"beside the state, {k / gib:.1f} GiB kept"
            for i, (s, f, k) in enumerate(zip(self.scratch, self.free, self.keep)))
        return f"prefill chunk {self.chunk} rows ({devices})"


@torch.no_grad()
def choose_prefill_chunk(model, capacity: int, keep_bytes: int = 0,
                         speculative: SpecConfig | None = None, base: int = PREFILL_CHUNK,
                         largest: int = LARGEST_AUTO_CHUNK) -> ChunkChoice:
    """Measure one base-row chunk's scratch on `model`'s devices (a Model or ParallelModel)
    in a fresh state of `capacity` rows, and pick the chunk for that capacity. `keep_bytes`:
    memory every device must keep free for something else (the prefix cache's budget).
    `speculative`: the sessions run DSpark (the measured prefill commits the draft windows)."""
    if model.device.type != "cuda":
        return ChunkChoice(base, base, [], [], [], "not measured off CUDA")
    if capacity - 1 <= base:
        return ChunkChoice(base, base, [], [], [],
                           f"a prompt of at most {capacity - 1} rows is one chunk")
    session = Session(model, capacity, base, speculative=speculative)
    before = model.memory(reset_peak=True)
    rows = torch.randint(0, model.cfg.vocab_size, (base,),
                         generator=torch.Generator().manual_seed(0))
    session.prefill(rows)
    after = model.memory()
    del session  # (its state: freed with the next command to the group)
    scratch = [max(0, a.peak - b.allocated) for a, b in zip(after, before)]
    keep = [keep_bytes + SCORE_SCRATCH + SLACK_BYTES] * len(after)
    cache = getattr(model, "draft_expert_cache", None)
    if cache is not None:  # (grows, as drafts run, on the device that runs them: rank 0's)
        keep[0] += max(0, cache.budget - cache.resident_bytes)
    free = [a.free for a in after]
    return ChunkChoice(fitting_chunk(base, scratch, free, keep, largest), base, scratch, free,
                       keep)


def resolve_prefill_chunk(flag: int | str, model, capacity: int, keep_bytes: int = 0,
                          speculative: SpecConfig | None = None) -> int:
    """The chunk a command runs with: `flag` itself, or for "auto" the measured choice
    (said on stderr, with the figures it came from)."""
    if flag != "auto":
        return flag
    choice = choose_prefill_chunk(model, capacity, keep_bytes, speculative)
    print(f"strata: {choice.describe()}", file=sys.stderr, flush=True)
    return choice.chunk
