"""Several devices (issue 7) on CPU: 2-3 gloo ranks, every mode bit-identical to one device.

The pytest process is rank 0 of an in-process group (its followers are spawned processes);
the command line, a torchrun-style environment launch over TCP on localhost and killed or hung
ranks run as subprocesses.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from strata.checkpoint.encodings import quant_fp4_group, quant_fp8_block
from strata.model.numerics import Numerics
from strata.quant.linear import DenseLinear, Fp4Group32Linear, Fp8Block32Linear
from strata.runtime.engine import Engine, Failed, Finished, GenRequest, Started, Token
from strata.runtime.parallel import ParallelSpec, launch, parse_split
from strata.runtime.placement import balanced_split
from strata.runtime.parallel_tp import slice_in, slice_out
from strata.runtime.sampling import SamplingParams
from strata.runtime.session import Session
from strata.runtime.speculative import SpecConfig
from strata.errors import StrataError
from util import continuation_drafts, plain_tokens_once, random_tokens

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, seed=3)
GROUPS = {
    "layer": dict(mode="layer", devices=("cpu", "cpu"), split=((0, 3), (3, 8))),
    "layer3": dict(mode="layer", devices=("cpu", "cpu", "cpu"), split=((0, 4), (4, 5), (5, 8))),
    "tp": dict(mode="tp", devices=("cpu", "cpu")),
    "tp-replicated": dict(mode="tp", devices=("cpu", "cpu"), tp_attention="replicated"),
}


@pytest.fixture(scope="module", params=list(GROUPS))
def group(request, tiny_dir):
    """A live group over the tiny fixture (reference numerics), rank 0 in this process; its
    graphs (Session(graphs=True)) replay eagerly on every rank (runtime.graphs.EagerReplay)."""
    pm = launch(ParallelSpec(model_dir=str(tiny_dir), numerics="reference", peer_timeout=20.0,
                             graph_backend="eager", **GROUPS[request.param]))
    yield pm
    pm.close()


def run_tokens(model, prompt, n, params, spec=None, override=None, cap=320):
    s = Session(model, cap, speculative=spec, draft_override=override)
    return s.run(prompt, n, params, stop_ids=frozenset()).tokens, s


# ---- in-process groups ----------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["reference", "vendor"])
def test_logits_bit_identical(group, tiny_reference, mode):
    """Prefill chunks, a verify-sized forward and decode steps: every logit equal."""
    nx = Numerics(mode)
    prompt = random_tokens(37, seed=11)
    ref, par = tiny_reference.new_state(64), group.new_state(64)
    for chunk, want in ((prompt[:20], "none"), (prompt[20:], "all"), (prompt[:5], "all"),
                        (prompt[5:6], "last"), (prompt[6:7], "last")):
        a, ca = tiny_reference.forward(chunk, ref, logits=want, numerics=nx)
        b, cb = group.forward(chunk, par, logits=want, numerics=nx)
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)
        for l, tap in ca.main_hidden.items():  # the DSpark taps reach rank 0 intact
            assert torch.equal(tap, cb.main_hidden[l])
    assert ref.position == par.position == 44
    assert torch.equal(ref.tokens, par.tokens)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_plain_and_dspark_tokens(group, tiny_reference, params):
    prompt = random_tokens(24, seed=5)
    want = plain_tokens_once(tiny_reference, prompt, 20, params)
    got, _ = run_tokens(group, prompt, 20, params)
    assert got == want
    got, s = run_tokens(group, prompt, 20, params, SpecConfig())
    assert got == want and s.stats.windows > 0


def test_across_the_window_and_forced_rejections(group, tiny_reference):
    """Past the 128-row window; drafts corrupted at the third token (partial rollbacks)."""
    prompt = random_tokens(124, seed=7)
    want = plain_tokens_once(tiny_reference, prompt, 14, GREEDY)

    def override(P, L):
        i = P - len(prompt)
        out = list(want[i + 1:i + 1 + L])
        if len(out) > 2:
            out[2] = (out[2] + 1) % 300 + 3
        return out
    got, s = run_tokens(group, prompt, 14, GREEDY, SpecConfig(length=5, low_windows=10 ** 6),
                        override)
    assert got == want
    assert all(c == 3 for c in s.stats.committed[:-1])


def test_decoder_skipping_prefill(group, tiny_reference):
    """Session(decoder_skip=True) over the group: the decoder layers run only the rows near
    the end (prefill_reach, 764 here: the first decoder layer from row 236 of 1,000, each
    later one 127 rows later), in 200-row chunks — the first of the encoder only, the second
    of both — so the carry between ranks holds the rows its last layer ran and the taps of
    the rows each target layer ran, and the kv-source entries go on to the ranks that keep
    them; the last logits and the DSpark continuation equal a full prefill on one device."""
    prompt = random_tokens(1000, seed=21)
    assert group.decoder_start == tiny_reference.decoder_start == 3
    assert group.prefill_reach == tiny_reference.prefill_reach == 764
    spec = SpecConfig(length=3)
    full = Session(tiny_reference, 1100, speculative=spec)
    want = full.prefill(prompt)
    skip = Session(group, 1100, prefill_chunk=200, speculative=spec, decoder_skip=True)
    got = skip.prefill(prompt)
    assert torch.equal(got, want)
    run = dict(max_tokens=5, stop_ids=frozenset())
    cont = random_tokens(3, seed=22)
    assert skip.run(cont, **run).tokens == full.run(cont, **run).tokens


def test_bookmark_truncate_clone(group, tiny_reference):
    """Prefix-reuse moves (bookmark/restore, truncate, fork) mirrored on every rank."""
    a, b = random_tokens(30, seed=1), random_tokens(12, seed=2)
    states = {}
    for name, m in (("ref", tiny_reference), ("par", group)):
        st = m.new_state(96)
        m.forward(a, st, logits="none")
        bm = st.bookmark()
        m.forward(b, st, logits="none")
        fork = st.clone()
        st.restore(bm)
        out = [m.forward(b[:4], st)[0]]
        st.truncate(32)
        out.append(m.forward(b[5:9], st)[0])
        st.begin()
        m.forward(b, st, logits="none")
        st.rollback(40)
        out.append(m.forward(b[:2], st)[0])
        out.append(m.forward(a[:3], fork)[0])
        states[name] = out
    for x, y in zip(states["ref"], states["par"]):
        assert torch.equal(x, y)


def test_engine_with_prefix_reuse(group, tiny_reference):
    """The server's engine on rank 0: a continuation reuses the retained state, tokens equal a
    cold single-device run."""
    prompt = random_tokens(20, seed=9).tolist()
    want, _ = run_tokens(tiny_reference, prompt + [7, 8], 6, GREEDY)
    eng = Engine(group, 128).start()
    try:
        for p in (prompt, prompt + [7, 8]):
            events = []
            eng.submit(GenRequest(p, 6, stop_ids=frozenset()), events.append)
            deadline = time.time() + 60
            while not any(isinstance(e, (Finished, Failed)) for e in events):
                assert time.time() < deadline
                time.sleep(0.01)
        assert not any(isinstance(e, Failed) for e in events), events
        assert next(e for e in events if isinstance(e, Started)).cached_tokens >= 19
        assert [e.id for e in events if isinstance(e, Token)] == want
    finally:
        eng.stop()


def test_wrong_state_and_numerics_are_refused(group, tiny_reference):
    with pytest.raises(ValueError, match="new_state"):
        group.forward(torch.tensor([5]), tiny_reference.new_state(8))
    if group.mode == "layer":
        with pytest.raises(StrataError, match="vendor_stale_index_k"):
            group.forward(torch.tensor([5]), group.new_state(8),
                          numerics=Numerics("reference", vendor_stale_index_k=True))
    with pytest.raises(ValueError):  # checked on rank 0 before any rank runs
        group.forward(torch.tensor([10 ** 6]), group.new_state(8))
    st = group.new_state(8)
    logits, _ = group.forward(torch.tensor([5, 6]), st, logits="last")  # still in step
    assert logits.shape == (1, 320)


def test_graphs_on_a_group(group, tiny_reference):
    """The graph path over a group, every rank replaying its own regions together (eagerly
    here: the CUDA captures, collectives and hand-offs inside, are
    tests/gpu/test_parallel_gpu.py): plain decode across an entry-bucket edge captures twice
    and replays the other steps, and DSpark verify windows with rejected drafts replay inside
    journals and roll back — one device's tokens in every mode."""
    ref = tiny_reference
    edge = 257 * min(ref.index_ratios) - 1
    prompt = random_tokens(edge - 10, seed=5)
    want = Session(ref, edge + 64).run(prompt, 30, GREEDY, stop_ids=frozenset()).tokens
    s = Session(group, edge + 64, graphs=True)
    assert s.run(prompt, 30, GREEDY, stop_ids=frozenset(), mode="plain").tokens == want
    assert (s.graphed.captures, s.graphed.replays) == (2, 29 - 2)
    override = continuation_drafts(want, len(prompt), ref.cfg.vocab_size)
    spec = SpecConfig(length=ref.cfg.dspark_block_size, low_windows=10 ** 9)
    d = Session(group, edge + 64, speculative=spec, draft_override=override, graphs=True)
    assert d.run(prompt, 30, GREEDY, stop_ids=frozenset(), mode="dspark").tokens == want
    assert d.stats.accepted < d.stats.drafted and d.graphed.replays > 0
    Engine(group, 64, graphs=True)


