"""`strata serve` as a process: SIGTERM lets the request in flight finish, then exits 0."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx

from tests.serve_helpers import M, free_port


def test_sigterm_drains_and_exits_cleanly(real_vocab_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "strata.cli", "serve", "--model", str(real_vocab_dir),
         "--port", str(port), "--capacity", "2048", "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)

        first = threading.Event()
        got: list[str] = []

        def stream():
            body = {"model": M, "messages": [{"role": "user", "content": "Count slowly."}],
                    "max_tokens": 30, "stream": True, "stream_options": {"include_usage": True},
                    "reasoning_effort": "none", "temperature": 0}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as s:
                for line in s.iter_lines():
                    if line.startswith("data: "):
                        got.append(line[6:])
                        first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        t.join(120)
        assert got[-1] == "[DONE]"  # the request in flight was answered in full
        last = json.loads(got[-2])
        assert last["choices"][0]["finish_reason"] == "length"
        assert last["usage"]["completion_tokens"] == 30
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    try:
        httpx.get(url + "/health", timeout=2)
        raise AssertionError("the server still answers after exiting")
    except httpx.TransportError:
        pass
