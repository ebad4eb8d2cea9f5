"""The step's small kernels at decode shapes (1 and 6 rows, V4.1's widths) under other warp
counts: each op's call captured CALLS times in a row in one CUDA graph (early launch as in the
model), µs a call from the graph's replays (strata.bench.kernels.replay_us), for each
num_warps the kernel is launched with (the launch keyword overridden by wrapping the kernel's
run; the code's own value marked *) — or, with KNOB=num_stages, each pipeline depth.
Attention's products also by K chunk and tile, and its softmax with p·v; the indexer's
selection at 768, 32K and 128K entries (a decode step's at those context lengths:
ONLY=index), and the selection alone up to 512K entries by how a row is split, beside the
torch ops it replaces (ONLY=top).
What it shows is each kernel's time as a link of a chain of its own kind — the model's chain
mixes kinds, so a winner here still needs the model-level A/B.
One-off diagnostic (GPU): source scripts/device_env.sh &&
  [ONLY=text] [KNOB=num_stages | KNOB=keyword VALUES="v …"] [RANKING="NAME=v …"]
  python scripts/probe_warps.py"""
import os

import torch

from strata.bench.kernels import replay_us
from strata.kernels import attention, exl3, indexer, mhc, moe_ops, norm, ranking, rowwise
from strata.model.indexer import topk_lowest_index

CALLS, REPLAYS = 32, 40
# RANKING="PICKS_BLOCK=2048 PICKS_PROGRAMS=132": the selection's module settings for this run
for setting in os.environ.get("RANKING", "").split():
    name, value = setting.split("=")
    setattr(ranking, name, int(value))
dev = torch.device("cuda")
bf, f32 = torch.bfloat16, torch.float32
D, H = 5120, 4


def rnd(*shape, dtype=bf):
    return torch.randn(*shape, device=dev).to(dtype)


# attention's products: (k_chunk, tile) — the code's (None: tile_shape's), then others
PRODUCT_VARIANTS = [(rowwise.K_CHUNK, None), (128, None), (rowwise.K_CHUNK, (64, 64, 64)),
                    (rowwise.K_CHUNK, (64, 16, 64)), (rowwise.K_CHUNK, (64, 32, 32)),
                    (rowwise.K_CHUNK, (64, 32, 128)), (256, None)]


