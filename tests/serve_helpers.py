"""Helpers for the server tests: a real uvicorn server on a free loopback port, in a thread."""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import deepseek_recipe as dr
import httpx
import uvicorn

from strata.model.model import Model
from strata.runtime.engine import Engine
from strata.runtime.speculative import SpecConfig
from strata.serve.app import MODEL_NAME, ServeConfig, create_app
from strata.serve.scripts import Scripts
from strata.tokenizer import tokenizer_path

M = MODEL_NAME
EOS = "<｜end▁of▁sentence｜>"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """create_app over a fresh Engine, served by uvicorn on 127.0.0.1 in a daemon thread."""

    def __init__(self, model: Model, model_dir: Path, *, capacity: int = 4096,
                 max_queue: int = 16, prefix_cache_bytes: int = 1 << 30,
                 prefill_chunk: int = 512, scripts: list[dict] | None = None,
                 speculative: SpecConfig | None = None, **config) -> None:
        self.engine = Engine(model, capacity, max_queue=max_queue,
                             prefix_cache_bytes=prefix_cache_bytes, prefill_chunk=prefill_chunk,
                             speculative=speculative)
        config.setdefault("keepalive_s", 0.2)
        self.app = create_app(self.engine, model_dir, ServeConfig(**config), scripts)
        self.server = self.app.state.server
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._uv = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                 log_level="warning", lifespan="on"))
        self._thread = threading.Thread(target=self._uv.run, daemon=True)

    def __enter__(self) -> "LiveServer":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._uv.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self._uv.should_exit = True
        self._thread.join(30)

    def script(self, rules: list[dict] | None) -> None:
        """Set the scripted-output rules (strata.serve.scripts) for the next requests."""
        self.server.scripts = Scripts(rules, self.server.rtok) if rules else None

    def post(self, path: str, body: dict | bytes | str, **kw) -> httpx.Response:
        if isinstance(body, dict):
            return httpx.post(self.url + path, json=body, timeout=120, **kw)
        return httpx.post(self.url + path, content=body, timeout=120, **kw)

    def wait_idle(self, timeout: float = 30) -> None:
        """Until the engine has no job running or waiting."""
        deadline = time.monotonic() + timeout
        while self.engine.running is not None or self.engine.queue_depth:
            if time.monotonic() > deadline:
                raise TimeoutError("the engine did not become idle")
            time.sleep(0.02)


def recipe_tokenizer(model_dir: Path) -> dr.Tokenizer:
    return dr.Tokenizer.from_file(str(tokenizer_path(model_dir)))


def recipe_prompt_ids(model_dir: Path, body: dict, cls=dr.ChatCompletionRequest) -> list[int]:
    """The prompt ids deepseek-recipe renders for a request body (the oracle)."""
    creq = cls(body).convert(dr.ConversionOptions())
    return list(dr.DeepseekV41Encoding().with_tokenizer(recipe_tokenizer(model_dir))
                .encode(creq.conversation))


def sse_events(resp: httpx.Response) -> list[tuple[str | None, str]]:
    """(event name, data) of every SSE event of a streamed response; comments skipped."""
    out, name = [], None
    for line in resp.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            out.append((name, line[6:]))
            name = None
    return out
