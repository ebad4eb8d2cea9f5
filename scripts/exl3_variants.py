"""Where an EXL3 decode linear's time goes, and A/B of the fused kernel's switches (GPU).

For each variant (a set of strata.kernels.exl3 module switches: FUSED_MAX_REGISTERS (0: none),
PDL, TARGET_PROGRAMS, GROUPED_TARGET_PROGRAMS (the MoE cases' schedule); MMA =
strata.kernels.exl3_mma.ENABLED) and each V4.1 shape at 1 and 6 rows, times under CUDA-graph replay
(strata.bench.kernels.Timer: L2 flushed, median): rotate_in alone, the split partials alone
(the fused kernel without its output step), rotate_out of those partials alone, and the whole
linear (rotate_in + fused kernel finishing its blocks), plus the grouped MoE gate + up and down
for 1 and 6 tokens (as the model runs them: on the experts' split schedule). Every variant's
linear and MoE outputs are compared bit for bit with the first variant's (a switch that only
changes scheduling must keep every bit; the targets change the summation order, so that is
reported, not required).

    python scripts/exl3_variants.py --json OUT.json [--variants "a:;b:FUSED_MAX_REGISTERS=0"]

Session 11's run (bench/results/kernels.md) compared this with variants since folded into the
kernel (the next k-step's words loaded while one decodes) or dropped (num_stages 2).
"""
from __future__ import annotations

import argparse
import json

import torch

import strata.kernels.exl3 as X
from strata.kernels import exl3_mma
from strata.bench.kernels import SHAPES, Timer, random_linear

DEFAULT_VARIANTS = "default:;triton:MMA=0;uncapped:MMA=0,FUSED_MAX_REGISTERS=0"
CHAIN = 16


def _variants(spec: str) -> list[tuple[str, dict]]:
    out = []
    for part in spec.split(";"):
        name, _, sets = part.partition(":")
        kv = {}
        for item in filter(None, sets.split(",")):
            k, _, v = item.partition("=")
            kv[k.strip()] = int(v)
        out.append((name.strip(), kv))
    return out


def _switch(key: str) -> tuple:
    """(module, attribute) of a variant's switch: MMA = exl3_mma.ENABLED,
    anything else strata.kernels.exl3's."""
    return {"MMA": (exl3_mma, "ENABLED")}.get(key, (X, key))


def chain_us(timer, fns) -> float:
    """Per-call time of fns run back to back in one CUDA graph (distinct weights, L2 flushed
    before the replay): what a graphed decode step pays per linear, without the replay's own
    start-up, which a single-launch graph's time includes."""
    return timer(lambda: [f() for f in fns]) / len(fns)


