"""`strata bench synthetic` on a GPU: the memory plan made before building (check_fits,
`--layers fit`) against what the run then allocates."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.gpu


def test_layers_fit_plans_no_less_than_the_run_allocates(cuda, tiny_dir, tmp_path):
    """The tiny model fits whole: `--layers fit` holds every layer, and the planned bytes
    (weights, folded rows, caches at the run's context, the reserve) cover the peak the decode
    and a prefill allocate — the plan is the bound a one-GPU run is refused by."""
    from strata.cli import main
    out = tmp_path / "syn.json"
    assert main(["bench", "synthetic", "--config", str(tiny_dir), "--device", "cuda:0",
                 "--layers", "fit", "--modes", "plain+graphs", "--tokens", "4", "--runs", "1",
                 "--warmup", "0", "--prefill", "2000", "--prefill-chunk", "512",
                 "--prefill-skip", "on",
                 "--json", str(out)]) == 0
    meta = json.loads(out.read_text())["meta"]
    assert meta["layers"] is None
    assert 0 < meta["peak_device_bytes"] <= meta["planned_device_bytes"]