def test_stats(group):
    group.stats(reset=True)
    st = group.new_state(16)
    group.forward(torch.tensor([5, 6, 7]), st, logits="last")
    rows = group.stats(reset=True)
    assert [r["rank"] for r in rows] == list(range(group.world))
    assert all(r["forwards"] == 1 and r["collectives"] >= 1 for r in rows)


def test_memory_is_gathered_from_every_rank(group):
    """MEMORY: every rank answers with its device's reading (zeros on CPU; one GPU's real
    readings: tests/gpu/test_chunk_size_gpu.py), and the group goes on serving."""
    from strata.device_memory import DeviceMemory
    assert group.memory(reset_peak=True) == [DeviceMemory(0, 0, 0)] * group.world
    st = group.new_state(16)
    assert group.forward(torch.tensor([5, 6, 7]), st, logits="last")[0] is not None
    assert len(group.memory()) == group.world


# ---- pieces ---------------------------------------------------------------------------------
def test_parse_and_plan_split(tiny_dir):
    assert parse_split("0-2,3-7", 8, 2) == ((0, 3), (3, 8))
    for bad in ("0-2,4-7", "0-7", "1-7,0-0", "0-3,4-9", "a-b,3-7"):
        with pytest.raises(StrataError):
            parse_split(bad, 8, 2)
    from strata.checkpoint.safetensors_io import CheckpointFolder
    from strata.config import ModelConfig
    from strata.runtime.placement import tensor_bytes_of
    cfg = ModelConfig.from_model_dir(tiny_dir)
    sizes = tensor_bytes_of(CheckpointFolder(tiny_dir))
    for n in (2, 3, 8):
        ranges = balanced_split(cfg, sizes, n, 4096, act_bytes=4)
        assert [l for r in ranges for l in r] == list(range(8)) and all(len(r) for r in ranges)
    # rank 0 also holds the embed, head and DSpark stages: it gets fewer layers
    two = balanced_split(cfg, sizes, 2, 4096, act_bytes=4)
    assert len(two[0]) < len(two[1])


