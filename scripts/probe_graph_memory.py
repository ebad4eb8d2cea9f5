"""GPU memory a decode state's CUDA graphs hold — what a state retained for prefix reuse keeps
beyond its caches (runtime/prefix_cache counts the caches, state_nbytes, and the graphs'
memory pools' segments, GraphedForward.nbytes). The synthetic V4.1 as scripts/probe_session.py
(its layers, a 512-token prompt); for each mode, a fresh session decodes 64 tokens (plain steps;
oracle: verify windows, drafts and commits), then prints the device memory allocated and
reserved beyond the model's before and after State.drop_graphs() (a pool's freed scratch stays
reserved: the allocated figure misses it), what the prefix cache counts for the graphs, and
the caches' own bytes. One-off diagnostic (GPU): source scripts/device_env.sh && python
scripts/probe_graph_memory.py"""
import gc

import torch

from strata.bench.decode import _run_once, make_session
from strata.bench.synthetic import build_synthetic, parse_layers
from strata.config import v41_flash_config
from strata.runtime.prefix_cache import state_nbytes
from strata.runtime.sampling import SamplingParams

from probe_session import PROBE_LAYERS

cfg = v41_flash_config()
model, _ = build_synthetic(cfg, "cuda:0", layers=parse_layers(PROBE_LAYERS, cfg.n_layers))
prompt = torch.randint(3, 100_000, (512,), generator=torch.Generator().manual_seed(0)).tolist()
N = 64
reference = _run_once(model, prompt, N, "plain", None, None, None)[0]


def settled() -> tuple[int, int]:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


MB = 2 ** 20
for mode in ("plain+graphs", "oracle+graphs", "oracle:p0.69@3+graphs"):
    base = settled()
    s = make_session(model, prompt, N, mode, reference)
    gen_mode = "plain" if mode.startswith("plain") else "dspark"
    out = list(s.generate(prompt, N, SamplingParams(), stop_ids=frozenset(), mode=gen_mode))
    assert out == reference, mode
    held = [a - b for a, b in zip(settled(), base)]
    caches, counted = state_nbytes(s.state), s.graphed.nbytes()
    captures = s.graphed.captures
    s.state.drop_graphs()
    without = [a - b for a, b in zip(settled(), base)]
    graphs = [(h - w) / MB for h, w in zip(held, without)]
    print(f"{mode}: {captures} captures; the graphs' memory {graphs[0]:.1f} MiB allocated, "
          f"{graphs[1]:.1f} MiB reserved, {counted / MB:.1f} MiB in the pools' segments; "
          f"the caches' own bytes {caches / MB:.1f} MiB", flush=True)
    del s