def fused_resources() -> list[str]:
    """Registers / spills / shared memory of each compiled fused-kernel variant, with its main
    constexprs (Triton's per-device kernel cache; its layout is version specific: best effort)."""
    out = []
    want = ("K2", "GROUPED", "FUSE_OUT", "SPLIT_LOOP", "PDL")
    try:
        names = X._fused_kernel.arg_names
        for cache in X._fused_kernel.device_caches.values():
            for k in cache[0].values():
                consts = {}
                for key, v in getattr(k.src, "constants", {}).items():
                    idx = key[0] if isinstance(key, tuple) else key
                    name = names[idx] if isinstance(idx, int) else str(idx)
                    if name in want:
                        consts[name] = v
                out.append(f"regs {k.n_regs} spills {k.n_spills} shared {k.metadata.shared} "
                           f"stages {k.metadata.num_stages} {consts}")
    except Exception as e:
        out.append(f"(kernel cache not readable: {type(e).__name__}: {e})")
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--shapes", default="expert_w13,expert_w2,wq_b,wo_b")
    p.add_argument("--K", type=float, default=2.5)
    p.add_argument("--rows", default="1,6")
    p.add_argument("--rep", type=int, default=50)
    p.add_argument("--linear-only", action="store_true",
                   help="time the whole linear only (not rotate_in / partials / rotate_out)")
    p.add_argument("--json", required=True)
    a = p.parse_args()
    dev = torch.device("cuda")
    timer = Timer(dev, 25, a.rep, smoke=False)
    rows = [int(r) for r in a.rows.split(",")]
    variants = _variants(a.variants)
    defaults = {k: getattr(*_switch(k)) for _, kv in variants for k in kv}
    results, ref = [], {}
    cases, chains = [], {}
    for i, name in enumerate(a.shapes.split(",")):
        k, n = SHAPES[name]
        tr, suh, svh = random_linear(k, n, a.K, dev, 100 + i)
        # CHAIN distinct trellises (more bytes than L2 holds for every shape) for chain timing
        chains[name] = [tr] + [torch.randint_like(tr, -2**15, 2**15) for _ in range(CHAIN - 1)]
        for M in rows:
            x = torch.randn(M, k, generator=torch.Generator().manual_seed(M)).to(dev,
                                                                               torch.bfloat16)
            cases.append((name, M, tr, suh, svh, x))
    E = 32  # MoE: stacks of 32 experts (one random expert repeated), 6 slots a token

    def stack(shape, seed):
        tr, suh, svh = random_linear(*SHAPES[shape], a.K, dev, seed)
        return tuple(t.unsqueeze(0).repeat(E, *[1] * t.dim()).contiguous()
                     for t in (tr, suh, svh))
    moe_sets = {"gate+up": [stack("expert_w13", 50), stack("expert_w13", 51)],
                "down": [stack("expert_w2", 52)]}
    moe_cases = []
    for T in (1, 6):
        g = torch.Generator().manual_seed(T)
        idx = torch.stack([torch.randperm(E, generator=g)[:6] for _ in range(T)]).to(dev)
        x = torch.randn(T, SHAPES["expert_w13"][0], generator=g).to(dev, torch.bfloat16)
        moe_cases.append(("gate+up", T, idx, x))
        x = torch.randn(T, 6, SHAPES["expert_w2"][0], generator=g).to(dev, torch.bfloat16)
        moe_cases.append(("down", T, idx, x))
    for vname, kv in variants:
        for key, val in defaults.items():
            setattr(*_switch(key), kv.get(key, val))
        for name, M, tr, suh, svh, x in cases:
            xr = X.rotate_in(x, suh)
            part = X.exl3_partials(xr, tr, "mul1", path="fused")
            y = X.exl3_linear(x, tr, suh, svh, "mul1", path="fused")
            nan = float("nan")
            steps = not a.linear_only
            r = {"variant": vname, "switches": kv, "shape": name, "rows": M,
                 "splits": part.shape[0],
                 "rotate_in_us": timer(lambda: X.rotate_in(x, suh)) if steps else nan,
                 "partials_us": timer(lambda: X.exl3_partials(xr, tr, "mul1", path="fused"))
                 if steps else nan,
                 "rotate_out_us": timer(lambda: X.rotate_out(part, svh)) if steps else nan,
                 "linear_us": timer(lambda: X.exl3_linear(x, tr, suh, svh, "mul1",
                                                          path="fused")),
                 "chain_partials_us": chain_us(timer, [
                     (lambda t=t: X.exl3_partials(xr, t, "mul1", path="fused"))
                     for t in chains[name]]) if steps else nan,
                 "chain_linear_us": chain_us(timer, [
                     (lambda t=t: X.exl3_linear(x, t, suh, svh, "mul1", path="fused"))
                     for t in chains[name]])}
            key = (name, M)
            ref.setdefault(key, y)
            r["bits_equal_first"] = bool(torch.equal(ref[key], y))
            r["max_rel_diff_first"] = float((ref[key] - y).abs().max() / ref[key].abs().max())
            results.append(r)
            print(f"{vname:10s} {name:11s} rows {M}: rotate_in {r['rotate_in_us']:6.1f}  "
                  f"partials {r['partials_us']:6.1f}  rotate_out {r['rotate_out_us']:6.1f}  "
                  f"linear {r['linear_us']:6.1f} µs; in a chain of {CHAIN}: partials "
                  f"{r['chain_partials_us']:5.1f}, linear {r['chain_linear_us']:5.1f} µs "
                  f"(S {r['splits']}, bits = first: {r['bits_equal_first']}, max rel diff "
                  f"{r['max_rel_diff_first']:.1e})", flush=True)
        for part, T, idx, x in moe_cases:
            def call():
                return X.exl3_moe_linear(x, idx, moe_sets[part], "mul1",
                                         target_programs=X.GROUPED_TARGET_PROGRAMS)
            ys = call()
            us = timer(call)
            key = (part, T)
            ref.setdefault(key, ys[0])
            same = bool(torch.equal(ref[key], ys[0]))
            results.append({"variant": vname, "switches": kv, "shape": f"moe_{part}",
                            "rows": T, "linear_us": us, "bits_equal_first": same})
            print(f"{vname:10s} moe {part:7s} tokens {T}: {us:6.1f} µs (bits = first: {same})",
                  flush=True)
    for line in fused_resources():  # every variant's compiled kernels
        print(f"fused kernel: {line}", flush=True)
    with open(a.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(dev), "K": a.K, "results": results},
                  f, indent=1)


if __name__ == "__main__":
    main()
