"""`strata bench kernels` (or python -m strata.bench.kernels): the EXL3 kernels at V4.1 shapes.

On a CUDA device, for random trellises (and suh/svh) at each shape × K × rows:
- `mm`: y' = x'·Ŵ alone (fused decode kernel at rows ≤ FUSED_MAX_ROWS, else reconstruct +
  GEMM), and `linear`: the whole linear (rotate_in → mm → rotate_out);
- time (triton.testing.do_bench median, warm-up, L2 flushed between runs), weights decoded
  per second (k·n / t), effective GB/s of trellis bytes (k·n·K/8 / t) and that as a fraction
  of a device-to-device copy measured in the same run (bytes read + written / t);
- unless --no-peer, in a child process (its extension JIT-builds with nvcc at import and can
  take the process down; EXL3_INT8_GEMV=0 is set so its mul1 GEMV stays fp16 and comparable),
  exllamav3's whole linear on the same seeded tensors — `LinearEXL3.forward`, its own rows
  dispatch (at 1–144 rows its GEMV/GEMM kernels with suh/svh fused) — the speed-up peer/ours of
  the linear, the two outputs' largest difference, and our reconstructed Ŵ against
  `ext.reconstruct` bit for bit (the whole weight). Its bare `ext.exl3_gemm` without suh/svh
  is not timed: 1.6.5 crashed the process there at 1 row on the H200, and no model of its runs
  that path. Ours is always also checked against strata.quant.exl3.decode_trellis on a slice.
Targets (issue): ours ≥ exllamav3's rate at 1 row, ≥ 1.5× at 6 rows (reported per shape/K).

`--chain`: each linear also timed as the graphed decode step runs it — back to back in one
CUDA graph over copies of the weight (as many as make ≥ CHAIN_BYTES, at most CHAIN_MAX, so every
call reads its weight from memory, not L2), µs per call (`chain_us`, the peer's
`peer_chain_us`). A lone replay's time includes the graph's launch on the device (a few µs
that both sides pay); the chain pays only what one linear costs after another.

`--rowwise`: also the batch-invariant row kernel (strata.kernels.rowwise) at the shapes the
model gives it — a prefill piece's attention q·k (bf16, tensor cores) and p·v (fp32 × bf16),
the indexer's q·k over 32K entries, mHC's long row products, and a decode step's q·k — in
TFLOP/s, against cuBLAS's torch.bmm on the same operands in the same run (not batch-invariant:
the speed the exactness costs). With it, the indexer's selection
(strata.kernels.ranking.top_picks: the k largest finite scores of a row, ties to the lower
index, ascending) at decode (up to 524K entries), window, candidate-block and prefill-piece
shapes against torch.topk + torch.sort of the picks (not tie-exact) and against the exact
selection in torch ops (int64 keys' top-k, a gather, a sort: the CPU path, run on the GPU).

`--smoke`: tiny shapes, CPU under TRITON_INTERPRET=1 (the harness logic, for the test suite).
Output: a markdown table on stdout, JSON (--json) with a .md beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

# (name, in, out): in×out is Ŵ's (k, n)
SHAPES = {
    "expert_w13": (5120, 2304),   # routed/shared expert gate and up
    "expert_w2": (2304, 5120),    # expert down
    "wq_b": (1280, 32768),
    "wo_b": (8192, 5120),
    "head": (5120, 129280),
}
# The attention's small lone linears, by name only (--shapes): where a decode step's EXL3
# launches are latency-bound (their split schedule is the one to tune: --target-programs)
SMALL_SHAPES = {
    "wq_a": (5120, 1280),
    "wkv": (5120, 512),
    "wo_a_group": (4096, 1024),
}
SMOKE_SHAPES = {"smoke": (128, 128)}
KS = (2.0, 2.5, 3.0, 4.0)
ROWS = (1, 2, 6, 512, 2048)
TARGETS = {1: 1.0, 6: 1.5}  # rows → required speed-up over exllamav3 (peer time / ours)
CHAIN_BYTES, CHAIN_MAX = 256 << 20, 16  # a chain's weights: well past the H200's 50 MB of L2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes; on CPU under TRITON_INTERPRET=1 (harness check)")
    p.add_argument("--shapes", default=None,
                   help=f"comma-separated names of {', '.join(SHAPES)} (default: all of "
                        f"these) or {', '.join(SMALL_SHAPES)}")
    p.add_argument("--ks", default=None, help="bits per weight, e.g. 2,2.5,3,4 (default)")
    p.add_argument("--codebook", default="mul1", choices=["mul1", "mcg", "3inst"],
                   help="codebook for integer K (half-integer K is always mul1)")
    p.add_argument("--rows", default=None, help="activation rows, e.g. 1,2,6,512,2048 (default)")
    p.add_argument("--paths", default="auto",
                   help="auto (fused ≤ FUSED_MAX_ROWS rows, else gemm) or a list: fused,gemm")
    p.add_argument("--moe", action="store_true",
                   help="also time the grouped MoE kernel (gate+up, 6 pairs per token)")
    p.add_argument("--rowwise", action="store_true",
                   help="also time the batch-invariant row kernel at the model's shapes, "
                        "against cuBLAS (torch.bmm) on the same operands")
    p.add_argument("--no-peer", action="store_true", help="skip exllamav3 even if it imports")
    p.add_argument("--peer-timeout", type=float, default=1200,
                   help="seconds for the exllamav3 child process (incl. its extension build)")
    p.add_argument("--peer-child", action="store_true",
                   help="run exllamav3's side alone and append its results to --json as JSON "
                        "lines (what the parent's child process does)")
    p.add_argument("--peer-results", default=None,
                   help="merge the JSON lines of an earlier --peer-child run instead of starting "
                        "a child (same shapes, K, rows and codebook)")
    p.add_argument("--results", default=None,
                   help="with --peer-results: measure nothing, merge into this earlier --json "
                        "result (so ours can run while exllamav3's extension builds)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up (ms)")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time (ms)")
    p.add_argument("--eager", action="store_true",
                   help="time eager launches instead of CUDA-graph replays")
    p.add_argument("--chain", action="store_true",
                   help="also time each linear back to back over copies of its weight in one "
                        "CUDA graph (µs per call, as in a graphed decode step), ours and peer")
    p.add_argument("--target-programs", type=int, default=None,
                   help="override strata.kernels.exl3.TARGET_PROGRAMS (split-K schedule) to "
                        "tune it; the engine must keep one fixed value (it sets the order)")
    p.add_argument("--no-pdl", action="store_true",
                   help="launch the fused kernel in plain stream order after its rotate_in "
                        "(strata.kernels.exl3.PDL off), for an A/B of the early launch")
    p.add_argument("--no-mma", action="store_true",
                   help="keep decode-sized linears' matmul on the Triton fused kernel instead "
                        "of the CUDA kernel of strata.kernels.exl3_mma, for an A/B (the 'mm' "
                        "column is the Triton kernel's either way)")
    p.add_argument("--fused-max-rows", type=int, default=None,
                   help="override FUSED_MAX_ROWS (auto path switch; exactness unaffected)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", help="write results here (and a .md table beside it)")


def _csv(s: str | None, conv, default):
    return tuple(conv(v) for v in s.split(",") if v.strip()) if s else default


def event_ms(fn, reps: int = 5) -> float:
    """Median ms of one eager call of fn on CUDA — its launches included — between two CUDA
    events, over `reps` calls after a warm-up (the probes' A/B of kernel variants)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


class Timer:
    """Median time of fn in µs: on CUDA triton.testing.do_bench (L2 flushed between runs) of a
    CUDA-graph replay of fn (GPU time, as the engine's graphed decode sees it; eager if the
    capture fails, counted in `eager_fallbacks`), perf_counter on CPU."""

    def __init__(self, device: torch.device, warmup: int, rep: int, smoke: bool,
                 graph: bool = True) -> None:
        self.device, self.warmup, self.rep, self.smoke = device, warmup, rep, smoke
        self.graph = graph and device.type == "cuda"
        self.eager_fallbacks = 0

    def _graphed(self, fn):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g.replay

    def __call__(self, fn) -> float:
        if self.device.type == "cuda":
            import triton.testing
            run = fn
            if self.graph:
                try:
                    run = self._graphed(fn)
                except Exception:
                    self.eager_fallbacks += 1
                    torch.cuda.synchronize()
            return 1e3 * float(triton.testing.do_bench(run, warmup=self.warmup, rep=self.rep,
                                                       return_mode="median"))
        if not self.smoke:
            fn()  # warm-up
        runs = []
        for _ in range(1 if self.smoke else 3):
            t = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t)
        return 1e6 * statistics.median(runs)