def ops(T: int):
    """(name, the kernel whose warps vary, its own warps, a call) at T rows."""
    h, pre, w = rnd(T, H, D), torch.rand(T, H, device=dev), rnd(D, dtype=f32)
    x1280, w1280 = rnd(T, 1280), rnd(1280, dtype=f32)
    suh = {k: rnd(k, dtype=torch.float16).sign() for k in (1280, 2304, 5120)}
    xs = {k: rnd(T * (6 if k == 2304 else 1), k) for k in suh}
    fn, base = rnd(24, H * D, dtype=f32) * 0.01, rnd(24, dtype=f32)
    scale = torch.ones(3, device=dev)
    y, post, comb = rnd(T, D), torch.rand(T, H, device=dev), torch.rand(T, H, H, device=dev)
    g, v = rnd(6 * T, 2304, dtype=f32), rnd(6 * T, 2304, dtype=f32)
    pw = torch.rand(6 * T, device=dev)
    gate = rnd(384, D)
    # attention's products over a query's n = 640 key rows (window 128 + 512 compressed)
    q, rows = rnd(T, 64, 512), rnd(T, 640, 512)
    p = torch.softmax(torch.randn(T, 64, 640, device=dev), -1)
    s, sink = torch.randn(T, 64, 640, device=dev), torch.randn(64, device=dev)
    mask = torch.rand(T, 640, device=dev) > 0.1
    # the indexer's selection for T queries over n entries (its scores, then the top 512)
    sel = {n: (rnd(T, 32, 128, dtype=f32), rnd(n, 128), torch.rand(T, 32, device=dev),
               torch.full((T,), n, device=dev)) for n in (768, 32768, 131072)}
    scores = {n: torch.randn(T, n, device=dev) for n in (8192, 32768, 131072, 524288)}
    return [
        ("collapse_norm 4×5120", norm._rms_norm_kernel, 4,
         lambda: norm.collapse_rms_norm(h, pre, w, 1e-20)),
        ("rms_norm 1280", norm._rms_norm_kernel, 4, lambda: norm.rms_norm(x1280, w1280, 1e-20)),
        *[(f"rotate_in {k}{' ×6' if k == 2304 else ''}", exl3._rotate_in_kernel, 4,
           (lambda k=k: exl3.rotate_in(xs[k], suh[k], True))) for k in suh],
        ("hc_mix (mixed_coeffs)", mhc._hc_mix_kernel, 4,
         lambda: mhc.hc_mixed_coeffs(h, fn, scale, base, H, 1e-20, 1e-6, 20)),
        ("hc_coeffs (mixed_coeffs)", mhc._hc_coeffs_kernel, mhc.COEFF_WARPS,
         lambda: mhc.hc_mixed_coeffs(h, fn, scale, base, H, 1e-20, 1e-6, 20)),
        ("hc_update", mhc._hc_update_kernel, 4, lambda: mhc.hc_update(y, h, post, comb)),
        ("swiglu ×6", moe_ops._swiglu_kernel, 4, lambda: moe_ops.swiglu(g, v, 10.0, bf, pw)),
        ("router 5120→384", rowwise._rowwise_kernel, rowwise.TILE_WARPS,
         lambda: rowwise.rowwise_rows(y, gate, f32)),
        *[(f"q·k 64×512·640 k_chunk {kc} tile {tile}", rowwise._rowwise_kernel,
           rowwise.TILE_WARPS,
           (lambda kc=kc, tile=tile: rowwise.rowwise_bmm(q, rows, kc, f32, tile)))
          for kc, tile in PRODUCT_VARIANTS],
        *[(f"p·v 64×640·512 k_chunk {kc} tile {tile}", rowwise._rowwise_kernel,
           rowwise.TILE_WARPS,
           (lambda kc=kc, tile=tile: rowwise.rowwise_bmm(p, rows.transpose(1, 2), kc, None, tile)))
          for kc, tile in PRODUCT_VARIANTS],
        ("softmax + p·v 64×640·512", attention._softmax_pv_kernel, rowwise.TILE_WARPS,
         lambda: attention.sink_softmax_pv(s, mask, sink, 0.044, rows)),
        *[(f"index scores n={n}", indexer._index_scores_kernel, indexer.NUM_WARPS,
           (lambda n=n: indexer.index_scores(*sel[n], 0.0156))) for n in sel],
        *[(f"index scores + top 512 n={n}", ranking._top_picks_kernel, ranking.PICKS_WARPS,
           (lambda n=n: topk_lowest_index(indexer.index_scores(*sel[n], 0.0156), 512)))
          for n in sel],
        # the selection alone, a row in parts of `part` entries (2^30: one program a row);
        # the warps varied are the parts' count kernel's
        *[(f"top 512 n={n} part {part}", ranking._split_counts_kernel, ranking.PICKS_WARPS,
           parted(part, lambda n=n: topk_lowest_index(scores[n], 512)))
          for n in scores for part in (2048, 4096, 8192, 1 << 30)],
        # the torch ops the selection replaces (topk_lowest_index's CPU path), for scale
        *[(f"top 512 n={n} torch ops", ranking._split_counts_kernel, ranking.PICKS_WARPS,
           torch_ops(lambda n=n: topk_lowest_index(scores[n], 512))) for n in scores],
    ]


def torch_ops(call):
    """call with the selection's kernels unavailable (topk_lowest_index's torch path)."""
    def run():
        own = ranking.available
        ranking.available = lambda t: False
        try:
            return call()
        finally:
            ranking.available = own
    return run


def parted(part: int, call):
    """call with ranking.PICKS_PART = part (the row's split chosen inside the call)."""
    def run():
        own = ranking.PICKS_PART
        ranking.PICKS_PART = part
        try:
            return call()
        finally:
            ranking.PICKS_PART = own
    return run


def timed(call) -> float:
    return replay_us([call] * CALLS, REPLAYS)


# KNOB=num_stages: sweep that launch option instead (the code's own value then unmarked), or
# any launch keyword of the kernel — a constexpr too — with VALUES, e.g. KNOB=BLOCK
# VALUES="1024 2048 4096" ONLY="part 4096" (the selection's count passes' block)
KNOB = os.environ.get("KNOB", "num_warps")
VALUES = tuple(int(v) for v in os.environ.get(
    "VALUES", "1 2 3 4" if KNOB == "num_stages" else "1 2 4 8 16").split())


def with_knob(kernel, value: int):
    run = kernel.run

    def patched(*args, **kwargs):
        return run(*args, **{**kwargs, KNOB: value})
    return run, patched


print(f"µs a call by {KNOB}, graph of {CALLS} calls × {REPLAYS} replays; * the code's warps")
for T in (1, 6):
    for name, kernel, own, call in ops(T):
        if os.environ.get("ONLY", "") not in name:  # ONLY=text: the ops whose name has it
            continue
        row = []
        for value in VALUES:
            run, kernel.run = with_knob(kernel, value)
            mark = "*" if KNOB == "num_warps" and value == own else ""
            try:
                row.append(f"{value}{mark}: {timed(call):6.2f}")
            except Exception as e:  # (a value the kernel's layout cannot take)
                row.append(f"{value}: {type(e).__name__}")
            finally:
                kernel.run = run
        print(f"T={T} {name:26s} " + "  ".join(row), flush=True)
