"""The load benchmark's harness on the CPU (the numbers themselves come from the GPU machine)."""
from __future__ import annotations

import json

from strata.bench.load import main


def test_folder_and_pack_load_the_same_bytes(tmp_path):
    out = {}
    for mode in ("folder", "pack"):
        js = tmp_path / f"{mode}.json"
        argv = [str(tmp_path / "bench"), "--size", "10MB", "--experts", "2", "--device", "cpu",
                "--runs", "1", "--buffer-mb", "8", "--buffers", "2", "--json", str(js)]
        assert main(argv + (["--pack"] if mode == "pack" else [])) == 0
        out[mode] = json.loads(js.read_text())
        assert out[mode]["meta"]["source"] == mode
    folder, packed = out["folder"]["runs"][0], out["pack"]["runs"][0]
    assert folder["bytes"] == packed["bytes"] > 90e6
    assert folder["gb_per_s"] > 0 and packed["gb_per_s"] > 0
    # A pack reads each projection's experts as one stack: 2 experts × 3 × (weight, scale)
    # tensors become 3 × 2 stacked reads.
    assert folder["reads"] - packed["reads"] == 6
