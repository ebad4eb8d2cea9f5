"""GPU suite for the EXL3 kernels (pytest -m gpu tests/gpu/test_kernels_exl3_gpu.py): the CPU
checks of tests/test_kernels_exl3.py, compiled, at the V4.1 shapes, plus the end-to-end
decode == chunks == prefill ladder of the tiny EXL3 fixture through the kernels.

Exact: Ŵ vs decode_trellis (every codebook, K = 1..8 and 1.5/2.5/3.5); fused == reconstruct +
GEMM; rows alone == rows in M = 8 / 37 / 100 / 300; MoE pairs == single linear per pair; every
kernel lowers tl.dot to wgmma on the H200; the ladder.
Tolerance: the linear vs the CPU reference forward (2e-3 of the output's max).
These fail (not skip) without CUDA.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.gpu.conftest import record

from strata.kernels import exl3 as X
from strata.quant.exl3 import Exl3Linear, decode_trellis

pytestmark = pytest.mark.gpu

SHAPES = {"expert_w13": (5120, 2304), "expert_w2": (2304, 5120), "wq_b": (1280, 32768),
          "wo_b": (8192, 5120)}
ALL_K = [(K, cb) for K in (1, 2, 3, 4, 5, 6, 7, 8) for cb in ("3inst", "mcg", "mul1")] + [
    (1.5, "mul1"), (2.5, "mul1"), (3.5, "mul1")]




def trellis_of(k, n, K, seed, device, E=None):
    L = int(16 * K) if K == int(K) else int(16 * (K - 0.5)) + 8
    g = torch.Generator().manual_seed(seed)
    shape = (k // 16, n // 16, L) if E is None else (E, k // 16, n // 16, L)
    return torch.randint(-2**15, 2**15, shape, generator=g, dtype=torch.int32).to(
        torch.int16).to(device)


def scales(n, seed, device, E=None, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn((n,) if E is None else (E, n), generator=g) * scale).half().to(device)


def i16(t):
    return t.view(torch.int16) if t.dtype in (torch.float16, torch.bfloat16) else t.view(torch.int32)


def captured(fn):
    """fn captured in a CUDA graph after a warm-up call on a side stream, as the decode step is
    captured: (the graph, the outputs its replays write)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fn()
    return graph, static


def assert_replays_equal(fn, eager, what=None) -> None:
    """fn captured in a CUDA graph (`captured`) and replayed three times: each replay's outputs
    equal `eager`, bit for bit."""
    graph, static = captured(fn)
    as_list = lambda t: list(t) if isinstance(t, (list, tuple)) else [t]
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(as_list(static), as_list(eager))), what


def decode_case(device, seed: int, E: int = 8, T: int = 6, k: int = 6):
    """A decode step's EXL3 work at the experts' gate/up shape (5120 → 2304, K 2.5): a dense
    linear (trellis, suh, svh), two expert weight sets of E experts, the routing ids [T, k]
    and T bf16 rows."""
    tr = trellis_of(5120, 2304, 2.5, seed=seed, device=device)
    suh = scales(5120, seed + 1, device, scale=5120 ** -0.5)
    svh = scales(2304, seed + 2, device, scale=0.05)
    sets = [(trellis_of(5120, 2304, 2.5, seed=seed + 3 + w, device=device, E=E),
             scales(5120, seed + 5 + w, device, E, 5120 ** -0.5),
             scales(2304, seed + 7 + w, device, E, 0.05)) for w in range(2)]
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(device)
    x = torch.randn(T, 5120, generator=g).to(device, torch.bfloat16)
    return (tr, suh, svh), sets, idx, x


@pytest.mark.parametrize("K,codebook", ALL_K)
def test_reconstruct_bit_exact(cuda, K, codebook):
    """5120×2304: first and last 16 tile rows against the torch decoder (CPU)."""
    tr = trellis_of(5120, 2304, K, seed=int(K * 10), device=cuda)
    w = X.reconstruct(tr, codebook)
    for sl in (slice(0, 16), slice(tr.shape[0] - 16, tr.shape[0])):
        ref = decode_trellis(tr[sl].cpu(), codebook)
        got = w[16 * sl.start:16 * sl.stop].cpu()
        assert torch.equal(i16(got), i16(ref)), (K, codebook, sl)


