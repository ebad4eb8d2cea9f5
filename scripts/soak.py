#!/usr/bin/env python3
"""Soak test of `strata serve`: agent-like sessions with growing context for a fixed time.

Each session is a thread playing a coding agent: a system prompt (sometimes with tools), then
turns of "tool output" user messages that grow the context, the assistant's replies sent back
as history (so the prefix cache is exercised), over Chat Completions and Anthropic Messages,
streamed and not, thinking on and off. In every block of 20 requests, 3 are cancelled by the
client (a stream closed early, or a short client timeout) and 1 drops its TCP connection
abruptly (RST) — about 15 % and 5 %. Anything but a complete, well-formed answer to a request
that was not cancelled is an error.

Report: requests, completed, cancelled, disconnected, errors (must be 0), latency and
time-to-first-token percentiles, tokens, prefix-cache hits, server RSS growth.

  python scripts/soak.py --duration 1800                # starts `strata serve` on the fixture
  python scripts/soak.py --url http://127.0.0.1:8000 --pid PID --duration 600
  python scripts/soak.py --max-requests 40 --json out.json   (what CI runs)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

MODEL = "DeepSeek-V4.1-Flash"
TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{name} a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}} for name in ("read", "write", "grep", "bash")]
WORDS = ("def return self value list dict cache queue state token prefix None if else for in "
         "while import class raise error test assert yield lambda async await").split()


@dataclass
class Stats:
    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    disconnected: int = 0
    errors: list[str] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    def next_action(self, plan: list[str]) -> str | None:
        """The action of the next request, or None when the request budget is spent."""
        with self.lock:
            if self.requests >= len(plan):
                return None
            self.requests += 1
            return plan[self.requests - 1]


def action_plan(n: int, seed: int) -> list[str]:
    """Per block of 20: 3 cancels, 1 disconnect, 16 plain requests, shuffled."""
    rng, plan = random.Random(seed), []
    while len(plan) < n:
        block = ["cancel"] * 3 + ["disconnect"] + ["complete"] * 16
        rng.shuffle(block)
        plan += block
    return plan[:n]


def filler(rng: random.Random, n_words: int) -> str:
    lines, line = [], []
    for _ in range(n_words):
        line.append(rng.choice(WORDS))
        if len(line) >= 10:
            lines.append(" ".join(line))
            line = []
    return "\n".join(lines + [" ".join(line)])


def percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=100, method="inclusive") if len(xs) > 1 else xs * 99
    return {"p50": round(q[49], 4), "p90": round(q[89], 4), "p99": round(q[98], 4),
            "max": round(xs[-1], 4)}


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Session:
    """One simulated agent conversation, restarted when its context gets long."""

    def __init__(self, idx: int, url: str, seed: int, max_context_words: int) -> None:
        self.idx, self.url = idx, url
        self.rng = random.Random(seed * 1000 + idx)
        self.max_words = max_context_words
        self.client = httpx.Client(base_url=url, timeout=300)
        self.reset()

    def reset(self) -> None:
        self.api = self.rng.choice(["chat", "chat", "messages"])
        self.tools = self.rng.random() < 0.5
        self.thinking = self.rng.random() < 0.5
        self.system = f"You are coding agent #{self.idx}. " + filler(self.rng, 40)
        self.history: list[dict] = []
        self.words = 0

    def next_user(self) -> None:
        n = self.rng.randint(20, 150)
        self.words += n
        self.history.append({"role": "user", "content": "Tool output:\n" + filler(self.rng, n)})

    def body(self, stream: bool) -> tuple[str, dict]:
        max_tokens = self.rng.randint(3, 12)
        if self.api == "chat":
            body = {"model": MODEL, "max_tokens": max_tokens, "stream": stream,
                    "messages": [{"role": "system", "content": self.system}] + self.history,
                    "reasoning_effort": "high" if self.thinking else "none",
                    "seed": self.rng.randrange(1 << 31)}
            if not self.thinking:
                body["temperature"] = self.rng.choice([0.0, 0.7])
            if stream:
                body["stream_options"] = {"include_usage": True}
            if self.tools:
                body["tools"] = TOOLS
            return "/v1/chat/completions", body
        body = {"model": MODEL, "max_tokens": max_tokens, "stream": stream,
                "system": self.system, "messages": self.history,
                "thinking": {"type": "enabled", "budget_tokens": 1024} if self.thinking
                else {"type": "disabled"}}
        if self.tools:
            body["tools"] = [{"name": t["function"]["name"],
                              "description": t["function"]["description"],
                              "input_schema": t["function"]["parameters"]} for t in TOOLS]
        return "/v1/messages", body

    # ---- one request of each kind ---------------------------------------------------------
    def complete(self, stats: Stats, stream: bool) -> None:
        path, body = self.body(stream)
        t0 = time.perf_counter()
        if stream:
            reply, usage, first = self._stream(path, body, t0)
            if first is not None:
                with stats.lock:
                    stats.ttft.append(first)
        else:
            r = self.client.post(path, json=body)
            if r.status_code != 200:
                raise RuntimeError(f"{path} HTTP {r.status_code}: {r.text[:300]}")
            reply, usage = self._parse(r.json())
        with stats.lock:
            stats.completed += 1
            stats.latency.append(time.perf_counter() - t0)
            stats.prompt_tokens += usage[0]
            stats.cached_tokens += usage[1]
            stats.output_tokens += usage[2]
        self.history.append(reply)

    def _parse(self, resp: dict) -> tuple[dict, tuple[int, int, int]]:
        if self.api == "chat":
            msg, u = resp["choices"][0]["message"], resp["usage"]
            reply = {"role": "assistant", "content": msg.get("content") or ""}
            if msg.get("reasoning_content"):
                reply["reasoning_content"] = msg["reasoning_content"]
            return reply, (u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"],
                           u["completion_tokens"])
        u = resp["usage"]
        blocks = [b for b in resp["content"] if b["type"] in ("text", "thinking")]
        if not blocks:
            blocks = [{"type": "text", "text": "."}]
        return ({"role": "assistant", "content": blocks},
                (u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"],
                 u["output_tokens"]))

    def _stream(self, path: str, body: dict, t0: float):
        first, events, done = None, [], False
        with self.client.stream("POST", path, json=body) as s:
            if s.status_code != 200:
                raise RuntimeError(f"{path} HTTP {s.status_code}: {s.read()[:300]!r}")
            name = None
            for line in s.iter_lines():
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        continue
                    ev = json.loads(data)
                    if name == "error" or "error" in ev:
                        raise RuntimeError(f"{path} stream error: {data[:300]}")
                    if first is None and self._has_text(ev):
                        first = time.perf_counter() - t0
                    events.append(ev)
                    name = None
        if self.api == "chat":
            if not done:
                raise RuntimeError("chat stream ended without [DONE]")
            usage = next(e["usage"] for e in reversed(events) if e.get("usage"))
            content = "".join((e["choices"][0]["delta"].get("content") or "")
                              for e in events if e.get("choices"))
            reasoning = "".join((e["choices"][0]["delta"].get("reasoning_content") or "")
                                for e in events if e.get("choices"))
            reply = {"role": "assistant", "content": content}
            if reasoning:
                reply["reasoning_content"] = reasoning
            return reply, (usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                           usage["completion_tokens"]), first
        if not events or events[-1]["type"] != "message_stop":
            raise RuntimeError("messages stream ended without message_stop")
        start = next(e for e in events if e["type"] == "message_start")["message"]["usage"]
        out = [e for e in events if e["type"] == "message_delta"][-1]["usage"]
        text = "".join(e["delta"].get("text", "") for e in events
                       if e["type"] == "content_block_delta")
        return ({"role": "assistant", "content": text or "."},
                (start["input_tokens"] + start["cache_read_input_tokens"],
                 start["cache_read_input_tokens"], out["output_tokens"]), first)

    @staticmethod
    def _has_text(ev: dict) -> bool:
        if "choices" in ev:
            d = ev["choices"][0]["delta"] if ev["choices"] else {}
            return bool(d.get("content") or d.get("reasoning_content") or d.get("tool_calls"))
        return ev.get("type") == "content_block_delta"

    def cancel(self, stats: Stats, stream: bool) -> None:
        path, body = self.body(stream)
        body["max_tokens"] = 200  # long enough that the cancel lands mid-generation
        if stream:
            with self.client.stream("POST", path, json=body) as s:
                if s.status_code != 200:
                    raise RuntimeError(f"{path} HTTP {s.status_code}")
                keep = self.rng.randint(1, 6)
                for line in s.iter_lines():
                    keep -= line.startswith("data: ")
                    if keep <= 0:
                        break  # leaving the block closes the connection
        else:
            try:
                self.client.post(path, json=body, timeout=self.rng.uniform(0.1, 1.0))
            except httpx.TimeoutException:
                pass
        with stats.lock:
            stats.cancelled += 1

    def disconnect(self, stats: Stats, stream: bool) -> None:
        """Send the request on a raw socket, wait a little, then reset the connection."""
        path, body = self.body(stream)
        body["max_tokens"] = 200
        data = json.dumps(body).encode()
        u = urlparse(self.url)
        sock = socket.create_connection((u.hostname, u.port or 80), timeout=30)
        try:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: "
                         f"application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
                         + data)
            time.sleep(self.rng.uniform(0.0, 1.0))
        finally:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            sock.close()  # RST, not FIN
        with stats.lock:
            stats.disconnected += 1

    def run(self, stats: Stats, plan: list[str], deadline: float) -> None:
        while time.monotonic() < deadline:
            action = stats.next_action(plan)
            if action is None:
                return
            if self.words > self.max_words:
                self.reset()
            if not self.history or self.history[-1]["role"] == "assistant":
                self.next_user()
            stream = self.rng.random() < 0.5
            try:
                getattr(self, action)(stats, stream)
            except Exception as e:  # noqa: BLE001  (every failure is counted and reported)
                with stats.lock:
                    stats.errors.append(f"session {self.idx} {action} "
                                        f"{'stream' if stream else 'plain'}: "
                                        f"{type(e).__name__}: {e}")
                self.reset()


def start_server(model: str | None, port: int, capacity: int, cache_mb: int, log_path: str):
    cmd = [sys.executable, "-m", "strata.cli", "serve", "--port", str(port),
           "--capacity", str(capacity), "--prefix-cache-mb", str(cache_mb),
           "--log-level", "warning"]
    if model:
        cmd += ["--model", model]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}); see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit("the server did not come up within 300 s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server (default: start `strata serve`)")
    ap.add_argument("--pid", type=int, help="the running server's pid, for RSS")
    ap.add_argument("--model", help="checkpoint for the started server (default: fixture)")
    ap.add_argument("--capacity", type=int, default=8192)
    ap.add_argument("--prefix-cache-mb", type=int, default=256,
                    help="the started server's retained-state budget")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds")
    ap.add_argument("--max-requests", type=int, default=10 ** 9)
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--max-context-words", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)

    proc = None
    if args.url:
        url, pid = args.url.rstrip("/"), args.pid
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc, url = start_server(args.model, port, args.capacity, args.prefix_cache_mb,
                                 os.environ.get("SOAK_SERVER_LOG", "soak-server.log"))
        pid = proc.pid
    try:
        stats = Stats()
        plan = action_plan(min(args.max_requests, 10 ** 6), args.seed)
        rss0, warm = rss_mb(pid), None
        t0 = time.monotonic()
        deadline = t0 + args.duration
        threads = [threading.Thread(target=Session(i, url, args.seed, args.max_context_words)
                                    .run, args=(stats, plan, deadline))
                   for i in range(args.sessions)]
        for t in threads:
            t.start()
        # RSS over time: growth is measured from the end of a warm-up (a tenth of the run, at
        # most 60 s: first allocations of the allocator, tokenizer caches, metrics), so what
        # remains is what the load itself leaves behind.
        warm_at = t0 + min(args.duration / 10, 60.0)
        samples: list[tuple[float, float | None]] = []
        while any(t.is_alive() for t in threads):
            time.sleep(1.0)
            now = time.monotonic()
            if rss0 is not None and now >= warm_at and warm is None:
                warm = rss_mb(pid)
            if not samples or now - t0 - samples[-1][0] >= max(args.duration / 20, 5):
                samples.append((round(now - t0, 1), rss_mb(pid)))
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
        # After the load: the server must still answer, with nothing left running.
        health = httpx.get(url + "/health", timeout=30).json()
        if health.get("queue_depth"):
            stats.errors.append(f"queue not empty after the run: {health}")
        rss1 = rss_mb(pid)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(120)
    report = {
        "url": url, "seconds": round(elapsed, 1), "sessions": args.sessions, "seed": args.seed,
        "requests": stats.requests, "completed": stats.completed,
        "cancelled": stats.cancelled, "disconnected": stats.disconnected,
        "errors": len(stats.errors), "error_samples": stats.errors[:10],
        "latency_s": percentiles(stats.latency), "ttft_s": percentiles(stats.ttft),
        "prompt_tokens": stats.prompt_tokens, "cached_prompt_tokens": stats.cached_tokens,
        "output_tokens": stats.output_tokens,
        "rss_mb": {"start": rss0, "after_warmup": warm, "end": rss1,
                   "growth_after_warmup": None if warm is None or rss1 is None
                   else round(rss1 - warm, 1), "samples": samples},
        "server_exit": None if proc is None else proc.returncode,
    }
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if stats.errors else 0


if __name__ == "__main__":
    sys.exit(main())
