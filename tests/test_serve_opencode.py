"""The real OpenCode CLI end to end against the server (issue 4).

OpenCode 1.18.x is installed from npm (cached under the strata cache directory), configured
with a project opencode.json whose provider uses @ai-sdk/openai-compatible, and run once with
HOME in a temp dir. The fixture model cannot write a tool call by itself, so the server's
scripted-token hook makes it emit a DSML `read` call for the agent request and a short answer
once the tool result is in the prompt; everything else (OpenCode's requests, its tool
execution, the re-serialised follow-up) is real. Needs node and npm on PATH.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from strata.cache import cache_dir
from strata.model.model import Model
from tests.serve_helpers import EOS, M, LiveServer

OPENCODE = "opencode-ai@1.18"


def opencode_bin() -> str:
    npm = shutil.which("npm")
    if npm is None:
        pytest.fail("the OpenCode end-to-end test needs node and npm on PATH")
    root = cache_dir() / "opencode-1.18"
    exe = root / "node_modules" / ".bin" / "opencode"
    if not exe.exists():
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(root), OPENCODE],
                       check=True, capture_output=True, timeout=600)
    version = subprocess.run([str(exe), "--version"], capture_output=True, text=True,
                             timeout=60).stdout.strip()
    assert version.startswith("1.18."), version
    return str(exe)


class RequestLog:
    """ASGI middleware that keeps the JSON bodies of chat requests (to check what OpenCode
    sent); it passes everything through unchanged."""

    def __init__(self, app, log: list[dict]) -> None:
        self.app, self.log = app, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            return await self.app(scope, receive, send)
        body = bytearray()

        async def recv():
            msg = await receive()
            if msg["type"] == "http.request":
                body.extend(msg.get("body", b""))
                if not msg.get("more_body"):
                    self.log.append(json.loads(body))
            return msg

        return await self.app(scope, recv, send)


def test_opencode_reads_a_file_through_the_server(real_vocab_dir, tmp_path):
    exe = opencode_bin()
    project, home = tmp_path / "project", tmp_path / "home"
    project.mkdir()
    home.mkdir()
    target = project / "hello.txt"
    target.write_text("hello from the fixture\n")
    call = ('Let me read it.</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="read">\n'
            f'<｜DSML｜ parameter name="filePath" string="true">{target}</｜DSML｜ parameter>\n'
            '</｜DSML｜ invoke>\n</｜DSML｜ calls>' + EOS)
    rules = [{"match": "<tool_result>", "text": "Read it.</think>The file says hello." + EOS},
             {"match": "### Available Tool Schemas", "text": call},  # the agent request
             {"match": "", "text": "Title.</think>Reading hello" + EOS}]  # the title request
    requests: list[dict] = []
    srv = LiveServer(Model.load(real_vocab_dir), real_vocab_dir, capacity=65536, scripts=rules)
    srv.app.add_middleware(RequestLog, log=requests)
    with srv:
        (project / "opencode.json").write_text(json.dumps({
            "$schema": "https://opencode.ai/config.json",
            "provider": {"strata": {
                "npm": "@ai-sdk/openai-compatible", "name": "Strata",
                "options": {"baseURL": srv.url + "/v1", "apiKey": "unused"},
                "models": {M: {"name": "DeepSeek V4.1 Flash",
                               "limit": {"context": 65536, "output": 512}}}}}}))
        # OpenCode takes its working directory from $PWD, which cwd= alone does not set.
        env = dict(os.environ, HOME=str(home), PWD=str(project))
        for var in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_STATE_HOME"):
            env.pop(var, None)
        run = subprocess.run([exe, "run", "Read hello.txt and tell me what it says",
                              "-m", f"strata/{M}", "--format", "json"],
                             cwd=project, env=env, capture_output=True, text=True, timeout=480)
    logs = sorted((home / ".local" / "share" / "opencode" / "log").glob("*.log"))
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:],
                                 logs[-1].read_text()[-4000:] if logs else "no log")
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]

    # OpenCode ran the tool on the call it received ...
    tools = [e["part"] for e in events if e["type"] == "tool_use"]
    assert tools and tools[0]["tool"] == "read"
    assert tools[0]["state"]["status"] == "completed"
    assert tools[0]["state"]["input"] == {"filePath": str(target)}
    assert "hello from the fixture" in tools[0]["state"]["output"]
    # ... sent the follow-up, which was answered ...
    texts = [e["part"]["text"] for e in events if e["type"] == "text"]
    assert texts and texts[-1] == "The file says hello."
    # ... and that follow-up continued the agent request's state (the prefix cache).
    steps = [e["part"]["tokens"] for e in events if e["type"] == "step_finish"]
    assert len(steps) == 2
    first, second = steps
    assert second["cache"]["read"] >= first["input"] + first["output"] - 1 > 1000

    # What OpenCode sent: streamed requests; the agent's with tools, tool_choice auto and
    # include_usage; the follow-up with the assistant's tool call and the tool result.
    assert requests and all(r.get("stream") for r in requests)
    agent = [r for r in requests if r.get("tools")]
    assert len(agent) == 2 and len(agent[0]["tools"]) >= 5
    assert agent[0].get("tool_choice", "auto") == "auto"
    assert agent[0]["stream_options"]["include_usage"] is True
    follow = agent[1]["messages"]
    assistant = next(m for m in follow if m["role"] == "assistant" and m.get("tool_calls"))
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == \
        {"filePath": str(target)}
    assert any(m["role"] == "tool" for m in follow)
    assert any(not r.get("tools") for r in requests)  # the title request
