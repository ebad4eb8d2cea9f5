"""Several GPUs (issue 7, pytest -m gpu tests/gpu/test_parallel_gpu.py on a 2-GPU machine):
modes layer, layer+dspark, tp, tp+dspark give the tokens — and logits — of one GPU, with both
GPU orders, over NCCL; a killed rank stops the others.

This process is rank 0 (its follower is a spawned process); the single-GPU reference runs in
this process on the same device as rank 0.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from strata.checkpoint.tiny import make_tiny
from strata.model.model import Model
from strata.model.numerics import Numerics
from strata.runtime.parallel import ParallelSpec, launch
from strata.runtime.sampling import SamplingParams
from strata.runtime.session import Session
from strata.runtime.speculative import SpecConfig
from util import continuation_drafts, random_tokens

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    assert torch.cuda.device_count() >= 2, "these tests need two CUDA devices"
    return make_tiny(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


CASES = [("layer", ("cuda:0", "cuda:1")), ("layer", ("cuda:1", "cuda:0")),
         ("tp", ("cuda:0", "cuda:1")), ("tp", ("cuda:1", "cuda:0"))]


@pytest.mark.parametrize("mode,devices", CASES, ids=[f"{m}-{d[0][-1]}{d[1][-1]}" for m, d in CASES])
@pytest.mark.parametrize("numerics", ["vendor", "reference"])
def test_modes_equal_one_gpu(tiny, mode, devices, numerics):
    nx = Numerics.for_device(devices[0], numerics)
    ref = Model.load(tiny, devices[0], nx)
    prompt = random_tokens(40, seed=3)
    want = Session(ref, 256).run(prompt, 24, SamplingParams(), stop_ids=frozenset()).tokens
    st = ref.new_state(64)
    want_logits, _ = ref.forward(prompt, st)
    with launch(ParallelSpec(mode, devices, str(tiny), numerics=numerics,
                             split=((0, 4), (4, 8)) if mode == "layer" else None)) as pm:
        got_logits, _ = pm.forward(prompt, pm.new_state(64))
        assert torch.equal(got_logits, want_logits)
        got = Session(pm, 256).run(prompt, 24, SamplingParams(), stop_ids=frozenset()).tokens
        assert got == want
        s = Session(pm, 256, speculative=SpecConfig())
        assert s.run(prompt, 24, SamplingParams(), stop_ids=frozenset()).tokens == want


@pytest.mark.parametrize("mode", ["tp", "layer"])
def test_graphs_over_two_gpus_equal_one_gpu(tiny, mode):
    """CUDA graphs on both ranks, captured and replayed together — tensor parallel with its
    all_gathers inside, the layer split with its point-to-point hand-offs inside: plain
    decode across an entry-bucket edge and DSpark verify windows with rejected drafts give one
    GPU's eager tokens; the steps were replays."""
    ref = Model.load(tiny, "cuda:0", Numerics.for_device("cuda:0", "vendor"))  # (the group's)
    edge = 257 * min(ref.index_ratios) - 1
    prompt = random_tokens(edge - 10, seed=5)
    want = Session(ref, edge + 64).run(prompt, 30, mode="plain").tokens
    block = ref.cfg.dspark_block_size
    override = continuation_drafts(want, len(prompt), ref.cfg.vocab_size)
    group = ParallelSpec(mode, ("cuda:0", "cuda:1"), str(tiny), numerics="vendor",
                         split=((0, 4), (4, 8)) if mode == "layer" else None)
    with launch(group) as pm:
        s = Session(pm, edge + 64, graphs=True)
        assert s.run(prompt, 30, mode="plain").tokens == want
        assert (s.graphed.captures, s.graphed.replays) == (2, 29 - 2)
        spec = SpecConfig(length=block, low_windows=10 ** 9)
        d = Session(pm, edge + 64, speculative=spec, draft_override=override, graphs=True)
        assert d.run(prompt, 30, mode="dspark").tokens == want
        assert d.stats.accepted < d.stats.drafted and d.graphed.replays > 0


def test_a_model_on_the_second_gpu_computes_there(tiny):
    """Triton and some torch 2.11 ops launch on the *current* CUDA device: with cuda:0 current,
    a model on cuda:1 still runs on cuda:1 (its entry points make it current:
    strata/current_device.py), its decode and DSpark tokens equal a model's on cuda:0, and
    the caller's current device is left as it was."""
    prompt = random_tokens(40, seed=3)
    got = {}
    for dev in ("cuda:1", "cuda:0"):
        torch.cuda.set_device(0)
        model = Model.load(tiny, dev, Numerics.for_device(dev))
        logits, _ = model.forward(prompt, model.new_state(64))
        plain = Session(model, 256).run(prompt, 16, SamplingParams(), stop_ids=frozenset()).tokens
        spec = Session(model, 256, speculative=SpecConfig()).run(
            prompt, 16, SamplingParams(), stop_ids=frozenset()).tokens
        assert torch.cuda.current_device() == 0 and logits.device == torch.device(dev)
        got[dev] = (logits.cpu(), plain, spec)
    assert torch.equal(got["cuda:1"][0], got["cuda:0"][0])
    assert got["cuda:1"][1:] == got["cuda:0"][1:]


def test_killed_rank_stops_rank0(tiny, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(
        "import sys, torch\n"
        "from strata.runtime.parallel import ParallelSpec, launch\n"
        "def main():\n"
        "    pm = launch(ParallelSpec('tp', ('cuda:0', 'cuda:1'), sys.argv[1],"
        " peer_timeout=5))\n"
        "    print('READY', flush=True)\n"
        "    st = pm.new_state(64)\n"
        "    try:\n"
        "        while True:\n"
        "            if st.position > 40: st.truncate(0)\n"
        "            pm.forward(torch.tensor([5, 6]), st, logits='last')\n"
        "    except Exception as e:\n"
        "        print('ERROR', type(e).__name__, e, flush=True); sys.exit(3)\n"
        "if __name__ == '__main__':\n"
        "    main()\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, str(script), str(tiny)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    child = None
    for line in p.stderr:
        if "rank 1 on" in line:
            child = int(line.rsplit("pid ", 1)[1].rstrip(")\n"))
            break
    assert child is not None and p.stdout.readline().strip() == "READY"
    time.sleep(1)
    t0 = time.monotonic()
    os.kill(child, signal.SIGKILL)
    p.wait(timeout=60)
    elapsed = time.monotonic() - t0
    out, err = p.communicate()
    print(f"rank 0 stopped {elapsed:.1f} s after rank 1 was killed (NCCL): {out}{err}")
    assert elapsed < 30 and p.returncode in (3, 75)