def test_reconstruct_whole_matrix_and_head_slices(cuda):
    tr = trellis_of(2304, 5120, 2.5, seed=1, device=cuda)
    assert torch.equal(i16(X.reconstruct(tr, "mul1").cpu()), i16(decode_trellis(tr.cpu(), "mul1")))
    head = trellis_of(5120, 129280, 4, seed=2, device=cuda)
    for n0 in (0, 64 * 1000, 129280 - 128):
        got = X.reconstruct(head, "mcg", n_start=n0, n_cols=128)
        ref = decode_trellis(head[:, n0 // 16:n0 // 16 + 8].cpu(), "mcg")
        assert torch.equal(i16(got.cpu()), i16(ref))


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("K", [2, 2.5, 3, 4])
def test_fused_equals_gemm_and_product(cuda, name, K):
    k, n = SHAPES[name]
    cb = "mul1" if K != int(K) else ("mcg" if K == 3 else "3inst" if K == 4 else "mul1")
    tr = trellis_of(k, n, K, seed=3, device=cuda)
    w = X.reconstruct(tr, cb).double()
    g = torch.Generator().manual_seed(4)
    for M in (1, 6, 37, 300):
        xr = torch.randn(M, k, generator=g).half().to(cuda)
        fused = X.exl3_matmul(xr, tr, cb, "fused")
        gemm = X.exl3_matmul(xr, tr, cb, "gemm")
        assert torch.equal(i16(fused), i16(gemm)), (name, K, M)
        ref = xr.double() @ w
        bound = (xr.double().abs() @ w.abs()) * (k * 2.0 ** -22)  # fp32 sums of k terms
        excess = float(((fused.double() - ref).abs() - bound).max())
        record(test="exl3_fused_gemm", shape=name, K=K, M=M, bit_identical=True,
               max_excess_over_bound=excess)
        assert excess <= 0, (name, K, M, excess)


def test_rows_are_batch_invariant(cuda):
    """A row alone == inside M = 8, 37 and 100 (fused: one and two row tiles) and 300
    (reconstruct + GEMM), auto path."""
    tr = trellis_of(5120, 2304, 2.5, seed=5, device=cuda)
    g = torch.Generator().manual_seed(6)
    rows = torch.randn(300, 5120, generator=g).half().to(cuda)
    alone = {i: X.exl3_matmul(rows[i:i + 1], tr, "mul1")[0] for i in (0, 5, 36, 99, 299)}
    for M in (8, 37, 100, 300):
        full = X.exl3_matmul(rows[:M], tr, "mul1")
        for i, a in alone.items():
            if i < M:
                assert torch.equal(i16(a), i16(full[i])), (M, i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_cpu_reference(cuda, dtype):
    """Exl3Linear on CUDA (kernels, through __call__ as the model calls it) vs its torch
    reference forward on CPU: padded dims, bias, out dtype."""
    from strata.model.numerics import Numerics
    k, n = 2304, 5120
    tr = trellis_of(k, n, 3, seed=7, device="cpu")
    suh, svh = scales(k, 8, "cpu", scale=k ** -0.5), scales(n, 9, "cpu", scale=0.05)
    bias = scales(5000, 10, "cpu", scale=0.1)
    cpu = Exl3Linear(tr, suh, svh, "mcg", 5000, 2300, bias)
    gpu = Exl3Linear(tr.to(cuda), suh.to(cuda), svh.to(cuda), "mcg", 5000, 2300, bias.to(cuda))
    x = torch.randn(4, 2300, generator=torch.Generator().manual_seed(11)).to(dtype).float()
    ref = cpu.forward(x, Numerics())  # the same (bf16-rounded) input as the GPU gets
    got = gpu(x.to(cuda, dtype), Numerics(act_dtype=dtype), torch.float32).cpu()
    rel = float((got - ref).abs().max() / ref.abs().max())
    record(test="exl3_linear_vs_cpu", dtype=str(dtype), max_rel=rel)
    assert got.shape == (4, 5000) and rel < 2e-3, rel
    one = gpu(x[2:3].to(cuda, dtype), Numerics(act_dtype=dtype), torch.float32).cpu()
    assert torch.equal(one[0], got[2])


def test_moe_grouped_equals_single_linear(cuda):
    """Gate + up in one grouped launch (E = 8 experts 5120 → 2304, K = 2.5 mul1) for T = 5
    tokens × 6 slots; then the down form (one input per pair, 2304 → 5120)."""
    E, T, k = 8, 5, 6
    sets = [(trellis_of(5120, 2304, 2.5, seed=20 + w, device=cuda, E=E),
             scales(5120, 30 + w, cuda, E, 5120 ** -0.5), scales(2304, 40 + w, cuda, E, 0.05))
            for w in range(2)]
    g = torch.Generator().manual_seed(12)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(cuda)
    x = torch.randn(T, 5120, generator=g).to(cuda, torch.bfloat16)
    gate, up = X.exl3_moe_linear(x, idx, sets, "mul1")
    for t in range(T):
        for s in range(k):
            e = int(idx[t, s])
            for (tr, suh, svh), out in zip(sets, (gate, up)):
                ref = X.exl3_linear(x[t:t + 1], tr[e], suh[e], svh[e], "mul1")
                assert torch.equal(ref[0], out[t, s]), (t, s)
    g3, u3 = X.exl3_moe_linear(x[3:4], idx[3:4], sets, "mul1")
    assert torch.equal(g3[0], gate[3]) and torch.equal(u3[0], up[3])
    down = (trellis_of(2304, 5120, 2.5, seed=50, device=cuda, E=E),
            scales(2304, 51, cuda, E, 2304 ** -0.5), scales(5120, 52, cuda, E, 0.05))
    a = torch.randn(T, k, 2304, generator=g).to(cuda, torch.bfloat16)
    (y,) = X.exl3_moe_linear(a, idx, [down], "mul1")
    for t, s in ((0, 0), (2, 5), (4, 3)):
        e = int(idx[t, s])
        ref = X.exl3_linear(a[t, s:s + 1], down[0][e], down[1][e], down[2][e], "mul1")
        assert torch.equal(ref[0], y[t, s])


def test_moe_on_the_experts_split_schedule_equals_single_linear(cuda):
    """The routed experts' schedule (GROUPED_TARGET_PROGRAMS 64: 2 splits for 5120 → 2304, 1
    for 2304 → 5120, against 14 and 6) on every kernel that serves them — a decode step (5
    tokens, the CUDA decode kernel on Hopper) and a prefill-sized step (40 tokens: the CUDA
    prefill kernel on Hopper) — gives each pair its lone linear's bits under the same
    target."""
    E, k = 8, 6
    target = X.GROUPED_TARGET_PROGRAMS
    assert X.split_schedule(5120, 2304, target)[1] < X.split_schedule(5120, 2304)[1]
    up = (trellis_of(5120, 2304, 2.5, seed=70, device=cuda, E=E),
          scales(5120, 71, cuda, E, 5120 ** -0.5), scales(2304, 72, cuda, E, 0.05))
    down = (trellis_of(2304, 5120, 3, seed=73, device=cuda, E=E),
            scales(2304, 74, cuda, E, 2304 ** -0.5), scales(5120, 75, cuda, E, 0.05))
    g = torch.Generator().manual_seed(14)
    cases = []
    for T in (5, 40):
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(cuda)
        x = torch.randn(T, 5120, generator=g).to(cuda, torch.bfloat16)
        a = torch.randn(T, k, 2304, generator=g).to(cuda, torch.bfloat16)
        (y_up,) = X.exl3_moe_linear(x, idx, [up], "mul1", target_programs=target)
        (y_down,) = X.exl3_moe_linear(a, idx, [down], "mul1", target_programs=target)
        cases.append((T, idx, x, a, y_up, y_down))
    for T, idx, x, a, y_up, y_down in cases:
        for t, s in ((0, 0), (T // 2, 3), (T - 1, 5)):
            e = int(idx[t, s])
            ref = X.exl3_linear(x[t:t + 1], up[0][e], up[1][e], up[2][e], "mul1",
                                target_programs=target)
            assert torch.equal(ref[0], y_up[t, s]), (T, t, s)
            ref = X.exl3_linear(a[t, s:s + 1], down[0][e], down[1][e], down[2][e], "mul1",
                                target_programs=target)
            assert torch.equal(ref[0], y_down[t, s]), (T, t, s)


@pytest.mark.parametrize("tile", [64, 128])
def test_moe_prefill_step_equals_single_linear(cuda, monkeypatch, tile):
    """A prefill-sized MoE step (40 tokens × 6 slots = 240 pairs: programs loop over the K
    splits, several pairs per expert tile of 64 or 128) on the Triton kernel gives each pair
    the single linear's bits. (On Hopper the CUDA prefill kernel takes such steps:
    test_the_prefill_kernel_gives_the_triton_split_loops_bits compares it with this path.)"""
    from strata.kernels import exl3_mma
    monkeypatch.setattr(exl3_mma, "ENABLED", False)
    monkeypatch.setattr(X, "MOE_LOOP_BLOCK_M", tile)
    E, T, k = 8, 40, 6
    assert T * k > X.MOE_SPLIT_LOOP_PAIRS
    w = (trellis_of(5120, 2304, 3, seed=60, device=cuda, E=E),
         scales(5120, 61, cuda, E, 5120 ** -0.5), scales(2304, 62, cuda, E, 0.05))
    g = torch.Generator().manual_seed(13)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(cuda)
    x = torch.randn(T, 5120, generator=g).to(cuda, torch.bfloat16)
    (y,) = X.exl3_moe_linear(x, idx, [w], "mul1")
    for t, s in ((0, 0), (17, 3), (39, 5)):
        e = int(idx[t, s])
        ref = X.exl3_linear(x[t:t + 1], w[0][e], w[1][e], w[2][e], "mul1")
        assert torch.equal(ref[0], y[t, s]), (t, s)


def test_every_kernel_lowers_dot_to_wgmma_on_hopper(cuda, monkeypatch):
    """The exactness rule's premise on this GPU: the fused, GEMM and grouped kernels all run
    wgmma (mma.sync with the decode's kWidth 4 would round differently; module doc)."""
    from strata.kernels import exl3_mma
    monkeypatch.setattr(exl3_mma, "ENABLED", False)  # (the grouped call: Triton's, not CUDA's)
    tr = trellis_of(1024, 512, 2, seed=70, device=cuda)
    xr = torch.randn(300, 1024, device=cuda).half()
    X.exl3_matmul(xr[:3], tr, "mul1", "fused")
    X.exl3_matmul(xr, tr, "mul1", "gemm")
    stack = (tr.unsqueeze(0).repeat(2, 1, 1, 1), scales(1024, 71, cuda, 2), scales(512, 72, cuda, 2))
    X.exl3_moe_linear(xr[:2].bfloat16(), torch.tensor([[0, 1], [1, 0]], device=cuda), [stack], "mul1")
    names = {name for name, _ in X._CHECKED}
    assert {"exl3 fused kernel", "exl3 gemm kernel", "exl3 grouped kernel"} <= names
    cap = torch.cuda.get_device_capability(cuda)
    assert cap[0] == 9, f"this check is for Hopper (sm_90), got {cap}"
    assert X._DOT_ORDER[cap][0] == "wgmma"


def test_the_cuda_kernels_probe_agrees_on_this_gpu(cuda):
    """exl3._probe_reason, which elsewhere than Hopper decides whether the CUDA kernel may run
    (exl3.cuda_order_reason), on a real GPU: its probe linear of 1 and 6 rows gives the Triton
    fused kernel's bits on the CUDA kernel."""
    assert X._probe_reason(torch.cuda.current_device()) is None


_NO_WGMMA = """
import json, torch
from strata.kernels import exl3 as X
from strata.kernels import exl3_mma
dev = torch.device("cuda", 0)
g = torch.Generator().manual_seed(90)
tr = torch.randint(-2**15, 2**15, (64, 32, 40), generator=g, dtype=torch.int32)
tr = tr.to(torch.int16).to(dev)
suh = (torch.randn(1024, generator=g) / 32).half().to(dev)
svh = (torch.randn(512, generator=g) / 20).half().to(dev)
x = torch.randn(300, 1024, generator=g).to(dev, torch.bfloat16)
rows = [X.exl3_linear(x[:m], tr, suh, svh, "mul1") for m in (1, 6)]  # fused: CUDA or Triton
every = X.exl3_linear(x, tr, suh, svh, "mul1")                       # reconstruct + GEMM
same = all(torch.equal(r, every[:r.shape[0]]) for r in rows)
print(json.dumps({"dot_order": X.dot_order(torch.cuda.get_device_capability(0)),
                  "cuda_kernel": X.cuda_order_reason(0), "same_bits": same,
                  "lowerings": sorted({X._DOT_ORDER[c][0] for c in X._DOT_ORDER})}))
"""


def test_without_wgmma_every_exl3_path_gives_one_set_of_bits(cuda):
    """What a GPU without wgmma runs (an RTX PRO 6000, an RTX 4090), on this one: Triton told
    not to use wgmma (DISABLE_MMA_V3=1, a process of its own) lowers every EXL3 kernel to
    mma.sync, the GEMM joins Ŵ like the decode, and the CUDA kernel runs only where the
    lowering is its order (kWidth 2) and the probe agrees. A decode-sized call's rows (fused:
    CUDA or Triton) equal the same rows of a 300-row call (reconstruct + GEMM), bit for bit."""
    import subprocess
    import sys
    env = {**os.environ, "DISABLE_MMA_V3": "1"}
    out = subprocess.run([sys.executable, "-c", _NO_WGMMA], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    record(test="exl3_without_wgmma", **got)
    assert got["dot_order"].startswith("mma.sync") and got["lowerings"] == [got["dot_order"]]
    assert (got["cuda_kernel"] is None) == (got["dot_order"] == "mma.sync kWidth 2"), got
    assert got["same_bits"], got


@pytest.mark.parametrize("mode", ["reference", "vendor"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exl3_fixture_ladder_through_kernels(cuda, tmp_path_factory, mode, dtype):
    """The tiny EXL3 fixture on CUDA (every EXL3 linear but the routed experts through the
    kernels): prefill == chunks of 1, 7, 129 bit for bit."""
    from strata.checkpoint.tiny import make_tiny
    from strata.model.model import Model
    from strata.model.numerics import Numerics
    from util import random_tokens
    d = make_tiny(tmp_path_factory.mktemp("exl3gpu"), "tiny", seed=0, fmt="exl3")
    model = Model.load(d, cuda, Numerics.for_device(cuda, mode, dtype))
    tokens = random_tokens(300, seed=1).to(cuda)

    def chunks(size):
        state = model.new_state(1024)
        return torch.cat([model.forward(tokens[i:i + size], state)[0]
                          for i in range(0, tokens.numel(), size)])

    full = chunks(300)
    for size in (1, 7, 129):
        got = chunks(size)
        d_ = float((got - full).abs().max() / full.abs().max())
        record(test="exl3_ladder", mode=mode, dtype=dtype, chunk=size, max_rel_diff=d_)
        assert d_ == 0.0, (size, d_)


def test_bench_kernels_harness(cuda, tmp_path):
    """One shape through the benchmark (exllamav3 compared when it imports)."""
    from strata.bench.kernels import main
    out = tmp_path / "k.json"
    assert main(["--shapes", "expert_w13", "--ks", "2.5", "--rows", "1,6", "--rep", "20",
                 "--warmup", "5", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    record(test="exl3_bench_smoke", rows=res["rows"], peer=res["meta"]["peer"])
    assert res["checks"]["reconstruct_bit_exact"]
    assert {r["rows"] for r in res["rows"]} == {1, 6}


def test_wo_a_groups_as_one_launch_equal_each_groups_linear(cuda):
    """V4.1's wo_a (8 groups of 4096 → 1024, K = 4) through LinearGroups: a decode step's and
    a verify window's grouped launch give each group's own linear bit for bit — both on the
    grouped launch's split schedule (4 splits, a lone linear's 32)."""
    import strata.quant.exl3 as qexl3
    from strata.model.numerics import Numerics
    from strata.quant.groups import LinearGroups
    G, k, n, nx = 8, 4096, 1024, Numerics("vendor", torch.bfloat16)
    lins = [Exl3Linear(trellis_of(k, n, 4, 300 + g, cuda), scales(k, 400 + g, cuda, scale=0.05),
                       scales(n, 500 + g, cuda), "3inst", n, k) for g in range(G)]
    x = torch.randn(6, G, k, generator=torch.Generator().manual_seed(7)).to(cuda, torch.bfloat16)
    assert qexl3._use_kernels(x)
    groups = LinearGroups(lins)
    assert X.split_schedule(k, n, lins[0].target_programs)[1] == 4 < X.split_schedule(k, n)[1]
    want = torch.cat([lin(x[:, g], nx, act_quant=False) for g, lin in enumerate(lins)], dim=1)
    for T in (1, 6):
        assert torch.equal(i16(groups(x[:T], nx)), i16(want[:T]))
    assert groups._stack


def test_wo_a_rotates_attentions_output_back_in_its_input_rotation(cuda):
    """V4.1's wo_a with the attention output's inverse RoPE inside its input rotation
    (InverseRope): a decode step's, a verify window's and a prefill chunk's rows give the bits
    of the RoPE kernel's rotation, cast to bf16, through the same groups."""
    from strata.model.numerics import Numerics
    from strata.model.rope import InverseRope, apply_rope
    from strata.quant.groups import LinearGroups
    G, k, n, hd, rd2 = 8, 4096, 1024, 512, 32
    nx = Numerics("vendor", torch.bfloat16)
    lins = [Exl3Linear(trellis_of(k, n, 4, 600 + g, cuda), scales(k, 700 + g, cuda, scale=0.05),
                       scales(n, 800 + g, cuda), "3inst", n, k) for g in range(G)]
    groups = LinearGroups(lins)
    gen = torch.Generator().manual_seed(9)
    for T in (1, 6, 300):
        o = torch.randn(T, G * k // hd, hd, generator=gen).to(cuda)
        ang = (torch.arange(T, dtype=torch.float64)[:, None] * 1000
               * 0.8 ** torch.arange(rd2)[None, :])
        cos, sin = torch.cos(ang).float().to(cuda), torch.sin(ang).float().to(cuda)
        flat = apply_rope(o, cos, sin, inverse=True, out_dtype=torch.bfloat16)
        want = groups(flat.view(T, G, k), nx)
        got = groups(o.view(T, G, k), nx, InverseRope(cos, sin, hd, torch.bfloat16))
        assert torch.equal(i16(got), i16(want)), T


def test_the_early_launch_gives_plain_orders_bits_eager_and_graphed(cuda, monkeypatch):
    """The fused kernel launched early after its rotate_in (programmatic dependent launch,
    X.PDL) against plain stream order: a dense linear at 1 and 6 rows and the grouped MoE
    gate + up, eager and replayed from a CUDA graph (the decode step's form), bit for bit."""
    active = X._pdl(torch.device(cuda))
    print(f"early launch active: {bool(active)} (GDC in this Triton: {X._early.HAS_GDC})")
    (tr, suh, svh), sets, idx, x = decode_case(cuda, seed=60)

    def run():
        return [X.exl3_linear(x[:1], tr, suh, svh, "mul1"),
                X.exl3_linear(x, tr, suh, svh, "mul1"), *X.exl3_moe_linear(x, idx, sets, "mul1")]
    results = {}
    for pdl in (True, False):
        monkeypatch.setattr(X, "PDL", pdl)
        eager = run()
        assert_replays_equal(run, eager, pdl)
        results[pdl] = eager
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False]))


def test_a_graphed_early_launch_reads_its_own_replays_input(cuda):
    """A decode step's linears (a dense one at 1 and 6 rows, the grouped MoE gate + up) in a
    CUDA graph, replayed with a new input each time, give each input's eager bits. Their x'
    stays in the graph's pool from one replay to the next, so a kernel that read it before its
    wait for the rotate_in launched just before it (a load the compiler moved above the wait)
    would read the previous replay's x' — which a replay of one fixed input cannot show.
    (Without an early launch — before sm_90 — it checks the graph's plain stream order.)"""
    (tr, suh, svh), sets, idx, x = decode_case(cuda, seed=61)
    g = torch.Generator().manual_seed(61)
    inputs = [torch.randn(x.shape, generator=g).to(cuda, torch.bfloat16) for _ in range(8)]
    static_x = inputs[0].clone()

    def run():
        return [X.exl3_linear(static_x[:1], tr, suh, svh, "mul1"),
                X.exl3_linear(static_x, tr, suh, svh, "mul1"),
                *X.exl3_moe_linear(static_x, idx, sets, "mul1")]
    graph, static = captured(run)
    for i, inp in enumerate(inputs * 2):
        static_x.copy_(inp)
        graph.replay()
        eager = run()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(static, eager)), i


@pytest.mark.parametrize("K,codebook", [(2, "mul1"), (2.5, "mul1"), (3, "mcg"), (3.5, "mul1"),
                                        (4, "3inst"), (4, "mul1"), (5.5, "mul1"), (6, "3inst")])
def test_the_mma_kernel_gives_the_triton_kernels_bits(cuda, monkeypatch, K, codebook):
    """strata.kernels.exl3_mma (the CUDA kernel, fragments decoded in registers, after
    rotate_in) against the Triton fused kernel, bit for bit: four shapes at 1, 6, 9 and 16
    rows — three of several splits (4 warps a program), the last of one (S = 1: 8 warps a
    program, which finish their block from shared memory); on the first and the last, bf16
    and fp32 inputs, fp32 / bf16 / fp16 outputs, a bias and a trimmed output; on the first a
    column slice with the whole weight's split schedule (tensor parallelism); eager and
    replayed from a CUDA graph."""
    from strata.kernels import exl3_mma
    from strata.quant.exl3 import bits_per_weight
    cases = [((5120, 2304), 70), ((2304, 5120), 71), ((1280, 4096), 72), ((256, 32768), 74)]
    assert X.split_schedule(256, 32768)[1] == 1
    g = torch.Generator().manual_seed(73)

    def both(*args, **kw):
        outs = []
        for on in (True, False):
            monkeypatch.setattr(exl3_mma, "ENABLED", on)
            outs.append(X.exl3_linear(*args, **kw))
        return outs

    for c, ((k, n), seed) in enumerate(cases):
        tr = trellis_of(k, n, K, seed=seed, device=cuda)
        suh, svh = scales(k, seed + 1, cuda, scale=k ** -0.5), scales(n, seed + 2, cuda, scale=0.05)
        K2 = int(round(2 * bits_per_weight(tr.shape[-1])))
        for M in (1, 6, 9, 16):
            x = torch.randn(M, k, generator=g).to(cuda)
            monkeypatch.setattr(exl3_mma, "ENABLED", True)
            why = exl3_mma.why_not(x.bfloat16(), K2, X.CODEBOOK_IDS[codebook], n,
                                   torch.float32, None, tr, X.split_schedule(k, n)[1])
            assert why is None, why
            got, ref = both(x.bfloat16(), tr, suh, svh, codebook)
            assert torch.equal(got, ref), ((k, n), M)
            if M != 6 or c not in (0, len(cases) - 1):
                continue
            bias = scales(n, seed + 3, cuda, scale=0.1).to(torch.bfloat16)
            for kw in (dict(out_dtype=torch.bfloat16, bias=bias, out_features=n - 100),
                       dict(out_dtype=torch.float16)):
                got, ref = both(x, tr, suh, svh, codebook, **kw)
                assert torch.equal(got, ref), ((k, n), M, kw.keys())
            if c:
                continue
            cols = slice(n // 2, n // 2 + 1024)  # a column slice, the whole weight's schedule
            tr_s = tr[:, cols.start // 16:cols.stop // 16].contiguous()
            got, ref = both(x.bfloat16(), tr_s, suh, svh[cols], codebook, sched_cols=n)
            assert torch.equal(got, ref), ((k, n), M, "slice")
    # captured in a CUDA graph (the decode step's form) and replayed
    monkeypatch.setattr(exl3_mma, "ENABLED", True)
    x = torch.randn(6, 5120, generator=g).to(cuda, torch.bfloat16)
    tr = trellis_of(5120, 2304, K, seed=80, device=cuda)
    suh, svh = scales(5120, 81, cuda, scale=5120 ** -0.5), scales(2304, 82, cuda, scale=0.05)
    eager = X.exl3_linear(x, tr, suh, svh, codebook)
    assert_replays_equal(lambda: X.exl3_linear(x, tr, suh, svh, codebook), eager)


def expert_sets(K, E, seed, device):
    """E random experts at V4.1's shapes: [w1, w3] (5120 → 2304) and [w2] (2304 → 5120) as
    exl3_moe_linear's weight sets."""
    up = [(trellis_of(5120, 2304, K, seed=seed + w, device=device, E=E),
           scales(5120, seed + 2 + w, device, E, 5120 ** -0.5),
           scales(2304, seed + 4 + w, device, E, 0.05)) for w in range(2)]
    down = [(trellis_of(2304, 5120, K, seed=seed + 6, device=device, E=E),
             scales(2304, seed + 7, device, E, 2304 ** -0.5),
             scales(5120, seed + 8, device, E, 0.05))]
    return up, down


def cuda_and_triton(monkeypatch, x, idx, w, codebook, out_dtype, prefill=False):
    """exl3_moe_linear's outputs on the CUDA kernel (checked to apply: the decode one, or the
    prefill one) and on the Triton kernels."""
    from strata.kernels import exl3_mma
    outs = []
    for on in (True, False):
        monkeypatch.setattr(exl3_mma, "ENABLED", on)
        k_p, n_p = 16 * w[0][0].shape[-3], 16 * w[0][0].shape[-2]
        why = exl3_mma.why_not(x, X.k2_of(w[0][0]), X.CODEBOOK_IDS[codebook], n_p, out_dtype,
                               None, w[0][0], X.split_schedule(k_p, n_p)[1], pairs=idx.numel(),
                               prefill=prefill)
        assert (why is None) == on, why
        outs.append(X.exl3_moe_linear(x, idx, w, codebook, out_dtype=out_dtype))
    return outs


@pytest.mark.parametrize("K,codebook", [(2, "3inst"), (2.5, "mul1"), (3, "mcg"), (4, "mul1")])
def test_the_mma_kernels_moe_gives_the_triton_kernels_bits(cuda, monkeypatch, K, codebook):
    """exl3_moe_linear on the CUDA kernel (tiles of MOE_TILE_M pairs) against the Triton
    grouped kernel (tiles of BLOCK_M), bit for bit: gate + up (two sets, one input per token)
    and down (one input per pair) for a 6-token verify window × 6 slots over 12 experts —
    several pairs per expert, all experts' tiles, fp32 and bf16 outputs — then one token."""
    E, T, k = 12, 6, 6
    sets, down = expert_sets(K, E, 90, cuda)
    g = torch.Generator().manual_seed(99)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(cuda)
    x = torch.randn(T, 5120, generator=g).to(cuda, torch.bfloat16)
    a = torch.randn(T, k, 2304, generator=g).to(cuda, torch.bfloat16)

    def both(x, idx, w, out_dtype):
        return cuda_and_triton(monkeypatch, x, idx, w, codebook, out_dtype)

    for out_dtype in (torch.float32, torch.bfloat16):
        got, ref = both(x, idx, sets, out_dtype)
        assert all(torch.equal(p, q) for p, q in zip(got, ref)), out_dtype
        got, ref = both(a, idx, down, out_dtype)
        assert torch.equal(got[0], ref[0]), out_dtype
    got, ref = both(x[2:3], idx[2:3], sets, torch.float32)
    assert all(torch.equal(p, q) for p, q in zip(got, ref))


# every K / codebook on tiles of 64 pairs (the default), mma.sync and wgmma (its default decode
# depth); tiles of 128 (not a default: each case a compile of its own) on both MMA forms, and
# wgmma decoding one tile or four at a time
@pytest.mark.parametrize("K,codebook,form,tile", [
    (K, cb, form, 64) for K, cb in [(2, "3inst"), (2.5, "mul1"), (3, "mcg"), (4, "mul1"),
                                    (6, "mul1")] for form in ("mma_sync", "wgmma")
] + [(2, "3inst", "mma_sync", 128), (2.5, "mul1", "wgmma", 128), (3, "mcg", "wgmma_wd1", 64),
     (4, "mul1", "wgmma_wd4", 128)])
def test_the_prefill_kernel_gives_the_triton_split_loops_bits(cuda, monkeypatch, K, codebook,
                                                              form, tile):
    """exl3_moe_linear above exl3_mma.MAX_PAIRS pairs on the CUDA prefill kernel (tiles of
    PREFILL_TILE_M pairs — 64 at two programs an SM, 128 at one — x' staged in shared memory,
    each program running all splits of its block; its products on mma.sync or on wgmma, with 1,
    2 or 4 tiles decoded before their wgmmas) against the Triton split loop, bit for bit: gate +
    up (two sets, one input per token) and down (one input per pair), fp32 and bf16 outputs,
    over 8 experts with 20–130 pairs each — full and partial tiles, several for one expert, a
    tile for each of the kernel's copies (1 … TM / 16 pairs of 8-row groups: wgmma's
    instructions of 64, 32 and 16 rows in every combination) — and against each pair's own
    single linear."""
    from strata.kernels import exl3_mma
    monkeypatch.setattr(exl3_mma, "PREFILL_WGMMA", form != "mma_sync")
    if "_wd" in form:
        monkeypatch.setattr(exl3_mma, "PREFILL_WG_DEPTH", int(form[-1]))
    monkeypatch.setattr(exl3_mma, "PREFILL_TILE_M", tile)
    monkeypatch.setattr(exl3_mma, "PREFILL_MIN_BLOCKS", 2 if tile == 64 else 1)
    counts = [130, 112, 96, 80, 64, 48, 32, 20]
    E, k = len(counts), 3
    T = sum(counts) // k
    sets, down = expert_sets(K, E, 190, cuda)
    g = torch.Generator().manual_seed(199)
    # the pairs in expert order, slot by slot: an expert's ≤ 130 < T pairs fall on distinct
    # tokens, so no token picks an expert twice
    flat = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))
    idx = flat.view(k, T).t().contiguous().to(cuda)
    tiles = [n for c in counts for n in [tile] * (c // tile) + [c % tile] * (c % tile > 0)]
    assert {(n + 15) // 16 for n in tiles} == set(range(1, tile // 16 + 1))
    assert T * k == sum(counts) > exl3_mma.MAX_PAIRS
    x = torch.randn(T, 5120, generator=g).to(cuda, torch.bfloat16)
    a = torch.randn(T, k, 2304, generator=g).to(cuda, torch.bfloat16)

    def both(x, idx, w, out_dtype):
        return cuda_and_triton(monkeypatch, x, idx, w, codebook, out_dtype, prefill=True)

    for out_dtype in (torch.float32, torch.bfloat16):
        got, ref = both(x, idx, sets, out_dtype)
        assert all(torch.equal(i16(p), i16(q)) for p, q in zip(got, ref)), out_dtype
        got_down, ref_down = both(a, idx, down, out_dtype)
        assert torch.equal(i16(got_down[0]), i16(ref_down[0])), out_dtype
    monkeypatch.setattr(exl3_mma, "ENABLED", True)
    # (129: expert 0's last pair; 150: expert 1; (100, 1): expert 2; (193, 2): expert 7)
    for t, s in ((0, 0), (129, 0), (150, 0), (100, 1), (193, 2)):
        e = int(idx[t, s])
        one = X.exl3_linear(x[t:t + 1], sets[1][0][e], sets[1][1][e], sets[1][2][e], codebook,
                            out_dtype=torch.bfloat16)
        assert torch.equal(i16(one[0]), i16(got[1][t, s])), (t, s)


def test_a_linear_set_gives_each_linears_bits(cuda):
    """The shared expert's w1 and w3 (5120 → 2304, K 4) through LinearSet: a decode step's
    and a verify window's one grouped launch — on the CUDA kernel, their trellises' distance
    being 16-byte aligned — give each linear's own output bit for bit."""
    import strata.quant.exl3 as qexl3
    from strata.kernels import exl3_mma
    from strata.model.numerics import Numerics
    from strata.quant.groups import LinearSet
    nx = Numerics("vendor", torch.bfloat16)
    lins = [Exl3Linear(trellis_of(5120, 2304, 4, 600 + i, cuda),
                       scales(5120, 610 + i, cuda, scale=5120 ** -0.5),
                       scales(2304, 620 + i, cuda, scale=0.05), "mul1", 2304, 5120)
            for i in range(2)]
    pair = LinearSet(lins)
    x = torch.randn(6, 5120, generator=torch.Generator().manual_seed(9)).to(cuda, torch.bfloat16)
    assert qexl3._use_kernels(x) and pair._grouped_exl3(x)
    d = lins[1].trellis.data_ptr() - lins[0].trellis.data_ptr()
    assert exl3_mma.why_not(x, 8, X.CODEBOOK_IDS["mul1"], 2304, torch.bfloat16, None,
                            lins[0].trellis, X.split_schedule(5120, 2304)[1], pairs=6,
                            str_set=d // 4) is None
    for T in (1, 6):
        got = pair(x[:T], nx)
        for g, lin in zip(got, lins):
            assert torch.equal(i16(g), i16(lin(x[:T], nx))), T


@pytest.mark.parametrize("K,codebook", [(4, "3inst"), (2.5, "mul1")])
def test_a_ragged_linear_set_gives_each_linears_bits(cuda, K, codebook):
    """Linears of one input with different widths, split schedules and output dtypes —
    V4.1's attention: u → wq_a (1280), wkv (512), the compressor's wkv and wgate (fp32), the
    indexer's weights_proj (32 of 128, fp32); q_latent → wq_b (32768: one split) and the
    indexer's wq_b (4096, fp32) — plus one of another K, which runs alone, through LinearSet:
    one ragged launch per K group (exl3_linear_set on the CUDA kernel) gives every linear's
    own output bit for bit at 1, 6 and 16 rows, eager and replayed from a CUDA graph."""
    import strata.quant.exl3 as qexl3
    from strata.model.numerics import Numerics
    from strata.quant.groups import LinearSet
    nx = Numerics("vendor", torch.bfloat16)

    def lin(k, n, out, seed, k_bits=K):
        return Exl3Linear(trellis_of(k, n, k_bits, seed, cuda),
                          scales(k, seed + 1, cuda, scale=k ** -0.5),
                          scales(n, seed + 2, cuda, scale=0.05), codebook if k_bits == K
                          else "3inst", out, k)
    f32 = torch.float32
    cases = [
        ([lin(5120, 1280, 1280, 700), lin(5120, 512, 512, 710), lin(5120, 512, 512, 720),
          lin(5120, 512, 512, 730), lin(5120, 128, 32, 740), lin(5120, 512, 512, 750, 3)],
         [None, None, f32, f32, f32, f32], 5120),
        ([lin(1280, 32768, 32768, 760), lin(1280, 4096, 4096, 770)], [None, f32], 1280)]
    for lins, dtypes, k in cases:
        scheds = [X.split_schedule(k, 16 * l.trellis.shape[1])[1] for l in lins]
        if k == 1280:
            assert scheds[0] == 1 < scheds[1]  # (a one-split weight beside a split one)
        s = LinearSet(lins)
        x = torch.randn(16, k, generator=torch.Generator().manual_seed(k)).to(cuda,
                                                                             torch.bfloat16)
        assert qexl3._use_kernels(x)
        assert [len(g) for g in s._ragged_groups(x)] == [5 if k == 5120 else 2]
        for T in (1, 6, 16):
            want = [l(x[:T], nx, d) for l, d in zip(lins, dtypes)]
            got = s(x[:T], nx, dtypes)
            assert [g.dtype for g in got] == [w.dtype for w in want]
            for i, (g, w) in enumerate(zip(got, want)):
                assert torch.equal(g, w), (k, T, i)
        assert any(p is not None for p in X._SET_PLANS.values())  # (the ragged launch ran)
        x6 = x[:6].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            s(x6, nx, dtypes)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = s(x6, nx, dtypes)
        for seed in (1, 2):
            x6.copy_(torch.randn(6, k, generator=torch.Generator().manual_seed(seed)))
            graph.replay()
            torch.cuda.synchronize()
            for i, (g, l, d) in enumerate(zip(static, lins, dtypes)):
                assert torch.equal(g, l(x6, nx, d)), (k, seed, i)


def test_a_kernel_loaded_from_the_disk_cache_gives_the_compiled_ones_bits(cuda, monkeypatch,
                                                                         tmp_path):
    """exl3_mma._compile on the GPU: a linear's variant compiled through NVRTC leaves its cubin
    under $STRATA_CACHE/exl3_mma; with the in-memory table cleared (a new process) and NVRTC
    made to fail, the same call loads that cubin and gives the same bits (and the Triton
    kernels' — the CUDA kernel really ran: no entry records a failure)."""
    from torch.cuda import _utils as rtc

    from strata.kernels import exl3_mma
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path))
    monkeypatch.setattr(exl3_mma, "ENABLED", True)
    monkeypatch.setattr(exl3_mma, "_KERNELS", {})
    g = torch.Generator().manual_seed(91)
    x = torch.randn(6, 2304, generator=g).to(cuda, torch.bfloat16)
    tr = trellis_of(2304, 5120, 2.5, seed=92, device=cuda)
    suh, svh = scales(2304, 93, cuda, scale=2304 ** -0.5), scales(5120, 94, cuda, scale=0.05)
    first = X.exl3_linear(x, tr, suh, svh, "mul1")
    assert exl3_mma._KERNELS and not any(isinstance(k, str) for k in exl3_mma._KERNELS.values())
    assert list((tmp_path / "exl3_mma").glob("*.cubin"))

    def no_nvrtc(*args, **kw):
        raise RuntimeError("NVRTC must not run: the cubin is on disk")
    monkeypatch.setattr(rtc, "_nvrtc_compile", no_nvrtc)
    monkeypatch.setattr(exl3_mma, "_KERNELS", {})
    again = X.exl3_linear(x, tr, suh, svh, "mul1")
    assert not any(isinstance(k, str) for k in exl3_mma._KERNELS.values()), exl3_mma._KERNELS
    assert torch.equal(again, first)
    monkeypatch.setattr(exl3_mma, "ENABLED", False)
    assert torch.equal(X.exl3_linear(x, tr, suh, svh, "mul1"), first)
