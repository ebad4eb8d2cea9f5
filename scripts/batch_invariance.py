"""Find where a forward stops being batch-invariant on a device.

Runs the tiny fixture once as a single prefill and once token by token, records the output of
each model piece, and prints the first pieces whose rows differ; then probes the torch
primitives the model uses (per-row products, per-query attention, softmax, norms) for rows that
change with the number of rows in the call.

  python scripts/batch_invariance.py [--device cuda] [--numerics reference] [--dtype float32]
"""
from __future__ import annotations

import argparse
import tempfile

import strata  # noqa: F401

import torch

import strata.model.attention as A
import strata.model.block as B
import strata.model.engram as E
import strata.model.mhc as H
import strata.model.moe as M
from strata.checkpoint.tiny import make_tiny
from strata.model.model import Model
from strata.model.numerics import Numerics, rms_norm, row_matmul


def probe_model(device: torch.device, nx: Numerics, n: int) -> None:
    rec: list[tuple[str, torch.Tensor]] = []

    def wrap(owner, name, label):
        f = getattr(owner, name)

        def g(*a, **k):
            out = f(*a, **k)
            o = out[0] if isinstance(out, tuple) else out
            rec.append((label, o.detach().float().clone()))
            return out
        setattr(owner, name, g)

    wrap(H, "hc_mixes", "hc_mixes")
    B.hc_mixes = H.hc_mixes
    for owner, name in ((A.Attention, "project_q"), (A.Attention, "project_kv"),
                        (A.Attention, "forward"), (M.MoE, "route"), (M.ExpertStack, "forward"),
                        (M.SharedExpert, "forward"), (E.Engram, "forward")):
        wrap(owner, name, f"{owner.__name__}.{name}")
    with tempfile.TemporaryDirectory() as d:
        model = Model.load(make_tiny(d, "tiny", 0), device, nx)
        tokens = torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(1)).to(device)
        rec.clear()
        model.forward(tokens, model.new_state(n))
        full = list(rec)
        state = model.new_state(n)
        steps = []
        for i in range(n):
            rec.clear()
            model.forward(tokens[i:i + 1], state)
            steps.append(list(rec))
    shown = 0
    for j, (label, o) in enumerate(full):
        d = torch.cat([s[j][1] for s in steps])
        if not torch.equal(d, o):
            print(f"  piece {j:3d} {label:28s} max |diff| {(d - o).abs().max().item():.3e}")
            shown += 1
            if shown >= 8:
                break
    if not shown:
        print("  every recorded piece is bit-identical")


def probe_primitives(device: torch.device, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)

    def rnd(*s):
        return torch.randn(*s, generator=g).to(device, dtype)

    T = 37

    def check(label, fn):
        """fn(lo, hi) computes rows lo..hi-1 of some per-row operation."""
        full = fn(0, T)
        parts = torch.cat([fn(i, i + 1) for i in range(T)])
        same = torch.equal(full, parts)
        print(f"  {label:40s} {'invariant' if same else 'VARIES'}"
              + ("" if same else f" (max |diff| {(full - parts).abs().max().item():.3e})"))

    w, x = rnd(640, 1536), rnd(T, 1536)
    check("row_matmul [T,1536]x[1536,640]", lambda a, b: row_matmul(x[a:b], w))
    check("plain matmul x @ w.T", lambda a, b: x[a:b] @ w.T)
    q, rows = rnd(T, 4, 64), rnd(T, 144, 64)
    check("bmm q[T,4,64] x rows[T,64,144]", lambda a, b: torch.bmm(q[a:b], rows[a:b].transpose(1, 2)))
    s = rnd(T, 4, 145)
    check("softmax [T,4,145]", lambda a, b: torch.softmax(s[a:b], -1))
    check("rms_norm [T,128]", lambda a, b: rms_norm(x[a:b, :128], None, 1e-20))
    check("sqrt(softplus) [T,8]", lambda a, b: torch.sqrt(torch.nn.functional.softplus(x[a:b, :8])))
    we = rnd(T, 64, 128)
    check("gathered bmm [n,1,128]x[n,128,64]",
          lambda a, b: torch.bmm(x[a:b, None, :128], we[a:b].transpose(1, 2))[:, 0])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--numerics", default="reference")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", type=int, default=24)
    a = p.parse_args()
    dev = torch.device(a.device)
    nx = Numerics.for_device(dev, a.numerics, a.dtype)
    print(f"{dev} {a.numerics} {a.dtype}: primitives")
    probe_primitives(dev, nx.act_dtype)
    print("model pieces, prefill vs decode:")
    probe_model(dev, nx, a.tokens)


if __name__ == "__main__":
    main()