def _random_fp8(out, inp, seed):
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(seed))
    return Fp8Block32Linear(*quant_fp8_block(w))


def _random_fp4(out, inp, seed):
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(seed))
    return Fp4Group32Linear(*quant_fp4_group(w))


def _random_exl3(out, inp, seed):
    from strata.quant.exl3 import Exl3Linear
    g = torch.Generator().manual_seed(seed)
    kp, np_ = -(-inp // 128) * 128, -(-out // 128) * 128
    trellis = torch.randint(-32768, 32767, (kp // 16, np_ // 16, 64), generator=g,
                            dtype=torch.int32).to(torch.int16)
    suh = (torch.randn(kp, generator=g).sign() * 0.5).half()
    svh = (torch.rand(np_, generator=g) + 0.5).half()
    return Exl3Linear(trellis, suh, svh, "mcg", out, inp)


@pytest.mark.parametrize("make", [
    lambda: DenseLinear(torch.randn(96, 64, generator=torch.Generator().manual_seed(0))),
    lambda: _random_fp8(96, 64, 1), lambda: _random_fp4(96, 64, 2),
    lambda: _random_exl3(256, 256, 3)], ids=["dense", "fp8", "fp4", "exl3"])
def test_sharded_linears_slice_stored_tensors(make):
    """Output and input slices at legal boundaries: the same weights (never requantized), and
    a row slice computes exactly the rows of the whole product."""
    lin = make()
    w = lin.dequantize()
    unit = 128 if lin.out_features == 256 else 32
    x = torch.randn(3, lin.in_features, generator=torch.Generator().manual_seed(4))
    full = lin(x, Numerics())
    for lo, hi in ((0, unit), (unit, lin.out_features)):
        part = slice_out(lin, lo, hi)
        assert torch.equal(part.dequantize(), w[lo:hi])
        assert torch.equal(part(x, Numerics()), full[:, lo:hi])
        sub = slice_in(lin, lo, hi) if hi <= lin.in_features else None
        if sub is not None:
            assert torch.equal(sub.dequantize(), w[:, lo:hi])
    if isinstance(lin, Fp8Block32Linear):
        with pytest.raises(StrataError, match="32"):
            slice_out(lin, 0, 16)
    if isinstance(lin, Fp4Group32Linear):
        with pytest.raises(StrataError, match="32"):
            slice_in(lin, 0, 16)


# ---- subprocesses ---------------------------------------------------------------------------
def _env(**extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               ATEN_CPU_CAPABILITY="default")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _strata(args, **kw):
    return subprocess.run([sys.executable, "-m", "strata.cli", *args], capture_output=True,
                          text=True, timeout=240, **kw)


def _generate_args(tiny_dir):
    return ["generate", "--model", str(tiny_dir), "--tokens", "5,6,7,8,9,10,11", "--max-tokens",
            "10", "--json", "--quiet"]


@pytest.fixture(scope="module")
def single_tokens(tiny_dir):
    out = _strata(_generate_args(tiny_dir), env=_env())
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["tokens"]


@pytest.mark.parametrize("extra", [["--parallel", "layer", "--devices", "cpu,cpu", "--split",
                                    "0-5,6-7"],
                                   ["--parallel", "tp", "--devices", "cpu,cpu"],
                                   ["--parallel", "tp", "--devices", "cpu,cpu", "--speculative",
                                    "--draft-length", "5"]],
                         ids=["layer", "tp", "tp-dspark"])
def test_cli_generate(tiny_dir, single_tokens, extra):
    out = _strata(_generate_args(tiny_dir) + extra, env=_env())
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["tokens"] == single_tokens
    if "--speculative" in extra:  # (DSpark windows verified across the ranks)
        assert result["speculative"]["windows"] > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_environment_launch_over_tcp(tiny_dir, single_tokens):
    """Two independently started processes meeting through MASTER_ADDR/MASTER_PORT, as on two
    hosts (torchrun sets the same variables)."""
    port = _free_port()
    args = [sys.executable, "-m", "strata.cli", *_generate_args(tiny_dir), "--parallel", "layer",
            "--devices", "cpu,cpu"]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env(RANK=r, WORLD_SIZE=2, LOCAL_RANK=r, LOCAL_WORLD_SIZE=2,
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in (0, 1)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert json.loads(outs[0][0])["tokens"] == single_tokens
    assert outs[1][0] == ""


DRIVER = """
import sys, torch
from strata.runtime.parallel import ParallelSpec, launch

def main():
    pm = launch(ParallelSpec(sys.argv[1], ("cpu", "cpu"), sys.argv[2], numerics="reference",
                             peer_timeout=float(sys.argv[3])))
    print("READY", flush=True)
    st = pm.new_state(64)
    try:
        while True:
            if st.position > 40:
                st.truncate(0)
            pm.forward(torch.tensor([5, 6]), st, logits="last")
    except Exception as e:
        print("ERROR", type(e).__name__, e, flush=True)
        sys.exit(3)

if __name__ == "__main__":
    main()
"""


def _start_driver(tmp_path, tiny_dir, mode, peer_timeout):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    p = subprocess.Popen([sys.executable, str(script), mode, str(tiny_dir), str(peer_timeout)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    child = None
    for line in p.stderr:  # "strata: rank 1 on cpu (pid N)"
        if "rank 1 on" in line:
            child = int(line.rsplit("pid ", 1)[1].rstrip(")\n"))
            break
    assert child is not None
    assert p.stdout.readline().strip() == "READY"
    time.sleep(0.5)  # forwards running
    return p, child


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" in f.read()
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("mode", ["layer", "tp"])
def test_killed_follower_fails_rank0_fast(tmp_path, tiny_dir, mode):
    p, child = _start_driver(tmp_path, tiny_dir, mode, 20)
    t0 = time.monotonic()
    os.kill(child, signal.SIGKILL)
    out, err = p.communicate(timeout=30)
    assert time.monotonic() - t0 < 15
    assert p.returncode == 3, err
    assert "ParallelError" in out and "rank 1" in out and "SIGKILL" in out, out


def test_killed_rank0_stops_the_follower(tmp_path, tiny_dir):
    p, child = _start_driver(tmp_path, tiny_dir, "layer", 20)
    p.kill()
    p.wait(10)
    t0 = time.monotonic()
    err = p.stderr.read()  # EOF once the follower (which shares the pipe) has exited too
    while not _gone(child):
        assert time.monotonic() - t0 < 15
        time.sleep(0.1)
    assert "rank 1" in err and "rank 0" in err, err


def test_hung_follower_is_detected_by_the_heartbeat(tmp_path, tiny_dir):
    """A stopped (not dead) rank keeps its connections open: only the heartbeat sees it."""
    p, child = _start_driver(tmp_path, tiny_dir, "layer", 2)
    try:
        t0 = time.monotonic()
        os.kill(child, signal.SIGSTOP)
        p.wait(timeout=30)  # not EOF: the stopped follower holds the pipes open
        assert time.monotonic() - t0 < 15
    finally:
        os.kill(child, signal.SIGKILL)
    out, err = p.communicate(timeout=30)
    assert p.returncode in (3, 75)
    assert "rank 1 stopped responding" in out + err, (out, err)