def replay_us(calls, reps: int = 20) -> float:
    """µs per call of `calls` (callables) captured in one CUDA graph and replayed `reps` times
    after a warm-up (CUDA events around the replays). With each call on its own operands —
    more than L2 holds — every call reads from memory, as a decode step's layers do."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / reps / len(calls)


def chain_copies(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                 most: int = CHAIN_MAX) -> list:
    """Copies of one weight for a chain (`--chain`): enough that the chain's trellises
    fill CHAIN_BYTES (at most `most`). A trellis decodes in the same time whatever its
    bits, so copies time like distinct weights."""
    n = max(1, min(most, -(-CHAIN_BYTES // (trellis.numel() * trellis.element_size()))))
    return [(trellis.clone(), suh.clone(), svh.clone()) for _ in range(n)]


def chain_us(timer: "Timer", calls) -> float:
    """µs per call of `calls` run back to back: one CUDA graph's replays on CUDA
    (`replay_us`), the timer over all of them elsewhere (the harness's CPU check)."""
    if timer.device.type == "cuda":
        return replay_us(calls, reps=50)
    return timer(lambda: [c() for c in calls]) / len(calls)


def copy_bandwidth(device: torch.device, timer: Timer, nbytes: int) -> float:
    """GB/s of a device-to-device copy (bytes read + written), launched eagerly: captured in a
    CUDA graph the copy becomes a memcpy node, measured at 2.76 TB/s on the H200, against
    4.27 TB/s for an eager copy in another run — the eager one is the rate kernels can reach."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    eager = Timer(timer.device, timer.warmup, timer.rep, timer.smoke, graph=False)
    us = eager(lambda: dst.copy_(src))
    return 2 * nbytes / (us * 1e-6) / 1e9


class Peer:
    """exllamav3's kernels through a small adapter; `error` says why they are unavailable."""

    def __init__(self) -> None:
        self.ext = self.LinearEXL3 = None
        self.error = None
        self.version = None
        os.environ.setdefault("EXL3_INT8_GEMV", "0")  # its mul1 int8-activation GEMV: off
        try:
            import exllamav3
            from exllamav3.ext import exllamav3_ext as ext
            from exllamav3.modules.quant.exl3 import LinearEXL3
            self.ext, self.LinearEXL3 = ext, LinearEXL3
            from importlib.metadata import version
            self.version = getattr(exllamav3, "__version__", None) or version("exllamav3")
        except Exception as e:  # ImportError, or its nvcc JIT build failing
            self.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]

    @property
    def ok(self) -> bool:
        return self.ext is not None

    @staticmethod
    def _flags(codebook: str) -> tuple[bool, bool]:
        return codebook == "mcg", codebook == "mul1"

    def reconstruct(self, trellis, codebook: str, K: float) -> torch.Tensor:
        kt, nt, _ = trellis.shape
        w = torch.empty((16 * kt, 16 * nt), dtype=torch.float16, device=trellis.device)
        self.ext.reconstruct(w, trellis, float(K), *self._flags(codebook))
        return w

    def linear(self, trellis, suh, svh, codebook: str, x16: torch.Tensor):
        from strata.quant.exl3 import MARKERS
        k, n = 16 * trellis.shape[0], 16 * trellis.shape[1]
        marker = {c: torch.tensor(MARKERS[c], dtype=torch.int32) for c in ("mcg", "mul1")}
        lin = self.LinearEXL3(None, k, n, suh=suh, svh=svh, trellis=trellis,
                              mcg=marker["mcg"] if codebook == "mcg" else None,
                              mul1=marker["mul1"] if codebook == "mul1" else None,
                              out_dtype=torch.float32)
        return lambda: lin.forward(x16, {})


