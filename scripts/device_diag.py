"""Device diagnostics (one GPU, or both for the layer split): what broke a CUDA-graph capture,
and where a long prefill's time goes.

python scripts/device_diag.py capture LAYERS MODE [VARIANT]
    Runs `MODE` (e.g. oracle:2.9+graphs) on the synthetic V4.1 with LAYERS held. While a graph
    is captured, a profile hook asks CUDA after every Python/C call whether the capture is
    still valid, and prints the first call that returned with it invalidated (the operation
    that broke the capture) with its stack. VARIANT: "relaxed" captures in relaxed mode
    (tells a forbidden API call from a bad kernel), "nofused" disables the one-program
    expert grouping, "nogroups" runs wo_a's groups one by one. (Session 7: the failing run
    hung under the hook instead of printing; relaxed mode passing is what named the cause —
    a graph destroyed mid-capture by the cycle collector.)

python scripts/device_diag.py prefill LAYERS|layer-split TOKENS CHUNK
    Times each prefill chunk (decoder skip on) and profiles a late encoder-only chunk's
    kernels (top 25 by device time; DIAG_PROFILE=0: none): where a long prefill's time goes
    as the context grows. "layer-split": all 40 layers over cuda:0 and cuda:1.
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys
import time
import traceback

import torch


def _cudart():
    roots = [os.path.dirname(torch.__file__)] + sys.path
    for root in roots:
        for pat in ("lib/libcudart.so*", "nvidia/*/lib/libcudart.so*", "nvidia/cu*/lib/libcudart.so*"):
            for f in sorted(glob.glob(os.path.join(root, pat))):
                try:
                    return ctypes.CDLL(f)
                except OSError:
                    pass
    return ctypes.CDLL("libcudart.so")


def capture_status(lib) -> int:
    st = ctypes.c_int(-1)
    lib.cudaStreamIsCapturing(ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
                              ctypes.byref(st))
    return st.value  # 0 none, 1 active, 2 invalidated


def build(layers: str):
    from strata.bench.synthetic import build_synthetic, parse_layers
    from strata.config import v41_flash_config
    cfg = v41_flash_config()
    t0 = time.perf_counter()
    model, _ = build_synthetic(cfg, "cuda:0", layers=parse_layers(layers, cfg.n_layers))
    print(f"built {layers} in {time.perf_counter() - t0:.1f} s", flush=True)
    return cfg, model


def cmd_capture(layers: str, mode: str, variant: str) -> None:
    from strata.runtime import graphs
    if variant == "nofused":
        from strata.kernels import moe_grouping
        moe_grouping.FUSED_PAIRS = -1
    if variant == "nogroups":
        from strata.quant.groups import LinearGroups
        LinearGroups._grouped_exl3 = lambda self, x: None
    lib = _cudart()
    found = []

    def capture(self, run, state):
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        seen = {"last": None}

        def hook(frame, event, arg):
            if found or event not in ("return", "c_return"):
                return
            if capture_status(lib) == 2:
                name = getattr(arg, "__qualname__", None) if event == "c_return" else \
                    frame.f_code.co_name
                found.append((name, "".join(traceback.format_stack(frame, limit=12))))

        mode_ = "relaxed" if variant == "relaxed" else "global"
        with graphs.no_cyclic_gc(), torch.cuda.graph(g, pool=self.pool,
                                                          capture_error_mode=mode_):
            sys.setprofile(hook)
            try:
                run()
            finally:
                sys.setprofile(None)
                if found:
                    print(f"CAPTURE INVALIDATED after {found[0][0]}:\n{found[0][1]}", flush=True)
        return g

    graphs.CudaGraphs.capture = capture
    orig = graphs.GraphedForward._capture

    def _capture(self, tokens, logits):
        free, total = torch.cuda.mem_get_info()
        print(f"capture T={tokens.numel()} logits={logits} pos={self.state.position} "
              f"free {free / 2**30:.1f} GiB reserved {torch.cuda.memory_reserved() / 2**30:.1f} "
              f"GiB", flush=True)
        return orig(self, tokens, logits)
    graphs.GraphedForward._capture = _capture

    from strata.bench.decode import bench_decode
    cfg, model = build(layers)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 100_000, (512,), generator=g).tolist()
    try:
        res = bench_decode(model, prompt, mode.split(","), n=24, runs=1, warmup=1,
                           progress=lambda line: print(line, flush=True))
        print("OK", {k: v.tok_per_s for k, v in res.items()}, flush=True)
    except Exception as e:  # the diagnosis is the point: print and exit non-zero
        print("FAILED", type(e).__name__, str(e)[:300], flush=True)
        sys.exit(1)


PROFILE = os.environ.get("DIAG_PROFILE", "1") == "1"


def cmd_prefill(layers: str, tokens: int, chunk: int) -> None:
    from strata.runtime.session import Session
    if layers == "layer-split":  # all 40 layers over cuda:0 and cuda:1
        from strata.runtime.parallel import ParallelSpec, launch
        model = launch(ParallelSpec("layer", ("cuda:0", "cuda:1"), "", synthetic={
            "config": None, "fmt": "exl3", "seed": 0, "engram": "device",
            "engram_rows": 1 << 20, "engram_dir": None}))
    else:
        cfg, model = build(layers)
    prompt = torch.randint(3, 100_000, (tokens,), generator=torch.Generator().manual_seed(1))
    s = Session(model, tokens + 8, prefill_chunk=chunk, decoder_skip=True)
    fwd = model.forward
    times = []
    n_chunks = -(-tokens // chunk)

    def timed(*a, **k):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if len(times) == n_chunks - 2 and PROFILE:  # a late encoder-only chunk, profiled
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
                out = fwd(*a, **k)
                torch.cuda.synchronize()
            print(p.key_averages().table(sort_by="cuda_time_total", row_limit=25,
                                         max_name_column_width=60), flush=True)
        else:
            out = fwd(*a, **k)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        print(f"chunk {len(times)} at {s.state.position} rows {a[0].numel()} "
              f"decoder_from={k.get('decoder_from')}: {times[-1]:.2f} s", flush=True)
        return out
    model.forward = timed
    t0 = time.perf_counter()
    s.prefill(prompt)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    print(f"prefill {tokens} in {dt:.1f} s = {tokens / dt:.0f} tok/s; peak "
          f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
    if hasattr(model, "close"):
        model.close()


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "capture":
        cmd_capture(sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else "")
    elif what == "prefill":
        cmd_prefill(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        raise SystemExit(__doc__)
