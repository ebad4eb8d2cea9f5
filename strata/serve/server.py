"""`strata serve`: the engine and the HTTP app under uvicorn.

Binding to anything but loopback requires an API key. On SIGTERM/SIGINT uvicorn stops
accepting connections and waits for the requests in flight (up to --drain-timeout seconds);
then the app's lifespan stops the engine.
"""
from __future__ import annotations

import ipaddress
import os
import signal
import sys
import threading
from pathlib import Path

from strata.errors import StrataError
from strata.model.model import Model

# A coding agent's system prompt and tools alone take 10–15K tokens; V4.1's caches cost ~3,200
# bytes a token of capacity (bf16; bench/results/memory_plan.md), so 128K is ~0.4 GB a state.
DEFAULT_CAPACITY = 131072


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def api_key(arg: str | None) -> str | None:
    return arg or os.environ.get("STRATA_API_KEY") or None


def check_bind(host: str, key: str | None) -> None:
    if not is_loopback(host) and not key:
        raise StrataError(f"--host {host} is not a loopback address: clients from other "
                          "machines could reach the server, so an API key is required "
                          "(--api-key KEY or STRATA_API_KEY)")


def serve(model: Model, model_dir: Path, args) -> int:
    import uvicorn

    from strata.runtime.chunk_size import resolve_prefill_chunk
    from strata.runtime.engine import Engine
    from strata.runtime.speculative import speculative_config
    from strata.serve.app import ServeConfig, create_app
    from strata.serve.scripts import load_rules

    key = api_key(args.api_key)
    check_bind(args.host, key)
    capacity = args.capacity or min(DEFAULT_CAPACITY, model.cfg.max_position_embeddings)
    # (flag ranges: strata.argtypes, checked as the command line is parsed)
    spec, costs = speculative_config(model, args.draft_length, args.graphs) \
        if args.speculative else (None, None)
    # (the retained states grow into the prefix cache's budget: the chunk leaves it free)
    chunk = resolve_prefill_chunk(args.prefill_chunk, model, capacity,
                                  keep_bytes=args.prefix_cache_mb << 20, speculative=spec)
    engine = Engine(model, capacity, max_queue=args.max_queue,
                    prefix_cache_bytes=args.prefix_cache_mb << 20,
                    prefill_chunk=chunk, speculative=spec,
                    costs=costs, graphs=args.graphs)
    if args.warmup if args.warmup is not None else model.device.type == "cuda":
        print("strata: warming up (the kernels compile before the first request)",
              file=sys.stderr, flush=True)
        try:
            secs = engine.warm_up()
        except Exception as e:  # (a request would fail the same way: say so before serving)
            hint = " (--no-graphs decodes without CUDA graphs)" if args.graphs else ""
            raise StrataError(f"the warm-up request failed: {type(e).__name__}: {e}{hint}") \
                from e
        print(f"strata: warmed up in {secs:.1f} s", file=sys.stderr, flush=True)
    rules = load_rules(args.script) if args.script else None
    config = ServeConfig(api_key=key, max_body_bytes=args.max_body_mb << 20)
    app = create_app(engine, model_dir, config, rules)
    # the grammars' index of the vocabulary (~0.5 s), built aside before a response format needs it
    threading.Thread(target=app.state.server.grammars.vocabulary, daemon=True).start()
    print(f"strata: serving {config.model_name} from {model_dir} on "
          f"http://{args.host}:{args.port}/v1 (context {capacity} tokens, on {model.device}"
          f"{', CUDA graphs' if args.graphs and model.device.type == 'cuda' else ''}"
          f"{', DSpark' if args.speculative else ''}{', API key required' if key else ''})",
          file=sys.stderr, flush=True)
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal under the handler that was
    # installed before it started; with this no-op one, a drained server exits with status 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.drain_timeout)
    print("strata: drained and stopped", file=sys.stderr, flush=True)
    return 0