def random_linear(k: int, n: int, K: float, device, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    L = int(16 * K) if K == int(K) else int(16 * (K - 0.5)) + 8
    trellis = torch.randint(-2**15, 2**15, (k // 16, n // 16, L), generator=g,
                            dtype=torch.int32).to(torch.int16).to(device)
    suh = (torch.randn(k, generator=g) / k ** 0.5).half().to(device)
    svh = (torch.randn(n, generator=g) * 0.05).half().to(device)
    return trellis, suh, svh


def _inputs(X, M: int, k: int, suh, dev):
    """The M activation rows for a (shape, K) case (seeded by M: parent and peer child agree)
    and their rotation x'."""
    g = torch.Generator(device="cpu").manual_seed(1000 + M)
    x = torch.randn(M, k, generator=g).to(dev, torch.bfloat16)
    return x, X.rotate_in(x, suh)


def _cases(args, smoke: bool):
    """(name, k, n, K, codebook, seed) for every weight of the run, in order."""
    shapes = SMOKE_SHAPES if smoke else SHAPES
    if args.shapes:
        named = SMOKE_SHAPES if smoke else {**SHAPES, **SMALL_SHAPES}
        names = [s.strip() for s in args.shapes.split(",") if s.strip()]
        unknown = [s for s in names if s not in named]
        if unknown:
            from strata.errors import StrataError
            raise StrataError(f"--shapes {','.join(unknown)}: not a shape of this run "
                              f"({', '.join(named)}{'; --smoke has its own' if smoke else ''})")
        shapes = {s: named[s] for s in names}
    out, seed = [], 0
    for name, (k, n) in shapes.items():
        for K in _csv(args.ks, float, (2.5,) if smoke else KS):
            seed += 1
            out.append((name, k, n, K, "mul1" if K != int(K) else args.codebook, seed))
    return out


def _row(name, k, n, K, cb, M, path, us, copy_gbs):
    tb = k * n * K / 8
    return {"shape": name, "k": k, "n": n, "K": K, "codebook": cb, "rows": M, "path": path,
            "median_us": us, "gweights_per_s": k * n / (us * 1e-6) / 1e9,
            "trellis_gb_per_s": tb / (us * 1e-6) / 1e9,
            "hbm_fraction": (tb / (us * 1e-6) / 1e9) / copy_gbs if copy_gbs else None}


def run(args) -> dict:
    smoke = args.smoke
    dev = torch.device(args.device if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda":
        if not smoke:
            raise SystemExit("strata bench kernels: no CUDA device (use --smoke on CPU)")
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first defined
    from strata.kernels import exl3 as X
    from strata.quant.exl3 import decode_trellis

    if args.target_programs:
        X.TARGET_PROGRAMS = args.target_programs
    if args.fused_max_rows is not None:
        X.FUSED_MAX_ROWS = args.fused_max_rows
    if args.no_pdl:
        X.PDL = False
    if args.no_mma:
        from strata.kernels import exl3_mma
        exl3_mma.ENABLED = False
    rows_list = _csv(args.rows, int, (1,) if smoke else ROWS)
    paths = None if args.paths == "auto" else _csv(args.paths, str, ())
    timer = Timer(dev, args.warmup, args.rep, smoke, graph=not args.eager)
    copy_gbs = copy_bandwidth(dev, timer, (1 << 20) if smoke else (1 << 30))
    want_peer = not (args.no_peer or smoke or dev.type != "cuda")
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "smoke": smoke, "device": (
        torch.cuda.get_device_name(dev) if dev.type == "cuda"
        else platform.processor() or platform.machine()),
        "torch": torch.__version__, "copy_gb_per_s": copy_gbs,
        "command": " ".join(sys.argv), "fused_max_rows": X.FUSED_MAX_ROWS,
        "config": {"BLOCK_M": X.BLOCK_M, "BLOCK_N": X.BLOCK_N, "BLOCK_K": X.BLOCK_K,
                   "GEMM_BLOCK_M": X.GEMM_BLOCK_M, "GEMM_BLOCK_N": X.GEMM_BLOCK_N,
                   "TARGET_PROGRAMS": X.TARGET_PROGRAMS,
                   "exl3_mma": not args.no_mma},
        "peer": "skipped",
        "targets": "speed-up over exllamav3 (its time / ours): ≥ 1.0 at 1 row, ≥ 1.5 at 6 rows"}
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    rows, checks = [], {"reconstruct_bit_exact": True, "details": []}
    for name, k, n, K, cb, seed in _cases(args, smoke):
        trellis, suh, svh = random_linear(k, n, K, dev, seed)
        # bit-exactness of Ŵ against the torch decoder (against exllamav3's: the peer child)
        ours_w = X.reconstruct(trellis, cb)
        kt_ = min(trellis.shape[0], 16)
        ref_w = decode_trellis(trellis[:kt_].cpu(), cb)
        exact = torch.equal(ours_w[:16 * kt_].cpu().view(torch.int16), ref_w.view(torch.int16))
        del ours_w, ref_w
        checks["reconstruct_bit_exact"] &= exact
        checks["details"].append({"shape": name, "K": K, "codebook": cb,
                                  "against": f"strata decode_trellis (first {16 * kt_} rows)",
                                  "bit_exact": exact})
        copies = (chain_copies(trellis, suh, svh, 2 if smoke else CHAIN_MAX) if args.chain
                  else [])
        for M in rows_list:
            x, xr = _inputs(X, M, k, suh, dev)
            for path in paths or (("fused" if M <= X.FUSED_MAX_ROWS else "gemm"),):
                us = timer(lambda: X.exl3_partials(xr, trellis, cb, path))
                r = _row(name, k, n, K, cb, M, path, us, copy_gbs)
                r["linear_us"] = timer(lambda: X.exl3_linear(x, trellis, suh, svh, cb,
                                                             path=path))
                if copies:
                    r["chain_us"] = chain_us(timer, [
                        (lambda t=t, a=a, b=b: X.exl3_linear(x, t, a, b, cb, path=path))
                        for t, a, b in copies])
                    r["chain_copies"] = len(copies)
                rows.append(r)
                print(_md_line(r), flush=True)
        del copies
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if args.peer_results:
        meta["peer"] = _merge_peer_file(args.peer_results, rows, checks)
    elif want_peer:
        meta["peer"] = _merge_peer(args, rows, checks)
    moe = _bench_moe(X, dev, timer, copy_gbs, smoke, args.codebook) if args.moe or smoke else []
    rowwise = _bench_rowwise(dev, timer, smoke) if args.rowwise or smoke else []
    selection = _bench_selection(dev, timer, smoke) if args.rowwise or smoke else []
    meta["timing"] = ("cuda-graph replay" if timer.graph else "eager") + (
        f" ({timer.eager_fallbacks} eager fallbacks)" if timer.eager_fallbacks else "")
    return {"meta": meta, "rows": rows, "moe": moe, "rowwise": rowwise, "selection": selection,
            "checks": checks, "targets": _targets(rows)}


def _peer_argv(args) -> list[str]:
    argv = [sys.executable, "-X", "faulthandler", "-m", "strata.bench.kernels", "--peer-child",
            "--warmup", str(args.warmup), "--rep", str(args.rep), "--codebook", args.codebook,
            "--device", args.device]
    for opt in ("shapes", "ks", "rows", "paths"):
        if getattr(args, opt) not in (None, "auto"):
            argv += [f"--{opt}", getattr(args, opt)]
    if args.eager:
        argv.append("--eager")
    if args.chain:
        argv.append("--chain")
    if args.fused_max_rows is not None:
        argv += ["--fused-max-rows", str(args.fused_max_rows)]
    if args.no_pdl:
        argv += ["--no-pdl"]
    return argv


def _merge_peer(args, rows: list[dict], checks: dict) -> str:
    """Run exllamav3's side in a child process (its extension can crash the process, and a
    crash while building leaves a lock that hangs the next import) and merge its numbers into
    our rows — also those of a child that died or ran out of time, which writes each result as
    it gets it; the return value says what happened."""
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peer.jsonl"
        env = dict(os.environ, EXL3_INT8_GEMV="0")
        failure = None
        try:
            proc = subprocess.run(_peer_argv(args) + ["--json", str(out)], env=env,
                                  capture_output=True, text=True, timeout=args.peer_timeout)
            if proc.returncode != 0:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
                failure = f"exit {proc.returncode}: " + " / ".join(tail)[-600:]
        except subprocess.TimeoutExpired:
            failure = f"ran past {args.peer_timeout:g} s"
        res = _read_peer_lines(out)
    return _apply_peer(res, rows, checks, failure)


def _merge_peer_file(path: str, rows: list[dict], checks: dict) -> str:
    return _apply_peer(_read_peer_lines(Path(path)), rows, checks, None) + f" (from {path})"


def _apply_peer(res: dict, rows: list[dict], checks: dict, failure: str | None) -> str:
    """Merge the child's results (`_read_peer_lines`) into our rows: its times, speed-ups
    (its time / ours) and the bit-exactness of Ŵ against its reconstruct."""
    if "error" in res:
        return f"unavailable: {res['error']}"
    if not res["rows"] and not res["checks"]:
        return f"unavailable: the exllamav3 child {failure or 'gave no results'}"
    by_key = {(r["shape"], r["K"], r["rows"], r["path"]): r for r in res["rows"]}
    for r in rows:
        p = by_key.get((r["shape"], r["K"], r["rows"], r["path"]))
        if p is None:
            continue
        for key, v in p.items():
            if key.startswith("peer_") or key.endswith("_vs_peer"):
                r[key] = v
        if "peer_linear_us" in p:
            r["speedup_linear"] = p["peer_linear_us"] / r["linear_us"]
        if "peer_chain_us" in p and "chain_us" in r:
            r["speedup_chain"] = p["peer_chain_us"] / r["chain_us"]
    checks["peer_reconstruct_bit_exact"] = all(d["bit_exact"] for d in res["checks"])
    checks["peer_details"] = res["checks"]
    status = f"exllamav3 {res['version']} (in a child process)"
    return status if failure is None else f"{status}, partial: the child {failure}"


def _read_peer_lines(path: Path) -> dict:
    """The peer child's results file: one JSON object per line, {"version"}, {"error"},
    {"check": …} or {"row": …}; a line cut short by a kill is ignored."""
    res: dict = {"version": None, "rows": [], "checks": []}
    if not path.exists():
        return res
    for line in path.read_text().splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "row" in item:
            res["rows"].append(item["row"])
        elif "check" in item:
            res["checks"].append(item["check"])
        else:
            res.update(item)
    return res


def run_peer_child(args) -> None:
    """exllamav3's kernels on the same seeded tensors as the parent: its reconstruct against
    ours bit for bit, LinearEXL3.forward timed, and our linear's output against its. Each
    result is appended to args.json as it comes (a crash or a kill keeps what was measured);
    progress goes to stderr, so a crash shows where."""
    dev = torch.device(args.device)
    from strata.kernels import exl3 as X
    if args.fused_max_rows is not None:
        X.FUSED_MAX_ROWS = args.fused_max_rows
    if args.no_pdl:
        X.PDL = False
    with open(args.json, "w") as f:
        def emit(**item):
            f.write(json.dumps(item) + "\n")
            f.flush()
        peer = Peer()
        if not peer.ok:
            emit(error=peer.error)
            return
        emit(version=peer.version)
        timer = Timer(dev, args.warmup, args.rep, False, graph=not args.eager)
        paths = None if args.paths == "auto" else _csv(args.paths, str, ())
        for name, k, n, K, cb, seed in _cases(args, False):
            print(f"peer: {name} K={K} reconstruct", file=sys.stderr, flush=True)
            trellis, suh, svh = random_linear(k, n, K, dev, seed)
            ours_w = X.reconstruct(trellis, cb)
            peer_w = peer.reconstruct(trellis, cb, K)
            torch.cuda.synchronize()
            emit(check={"shape": name, "K": K, "codebook": cb,
                        "against": "exllamav3 ext.reconstruct",
                        "bit_exact": torch.equal(ours_w.view(torch.int16),
                                                 peer_w.view(torch.int16))})
            del ours_w, peer_w
            copies = chain_copies(trellis, suh, svh) if args.chain else []
            for M in _csv(args.rows, int, ROWS):
                x, _ = _inputs(X, M, k, suh, dev)
                for path in paths or (("fused" if M <= X.FUSED_MAX_ROWS else "gemm"),):
                    print(f"peer: {name} K={K} rows={M}", file=sys.stderr, flush=True)
                    r = {"shape": name, "K": K, "rows": M, "path": path}
                    try:
                        fn = peer.linear(trellis, suh, svh, cb, x.half())
                        r["peer_linear_us"] = timer(fn)
                        if copies:
                            r["peer_chain_us"] = chain_us(timer, [
                                peer.linear(t, a, b, cb, x.half()) for t, a, b in copies])
                        y_peer = fn()
                        ours = X.exl3_linear(x, trellis, suh, svh, cb, path=path).float()
                        r["linear_max_rel_diff_vs_peer"] = float(
                            (ours - y_peer).abs().max() / y_peer.abs().max().clamp(min=1e-30))
                    except Exception as e:  # report, go on with the next case
                        r["peer_error"] = f"{type(e).__name__}: {e}"[:300]
                    emit(row=r)
            del copies
            torch.cuda.empty_cache()


def _bench_moe(X, dev, timer, copy_gbs, smoke, cb) -> list[dict]:
    """Gate + up (two weight sets) for T tokens × 6 slots over E stacked experts, one launch."""
    k, n, E, K = (128, 128, 2, 2.0) if smoke else (5120, 2304, 32, 2.0)
    out = []
    sets = [random_linear(k, n, K, dev, 50 + w) for w in range(2)]
    stacks = []
    for w in range(2):  # E experts: repeat one random expert's tensors (values do not matter)
        tr, suh, svh = sets[w]
        stacks.append((tr.unsqueeze(0).repeat(E, 1, 1, 1), suh.unsqueeze(0).repeat(E, 1),
                       svh.unsqueeze(0).repeat(E, 1)))
    for T in ((1,) if smoke else (1, 2, 6)):
        kk = min(6, E)
        g = torch.Generator(device="cpu").manual_seed(T)
        idx = torch.stack([torch.randperm(E, generator=g)[:kk] for _ in range(T)]).to(dev)
        x = torch.randn(T, k, generator=g).to(dev, torch.bfloat16)
        us = timer(lambda: X.exl3_moe_linear(x, idx, stacks, cb))
        distinct = int(torch.unique(idx).numel())
        w = 2 * distinct * k * n  # weights decoded at least once
        out.append({"T": T, "slots": kk, "experts": E, "distinct": distinct, "K": K,
                    "codebook": cb, "k": k, "n": n, "median_us": us,
                    "gweights_per_s": w / (us * 1e-6) / 1e9,
                    "trellis_gb_per_s": w * K / 8 / (us * 1e-6) / 1e9})
    return out


# (name, B, M, N, K, x dtype, w dtype, w as a transposed view): what the model hands the row
# kernel — a prefill piece of 243 queries (attention.ATTN_SCRATCH) × 64 heads against its 640
# rows of 512 and back, one decode query's q·k and p·v — and, through its former path, the
# indexer's 32 heads × 128 against 32K keys for 64 queries. Two fused kernels time what the
# model runs instead of the row kernel: "index_scores", the indexer's whole score
# Σ_h w_h·relu(q_h·k) in one launch (strata.kernels.indexer) against cuBLAS's q·k (bf16 out)
# + relu + the heads' weighted sum ("index_candidates": a query's own entries alone, gathered
# by id, against torch's gather and the same products); "mhc", mHC's products and the
# stream's sum of squares in one pass (strata.kernels.mhc.hc_mix, 4·D-long rows for a
# 4,096-row chunk and for one decode row) against cuBLAS's product and torch's mean square.
ROWWISE = (("attn_qk_prefill", 243, 64, 640, 512, "bf16", "bf16", False),
           ("attn_pv_prefill", 243, 64, 512, 640, "fp32", "bf16", True),
           ("index_qk_prefill", 64, 32, 32768, 128, "bf16", "bf16", False),
           ("index_scores_prefill", 64, 32, 32768, 128, "bf16", "bf16", False),
           # a reindex layer's decode query: its 2,048 candidate blocks of 8 alone, of 524K
           ("index_candidates_decode", 1, 32, 16384, 128, "bf16", "bf16", False),
           ("mhc_prefill", 4096, 1, 24, 20480, "fp32", "fp32", False),
           ("mhc_decode", 1, 1, 24, 20480, "fp32", "fp32", False),
           ("attn_qk_decode", 1, 64, 640, 512, "bf16", "bf16", False),
           ("attn_pv_decode", 1, 64, 512, 640, "fp32", "bf16", True),
           # the softmax and p·v in two launches from the scores (the model's path:
           # strata.kernels.attention.sink_softmax_pv; x the scores, against torch's softmax
           # steps and cuBLAS's p·v) — a prefill piece, a DSpark window, a decode query
           ("attn_softmax_pv_prefill", 192, 64, 512, 640, "fp32", "bf16", True),
           ("attn_softmax_pv_window", 6, 64, 512, 640, "fp32", "bf16", True),
           ("attn_softmax_pv_decode", 1, 64, 512, 640, "fp32", "bf16", True))
SMOKE_ROWWISE = (("smoke_qk", 3, 4, 40, 32, "bf16", "bf16", False),
                 ("smoke_pv", 3, 4, 32, 40, "fp32", "bf16", True),
                 ("smoke_softmax_pv", 3, 4, 32, 40, "fp32", "bf16", True),
                 ("index_scores_smoke", 3, 4, 40, 32, "bf16", "bf16", False),
                 ("index_candidates_smoke", 3, 4, 16, 32, "bf16", "bf16", False),
                 ("mhc_smoke", 3, 1, 24, 64, "fp32", "fp32", False))
_DT = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _bench_rowwise(dev, timer, smoke) -> list[dict]:
    """The row kernel (and the fused indexer scores and mHC mix) against cuBLAS on the same
    operands: µs and TFLOP/s."""
    from strata.kernels.attention import sink_softmax_pv
    from strata.kernels.indexer import index_scores
    from strata.kernels.rowwise import rowwise_bmm
    out = []
    for name, B, M, N, K, xd, wd, transposed in SMOKE_ROWWISE if smoke else ROWWISE:
        g = torch.Generator(device="cpu").manual_seed(B + N)
        x = torch.randn(B, M, K, generator=g).to(dev, _DT[xd])
        # the model's w for p·v is the gathered rows [B, K, N] seen as [B, N, K]
        w = (torch.randn(B, K, N, generator=g).to(dev, _DT[wd]).transpose(1, 2) if transposed
             else torch.randn(1 if name.startswith("index") else B, N, K,
                              generator=g).to(dev, _DT[wd]))
        common = torch.promote_types(x.dtype, w.dtype)
        xc, wc = x.to(common), w.to(common).expand(B, -1, -1).transpose(1, 2)
        flop = 2 * B * M * N * K
        if name.startswith("mhc"):  # mHC's products and Σx² in one pass, as the model runs it
            from strata.kernels.mhc import hc_mix
            x2, fn = x.view(B, K), w[0]
            ours = timer(lambda: hc_mix(x2.view(B, 4, K // 4), fn))
            blas = timer(lambda: (torch.mm(x2, fn.T), (x2 * x2).mean(-1)))
        elif name.startswith("index_candidates"):  # N of 32·N keys, each query its own
            from strata.model.indexer import candidate_entries
            heads = torch.randn(B, M, generator=g).to(dev)
            keys = torch.randn(32 * N, K, generator=g).to(dev, _DT[wd])
            blocks = torch.stack([torch.randperm(4 * N, generator=g)[:N // 8].sort().values
                                  for _ in range(B)]).to(dev)
            entries = candidate_entries(blocks, 8)
            seen = torch.full((B,), 32 * N, dtype=torch.long, device=dev)
            ours = timer(lambda: index_scores(x, keys, heads, seen, entries=entries))
            hc = heads.to(common).unsqueeze(1)
            blas = timer(lambda: torch.bmm(hc, torch.relu(torch.bmm(
                xc, keys[entries].to(common).transpose(1, 2)))))
            flop += 2 * B * M * N
        elif name.startswith("index_scores"):
            heads = torch.randn(B, M, generator=g).to(dev)
            hc = heads.to(common).unsqueeze(1)
            seen = torch.full((B,), N, dtype=torch.long, device=dev)
            ours = timer(lambda: index_scores(x, w[0], heads, seen))
            blas = timer(lambda: torch.bmm(hc, torch.relu(torch.bmm(xc, wc))))
            flop += 2 * B * M * N
        elif "softmax_pv" in name:  # x: scores; the rows [B, K, N] seen as w [B, N, K]
            rows, sink = w.transpose(1, 2), torch.randn(M, generator=g).to(dev)
            mask = (torch.rand(B, K, generator=g) > 0.1).to(dev)

            def steps():
                s = (x * 0.044).masked_fill(~mask[:, None, :], float("-inf"))
                s = torch.cat((s, sink.view(1, M, 1).expand(B, M, 1)), dim=-1)
                return torch.bmm(torch.softmax(s, dim=-1)[..., :-1], wc)
            ours = timer(lambda: sink_softmax_pv(x, mask, sink, 0.044, rows))
            blas = timer(steps)
        else:
            ours = timer(lambda: rowwise_bmm(x, w, out_dtype=torch.float32))
            blas = timer(lambda: torch.bmm(xc, wc))
        out.append({"case": name, "B": B, "M": M, "N": N, "K": K, "x": xd, "w": wd,
                    "ours_us": ours, "blas_us": blas, "ours_tflops": flop / ours / 1e6,
                    "blas_tflops": flop / blas / 1e6, "ours_over_blas_time": ours / blas})
    return out


# (name, rows, entries, picks): a decode query against 8K to 524K entries (a ratio-1 layer at
# that many tokens of context), a DSpark window's 6 queries, a candidate source's blocks, a
# prefill piece (indexer.SCORE_SCRATCH's rows at 16K entries)
SELECTION = (("decode_8k", 1, 8192, 512), ("decode_32k", 1, 32768, 512),
             ("decode_131k", 1, 131072, 512), ("decode_524k", 1, 524288, 512),
             ("window_32k", 6, 32768, 512), ("candidate_blocks", 1, 16384, 2048),
             ("prefill_piece", 2048, 16384, 512))
SMOKE_SELECTION = (("selection_smoke", 3, 300, 16),)


def _bench_selection(dev, timer, smoke) -> list[dict]:
    """The indexer's selection (strata.kernels.ranking.top_picks) against torch's top-k and
    sort, and against the exact torch path (strata.model.indexer.topk_lowest_index with the
    kernels off)."""
    from strata.kernels import ranking
    from strata.model import indexer
    out = []
    for name, T, n, k in SMOKE_SELECTION if smoke else SELECTION:
        g = torch.Generator(device="cpu").manual_seed(n + T)
        scores = torch.randn(T, n, generator=g)
        scores[:, n - n // 8:] = float("-inf")  # (a bucket's entries past the visible ones)
        scores = scores.to(dev)
        ours = timer(lambda: ranking.top_picks(scores, k))
        peer = timer(lambda: torch.sort(torch.topk(scores, k, sorted=False).indices).values)
        available = ranking.available
        ranking.available = lambda t: False
        try:
            exact = timer(lambda: indexer.topk_lowest_index(scores, k))
        finally:
            ranking.available = available
        out.append({"case": name, "rows": T, "entries": n, "picks": k, "ours_us": ours,
                    "torch_topk_sort_us": peer, "exact_torch_us": exact})
    return out


def _targets(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        if r["rows"] in TARGETS and "speedup_linear" in r:
            need = TARGETS[r["rows"]]
            t = {"shape": r["shape"], "K": r["K"], "rows": r["rows"], "need": need,
                 "speedup_linear": r["speedup_linear"],
                 "met_linear": r["speedup_linear"] >= need}
            if "speedup_chain" in r:
                t.update(speedup_chain=r["speedup_chain"],
                         met_chain=r["speedup_chain"] >= need)
            out.append(t)
    return out


HEADER = ("| shape | k×n | K | cb | rows | path | mm µs | linear µs | Gw/s | trellis GB/s | "
          "% copy BW | peer linear µs | speed-up linear | chained µs | peer chained µs | "
          "speed-up chained | max rel diff vs peer |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def _f(v, fmt):
    return "–" if v is None else format(v, fmt)


def _md_line(r: dict) -> str:
    return (f"| {r['shape']} | {r['k']}×{r['n']} | {r['K']:g} | {r['codebook']} | {r['rows']} | "
            f"{r['path']} | {r['median_us']:.1f} | {_f(r.get('linear_us'), '.1f')} | "
            f"{r['gweights_per_s']:.0f} | {r['trellis_gb_per_s']:.0f} | "
            f"{_f(r['hbm_fraction'] and 100 * r['hbm_fraction'], '.1f')} | "
            f"{_f(r.get('peer_linear_us'), '.1f')} | {_f(r.get('speedup_linear'), '.2f')} | "
            f"{_f(r.get('chain_us'), '.1f')} | {_f(r.get('peer_chain_us'), '.1f')} | "
            f"{_f(r.get('speedup_chain'), '.2f')} | "
            f"{_f(r.get('linear_max_rel_diff_vs_peer'), '.1e')} |")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table after a blank line."""
    return (["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(r) + " |" for r in rows])


def _tally(targets: list[dict], how: str) -> str:
    """The targets met by their `how` speed-up (linear or chain), in all and by row count,
    then the short ones: e.g. 31/40 (1 row 20/20, 6 rows 11/20). Short: wq_b K 2, 6 rows:
    1.368; …"""
    met = [t for t in targets if t[f"met_{how}"]]
    counts = sorted({t["rows"] for t in targets})
    by_rows = ", ".join(
        f"{m} row{'s' if m > 1 else ''} {sum(t['rows'] == m for t in met)}/"
        f"{sum(t['rows'] == m for t in targets)}" for m in counts)
    short = [f"{t['shape']} K {t['K']:g}, {t['rows']} row{'s' if t['rows'] > 1 else ''}: "
             f"{t[f'speedup_{how}']:.3f}" for t in targets if not t[f"met_{how}"]]
    return (f"{len(met)}/{len(targets)} ({by_rows})."
            + (f" Short: {'; '.join(short)}." if short else ""))


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [HEADER] + [_md_line(r) for r in res["rows"]]
    lines += ["", f"Device: {m['device']}; copy bandwidth {m['copy_gb_per_s']:.0f} GB/s "
              f"(read + written); timing: {m.get('timing', '')}; peer: {m['peer']}; "
              f"{m['targets']}. mm = y' = x'·Ŵ (ours: the split partials, summed in the output "
              f"Hadamard step); linear = the whole layer incl. both Hadamard steps.",
              f"Ŵ bit-exact: {res['checks']['reconstruct_bit_exact']} "
              f"({len(res['checks']['details'])} weights checked against the torch decoder)."]
    if "peer_reconstruct_bit_exact" in res["checks"]:
        lines.append(f"Ŵ bit-exact against exllamav3's reconstruct: "
                     f"{res['checks']['peer_reconstruct_bit_exact']} "
                     f"({len(res['checks']['peer_details'])} weights).")
    if res["targets"]:
        lines.append("Targets met (the whole linear, ours against exllamav3's): "
                     + _tally(res["targets"], "linear"))
        chained = [t for t in res["targets"] if "met_chain" in t]
        if chained:
            lines.append("Targets met with both chained: " + _tally(chained, "chain"))
    if res.get("rowwise"):
        lines += _table(
            ["row kernel case", "B×M×N×K", "x·w", "ours µs", "TFLOP/s", "cuBLAS µs", "TFLOP/s",
             "ours/cuBLAS time"],
            [[r["case"], f"{r['B']}×{r['M']}×{r['N']}×{r['K']}", f"{r['x']}·{r['w']}",
              f"{r['ours_us']:.1f}", f"{r['ours_tflops']:.1f}", f"{r['blas_us']:.1f}",
              f"{r['blas_tflops']:.1f}", f"{r['ours_over_blas_time']:.2f}"]
             for r in res["rowwise"]])
    if res.get("selection"):
        lines += _table(
            ["indexer selection", "rows × entries → picks", "ours µs", "torch top-k + sort µs",
             "exact torch path µs", "ours/top-k time"],
            [[r["case"], f"{r['rows']} × {r['entries']} → {r['picks']}", f"{r['ours_us']:.1f}",
              f"{r['torch_topk_sort_us']:.1f}", f"{r['exact_torch_us']:.1f}",
              f"{r['ours_us'] / r['torch_topk_sort_us']:.2f}"] for r in res["selection"]])
    if res["moe"]:
        lines += _table(
            ["MoE gate+up: tokens", "slots", "distinct experts", "µs", "Gw/s", "GB/s"],
            [[str(r["T"]), str(r["slots"]), str(r["distinct"]), f"{r['median_us']:.1f}",
              f"{r['gweights_per_s']:.0f}", f"{r['trellis_gb_per_s']:.0f}"] for r in res["moe"]])
    return "\n".join(lines)


def run_from_args(args) -> int:
    if args.peer_child:
        run_peer_child(args)
        return 0
    if args.results:
        if not args.peer_results:
            raise SystemExit("strata bench kernels: --results needs --peer-results")
        res = json.loads(Path(args.results).read_text())
        res["meta"]["peer"] = _merge_peer_file(args.peer_results, res["rows"], res["checks"])
        res["targets"] = _targets(res["rows"])
    else:
        res = run(args)
    md = markdown(res)
    print(md)
    if args.json:
        p = Path(args.json)
        p.write_text(json.dumps(res, indent=1))
        p.with_suffix(".md").write_text(md + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m strata.bench.kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
