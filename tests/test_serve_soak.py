"""A short run of scripts/soak.py against `strata serve` on the fixture (CI's version of the
30-minute soak): agent-like sessions with cancels and disconnects, and no errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[1] / "scripts" / "soak.py"


def test_short_soak_has_no_errors(real_vocab_dir, tmp_path):
    out = tmp_path / "soak.json"
    env = dict(os.environ, SOAK_SERVER_LOG=str(tmp_path / "server.log"))
    proc = subprocess.run(
        [sys.executable, str(SOAK), "--model", str(real_vocab_dir), "--max-requests", "20",
         "--duration", "240", "--sessions", "3", "--capacity", "4096", "--json", str(out)],
        capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["errors"] == 0 and report["requests"] == 20
    # One block of 20: 3 cancels and 1 disconnect, the rest answered in full.
    assert (report["completed"], report["cancelled"], report["disconnected"]) == (16, 3, 1)
    assert report["cached_prompt_tokens"] > 0  # the growing conversations reused their prefix
    assert report["latency_s"]["p50"] > 0 and report["server_exit"] == 0
