"""The decode session the GPU probes (scripts/probe_*.py) run: the synthetic V4.1 with
PROBE_LAYERS (LAYERS in the environment: others, as `--layers`), a random prompt of PROMPT
tokens (environment, default 512; e.g. 32768: a step at an agent's context length), greedy, and
a mode of `strata bench synthetic` (plain, oracle, oracle:X, each + "+graphs"); oracle drafts
are plain decoding's own continuation. ENGRAM=disk (environment): the Engram tables on disk (in
ENGRAM_DIR, default /tmp/eng), as `--engram disk`. Imported by the probes (run from the repo
root as `python scripts/probe_….py`: this folder is on their path)."""
from __future__ import annotations

import gzip
import json
import os
import shutil

import torch
from torch.profiler import ProfilerActivity, profile

from strata.bench.decode import GRAPHS, _run_once, make_session
from strata.bench.synthetic import build_synthetic, parse_layers
from strata.config import v41_flash_config
from strata.runtime.sampling import SamplingParams


WARM_UP = 4  # steps run before a probe measures: the graphs captured, the caches filled
# The probes' and device scripts' layers: five encoder and five decoder layers, as the A/Bs
# since session 46 (scripts/device_prefill_ab.sh). Half the model (0-9,20-29) fits an H200,
# not the H100 the device mostly lends.
PROBE_LAYERS = "0-4,20-24"


def probe_session(mode: str, steps: int):
    """(session, one_step) with the session started (its prompt prefilled, the first token
    out), WARM_UP steps run and the device synchronized, and room for `steps` more;
    one_step() runs one plain step or, in a DSpark mode, one verify window with its draft."""
    cfg = v41_flash_config()
    engram = os.environ.get("ENGRAM", "device")
    layers = parse_layers(os.environ.get("LAYERS", PROBE_LAYERS), cfg.n_layers)
    engram_dir = os.environ.get("ENGRAM_DIR", "/tmp/eng") if engram == "disk" else None
    model, _ = build_synthetic(cfg, "cuda:0", layers=layers, engram=engram,
                               engram_dir=engram_dir)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 100_000, (int(os.environ.get("PROMPT", 512)),),
                           generator=g).tolist()
    window = not mode.removesuffix(GRAPHS).startswith("plain")
    per = cfg.dspark_block_size + 1 if window else 1
    n = (steps + WARM_UP + 3) * per + 1
    reference = _run_once(model, prompt, n, "plain", None, None, None)[0] if window else None
    s = make_session(model, prompt, n, mode, reference)
    gen = s.generate(prompt, n, SamplingParams(), stop_ids=frozenset(),
                     mode="dspark" if window else "plain")
    next(gen)

    def one_step() -> None:
        if not window:
            next(gen)
            return
        target = s.stats.windows + 1
        while s.stats.windows < target:
            next(gen)
    for _ in range(WARM_UP):
        one_step()
    torch.cuda.synchronize()
    return s, one_step


def traced(one_step, steps: int, path: str, stacks: bool = False, keep: bool = False) -> list:
    """The chrome-trace events of `steps` profiled steps (CUDA activity; with `stacks`, the
    host's too, with Python stacks); the trace kept gzipped at path + ".gz" if `keep`."""
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if stacks else [ProfilerActivity.CUDA]
    with profile(activities=activities, with_stack=stacks) as prof:
        for _ in range(steps):
            one_step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    if keep:
        with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as z:
            shutil.copyfileobj(f, z)
    os.remove(path)
    return events
