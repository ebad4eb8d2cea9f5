"""Several devices: one process per device over torch.distributed, identical tokens in every
mode (issue 7).

Modes
- `layer`: each rank holds a contiguous range of backbone layers and their caches
  (runtime/parallel_layer.py); the stream, the lagged pre and the shared per-forward context
  cross each boundary in one message.
- `tp`: tensor parallelism (runtime/parallel_tp.py): attention heads and experts split across
  ranks, every product computed wholly on one rank, finished values all-gathered.
Both are transformations of the same model code (strata/model never mentions ranks) and both
are exact: tokens and logits equal the single-device run bit for bit.

Roles. Rank 0 owns the API: the Session, sampling, the engine and server, the embedding, the
head and the DSpark draft head (why DSpark stays on rank 0: the draft is a short sequential
chain — three small blocks over five rows, then a token-by-token Markov pick with the
request's own sampler — whose weights fit one device; sharding it would add two collectives
per stage to a step that is mostly latency, and its picks feed the sampler, which is on rank 0
anyway). The other ranks are followers: they hold their part of the model and a State per
session for it, and execute a small command protocol broadcast by rank 0.

Command protocol (rank 0 → all, `Op`): one int64 header of HEADER words per broadcast,
holding records of 7 words (op, state id, a, b, c, d, e) and, for FORWARD, the tokens inline
when they fit (else one more broadcast). State operations (NEW/FREE/CLONE_STATE, BEGIN, COMMIT,
ROLLBACK(to), TRUNCATE(to), BOOKMARK, RESTORE, DROP_BOOKMARK) return nothing, so rank 0 applies
them to its own State first (an invalid one raises there and is never sent), queues them, and
sends the queue with the next FORWARD(state, T, logits mode, numerics, start, graphs | skip
<< 1 | (decoder_from − start) << 2 — graphs: every rank replays its CUDA graph of this
forward; skip: a decoder-skipping prefill, Model.forward): one broadcast per forward
whatever the speculative step did around it. A follower checks that its
State is at `start` before running, so diverged states fail loudly. STATS gathers per-rank
timings, MEMORY per-rank device memory; SHUTDOWN ends the followers.

Launch. `launch(spec)` either joins the group described by torch.distributed's standard
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK — torchrun, or the same
command started on several hosts), or, without it, starts the followers itself as local
processes (torch.multiprocessing, spawn) meeting rank 0 at a store on a free localhost port.
Failures: runtime/parallel_comm.py (a dead or hung rank makes the others fail fast).
"""
from __future__ import annotations

import atexit
import itertools
import os
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field, replace
from enum import IntEnum
from pathlib import Path

import torch

from strata.config import ModelConfig
from strata.device_memory import DeviceMemory, device_memory
from strata.errors import ConfigError, StrataError
from strata.model.model import Model, ModelPart
from strata.model.numerics import Numerics
from strata.runtime.parallel_comm import (EXIT_PEER_LOST, Comm, ParallelError, Rendezvous,
                                          backend_for, connect_store)
from strata.runtime.parallel_layer import LayerExecutor
from strata.runtime.parallel_tp import TPPlan, apply_tp, check_tp, sharding_reader
from strata.runtime.graphs import GRAPH_BACKENDS, GraphedForward
from strata.runtime.state import Bookmark, State

MODES = ("layer", "tp")
HEADER = 256  # int64 words per command broadcast
REC = 7       # words per record
LOGITS = ("all", "last", "none")
DTYPES = (torch.float32, torch.bfloat16)

__all__ = ["MODES", "ParallelError", "ParallelModel", "ParallelSpec", "ParallelState", "launch",
           "parse_devices", "parse_split"]


class Op(IntEnum):
    FORWARD = 1
    NEW_STATE = 2
    FREE_STATE = 3
    CLONE_STATE = 4
    BEGIN = 5
    COMMIT = 6
    ROLLBACK = 7
    TRUNCATE = 8
    BOOKMARK = 9
    RESTORE = 10
    DROP_BOOKMARK = 11
    TIMING = 12
    STATS = 13
    SHUTDOWN = 14
    MEMORY = 15


@dataclass(frozen=True)
class ParallelSpec:
    """Everything each rank needs to load its part (picklable: launched ranks receive it)."""

    mode: str                                   # "layer" | "tp"
    devices: tuple[str, ...]                    # one per rank; "cuda" = cuda:LOCAL_RANK
    model_dir: str
    numerics: str | None = None                 # reference | vendor (None: the device default)
    act_dtype: str | None = None                # float32 | bfloat16 (None: the device default)
    vendor_stale_index_k: bool = False
    split: tuple[tuple[int, int], ...] | None = None  # layer mode: [lo, hi) per rank; None: plan
    tp_attention: str = "heads"                 # tp: "heads" | "replicated"
    peer_timeout: float = 15.0                  # seconds without a heartbeat: a rank is gone
    context: int = 32768                        # sizes the caches when planning a split
    buffer_bytes: int = 256 << 20               # loader staging buffers
    progress: bool | None = None                # loading bar on rank 0 (None: if a terminal)
    load_options: dict = field(default_factory=dict)  # more Model.load keywords (engram, ...)
    # Instead of a checkpoint: a synthetic model (strata.bench.synthetic) built on each rank —
    # {"config": checkpoint folder or None for the published V4.1 config, and build_synthetic
    # options: fmt, seed, engram, engram_rows, engram_dir}; model_dir is then unused.
    synthetic: dict | None = None
    # How every rank captures and replays its graphs (runtime/graphs.GRAPH_BACKENDS): "cuda",
    # or "eager" — the same regions re-run without capture (CPU groups in tests; telling a
    # capture problem from a region problem on GPUs).
    graph_backend: str = "cuda"


def spec_config(spec: ParallelSpec) -> ModelConfig:
    """The model config of a spec: the checkpoint's, or the synthetic model's."""
    if spec.synthetic is None:
        return ModelConfig.from_model_dir(spec.model_dir)
    if spec.synthetic.get("config"):
        return ModelConfig.from_model_dir(spec.synthetic["config"])
    from strata.config import v41_flash_config
    return v41_flash_config()


def _synthetic_options(spec: ParallelSpec, rank: int) -> dict:
    """build_synthetic's options for `rank` (disk Engram tables in a folder of its own: in
    tensor parallelism every rank writes the same tables)."""
    out = {k: v for k, v in spec.synthetic.items() if k != "config"}
    if out.get("engram_dir"):
        out["engram_dir"] = str(Path(out["engram_dir"]) / f"rank{rank}")
    return out


# ---- parsing ---------------------------------------------------------------------------------
def parse_devices(text: str) -> tuple[str, ...]:
    devs = tuple(d.strip() for d in text.split(",") if d.strip())
    if len(devs) < 2:
        raise StrataError(f"--devices {text!r}: a parallel mode needs at least two devices")
    kinds = {d.split(":")[0] for d in devs}
    if not kinds <= {"cpu", "cuda"} or len(kinds) != 1:
        raise StrataError(f"--devices {text!r}: expected all cpu or all cuda[:N]")
    for d in devs:
        try:
            torch.device(d)
        except RuntimeError:
            raise StrataError(f"--devices {text!r}: {d!r} is not a device (cpu, cuda:N)") \
                from None
    if kinds == {"cuda"} and len(set(devs)) != len(devs):
        raise StrataError(f"--devices {text!r}: a device is named twice")
    return devs


def parse_split(text: str, n_layers: int, world: int) -> tuple[tuple[int, int], ...]:
    """'0-17,18-39' → ((0, 18), (18, 40)): contiguous ranges covering every layer once."""
    out = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi if sep else lo)
        except ValueError:
            raise StrataError(f"--split {text!r}: expected ranges like 0-17,18-39") from None
        out.append((a, b + 1))
    return check_split(tuple(out), n_layers, world, f"--split {text!r}")


def check_split(split, n_layers: int, world: int, what: str = "split"):
    if len(split) != world:
        raise StrataError(f"{what}: {len(split)} ranges for {world} devices")
    expect = 0
    for lo, hi in split:
        if lo != expect or hi <= lo:
            raise StrataError(f"{what}: ranges must be contiguous, non-empty and start at 0 "
                              f"(layer {expect} expected next, got {lo}-{hi - 1})")
        expect = hi
    if expect != n_layers:
        raise StrataError(f"{what}: covers layers 0-{expect - 1}, the model has {n_layers}")
    return tuple(split)


def plan_split(spec: ParallelSpec, cfg: ModelConfig) -> tuple[tuple[int, int], ...]:
    """The placement planner's balanced split (weights + caches at spec.context per rank;
    rank 0 also holds the embedding, head and DSpark stages), from the checkpoint headers."""
    from strata.checkpoint.pack import open_checkpoint
    from strata.runtime.placement import balanced_split, tensor_bytes_of
    if spec.synthetic is not None:  # sizes from a build on the meta device (nothing allocated)
        from strata.bench.synthetic import build_synthetic
        fmt = spec.synthetic.get("fmt", "exl3")
        sizes = build_synthetic(cfg, "meta", fmt=fmt)[1].tensor_bytes
    else:
        sizes = tensor_bytes_of(open_checkpoint(spec.model_dir, verify="none"))
    dtype_bytes = 2 if (spec.act_dtype or ("bfloat16" if spec.devices[0].startswith("cuda")
                                           else "float32")) in ("bfloat16", "bf16") else 4
    ranges = balanced_split(cfg, sizes, len(spec.devices), spec.context,
                            act_bytes=dtype_bytes)
    return tuple((r.start, r.stop) for r in ranges)


def _device(name: str, local_rank: int) -> torch.device:
    dev = torch.device(f"cuda:{local_rank}" if name == "cuda" else name)
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) >= n:
            raise StrataError(f"device {dev}: this machine has {n} CUDA device(s)")
    return dev


def _share_cpu(device: torch.device, env) -> int:
    """CPU ranks on one host split its cores (two ranks each spinning threads on the same
    cores slow both down many times over); returns the previous thread count."""
    before = torch.get_num_threads()
    if device.type == "cpu":
        local = int(env.get("LOCAL_WORLD_SIZE", env.get("STRATA_LOCAL_WORLD", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
    return before


def _nx_code(nx: Numerics) -> int:
    return (nx.mode == "vendor") | (DTYPES.index(nx.act_dtype) << 1) | (nx.vendor_stale_index_k << 2)


def _nx_of(code: int) -> Numerics:
    return Numerics("vendor" if code & 1 else "reference", DTYPES[(code >> 1) & 1], bool(code & 4))


# ---- one rank's part -------------------------------------------------------------------------
class TPExecutor:
    """Tensor parallel: every rank runs every (transformed) layer; rank 0 also the head."""

    def __init__(self, model: Model, comm: Comm) -> None:
        self.m, self.comm = model, comm

    def forward(self, tokens, state, logits, nx, decoder_from=None):
        return self.m._forward(tokens, state, logits, nx, decoder_from, route=self)

    def enter(self, tokens, ctx, state):
        return self.m.enter(tokens, ctx, state)

    def leave(self, h, pre, rows, state, logits):
        return self.m.leave(h, pre, rows, state, logits) if self.comm.rank == 0 else None


def load_part(spec: ParallelSpec, cfg: ModelConfig, comm: Comm,
              split: tuple[tuple[int, int], ...] | None):
    """This rank's Model part and the executor that runs its share of a forward."""
    from strata.checkpoint.loader import TensorLoader
    rank, world, device = comm.rank, comm.world, comm.device
    mode = spec.numerics or ("vendor" if device.type == "cuda" else "reference")
    nx = Numerics.for_device(device, mode, spec.act_dtype, spec.vendor_stale_index_k)
    if spec.mode == "layer":
        part = ModelPart(layers=range(*split[rank]), embed=rank == 0, head=rank == 0)
    else:
        plan = TPPlan(rank, world, spec.tp_attention)
        part = ModelPart(embed=True, head=rank == 0, wrap_reader=sharding_reader(plan, cfg))
    if spec.synthetic is not None:
        from strata.bench.synthetic import build_synthetic
        model = build_synthetic(cfg, device, numerics=nx, part=part,
                                **_synthetic_options(spec, rank))[0]
    else:
        loader = TensorLoader(device, buffer_bytes=spec.buffer_bytes,
                              progress=spec.progress if rank == 0 else False)
        model = Model.load(spec.model_dir, device, nx, loader=loader, part=part,
                           **spec.load_options)
    if spec.mode == "layer":
        return model, LayerExecutor(model, comm, [range(*r) for r in split])
    apply_tp(model, comm, plan)
    return model, TPExecutor(model, comm)


def _ready(comm: Comm) -> None:
    """Every rank loaded (a rank that failed posted why and left: this raises with it)."""
    comm.all_gather(torch.ones(1, dtype=torch.int64, device=comm.device))


# ---- followers ---------------------------------------------------------------------------------
class Follower:
    """Runs rank 0's commands on this rank's part until SHUTDOWN."""

    def __init__(self, model: Model, comm: Comm, executor, graph_backend: str = "cuda") -> None:
        self.m, self.comm, self.executor = model, comm, executor
        self.graph_backend = GRAPH_BACKENDS[graph_backend]
        self.states: dict[int, State] = {}
        self.bookmarks: dict[int, Bookmark] = {}
        self.graphed: dict[int, GraphedForward] = {}  # a state's graphs

    def serve(self) -> None:
        try:
            self._serve()
        finally:  # (before the group is destroyed: see GraphedForward.release)
            for g in self.graphed.values():
                g.release()
            self.graphed.clear()

    def _serve(self) -> None:
        comm, dev = self.comm, self.comm.device
        buf = torch.empty(HEADER, dtype=torch.int64, device=dev)
        while True:
            hdr = comm.broadcast(buf, 0, idle=True).tolist()
            n, inline = hdr[0], hdr[1]
            for i in range(n):
                op, sid, a, b, c, d, e = hdr[2 + REC * i:2 + REC * (i + 1)]
                if op == Op.SHUTDOWN:
                    return
                if op == Op.FORWARD:
                    if inline > 0:
                        off = 2 + REC * n
                        host = torch.tensor(hdr[off:off + a], dtype=torch.long)
                        tokens = host.to(dev)
                    else:
                        tokens = comm.broadcast(torch.empty(a, dtype=torch.long, device=dev), 0)
                        host = None
                    self._forward(sid, tokens, LOGITS[b], _nx_of(c), d,
                                  d + (e >> 2) if e & 2 else None, bool(e & 1), host)
                else:
                    self._control(Op(op), sid, a)

    def _forward(self, sid: int, tokens: torch.Tensor, logits: str, nx: Numerics,
                 start: int, decoder_from: int | None, graphs: bool = False,
                 host: torch.Tensor | None = None) -> None:
        state = self.states[sid]
        if state.position != start:
            raise RuntimeError(f"state {sid} is at position {state.position} here but rank 0 "
                               f"forwards from {start}: the ranks' states diverged")
        t0 = time.perf_counter()
        if graphs:  # rank 0's decision (GraphedForward.usable holds here alike)
            g = self.graphed.get(sid)
            if g is None:
                g = self.graphed[sid] = GraphedForward(self.m, state, self.graph_backend(),
                                                       route=self.executor)
            # (the host's copy of the ids: checking them on the device would wait for it)
            g.run(host if host is not None else tokens.cpu(), logits)
            st = self.comm.stats
            st.forwards += 1
            st.forward_s += time.perf_counter() - t0
            return
        own = state.journal is None
        if own:
            state.begin()
        with torch.no_grad():  # (the host's copy where it came inline: no read back)
            self.executor.forward(host if host is not None else tokens, state, logits, nx,
                                  decoder_from)
        if own:
            state.commit()
        st = self.comm.stats
        st.forwards += 1
        st.forward_s += time.perf_counter() - t0

    def _control(self, op: Op, sid: int, a: int) -> None:
        s = self.states
        if op == Op.NEW_STATE:
            s[sid] = self.m.new_state(a)
        elif op == Op.FREE_STATE:
            s.pop(sid, None)
            g = self.graphed.pop(sid, None)
            if g is not None:
                g.release()
        elif op == Op.CLONE_STATE:
            s[a] = s[sid].clone()
        elif op == Op.BEGIN:
            s[sid].begin()
        elif op == Op.COMMIT:
            s[sid].commit()
        elif op == Op.ROLLBACK:
            s[sid].rollback(None if a < 0 else a)
        elif op == Op.TRUNCATE:
            s[sid].truncate(a)
        elif op == Op.BOOKMARK:
            self.bookmarks[a] = s[sid].bookmark()
        elif op == Op.RESTORE:
            s[sid].restore(self.bookmarks[a])
        elif op == Op.DROP_BOOKMARK:
            self.bookmarks.pop(a, None)
        elif op == Op.TIMING:
            self.comm.timing = bool(a)
        elif op == Op.STATS:
            _exchange_stats(self.comm, reset=bool(a))
        elif op == Op.MEMORY:
            _exchange_memory(self.comm, reset_peak=bool(a))
        else:
            raise RuntimeError(f"unknown command {op}")


def _exchange_stats(comm: Comm, reset: bool) -> list[list[float]]:
    mine = torch.tensor(comm.stats.as_list(), dtype=torch.float64, device=comm.device)
    every = comm.all_gather(mine).tolist()
    if reset:
        comm.stats = type(comm.stats)()
    return every


def _exchange_memory(comm: Comm, reset_peak: bool) -> list[DeviceMemory]:
    m = device_memory(comm.device, reset_peak)
    mine = torch.tensor([m.free, m.allocated, m.peak], dtype=torch.int64, device=comm.device)
    return [DeviceMemory(*row) for row in comm.all_gather(mine).tolist()]


def run_follower(spec: ParallelSpec, rv: Rendezvous, rank: int, local_rank: int) -> int:
    """A follower's whole life; returns the process exit status."""
    try:
        cfg = spec_config(spec)
        device = _device(spec.devices[rank], local_rank)
        _share_cpu(device, os.environ)
        comm = Comm(rv, rank, device)
    except Exception as e:  # noqa: BLE001
        print(f"strata: rank {rank}: cannot join the group: {e}", file=sys.stderr, flush=True)
        return 1
    code = 0
    try:
        model, executor = load_part(spec, cfg, comm, spec.split)
        _ready(comm)
        Follower(model, comm, executor, spec.graph_backend).serve()
    except ParallelError as e:
        msg = str(e) if str(e).startswith(f"rank {rank}:") else f"rank {rank}: {e}"
        print(f"strata: {msg}", file=sys.stderr, flush=True)
        code = EXIT_PEER_LOST
    except BaseException as e:  # noqa: BLE001 — report, tell the others, leave
        traceback.print_exc()
        comm.fail(f"{type(e).__name__}: {e}")
        print(f"strata: rank {rank}: failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        code = 1
    finally:
        comm.monitor.stop()
        if code == 0:
            comm.say_bye()
        comm.close()
    return code


def _dead_children(children) -> str | None:
    """Which launched ranks have exited, and how (for the error of a failed collective)."""
    import signal
    dead = []
    for k, p in enumerate(children, start=1):
        code = p.exitcode
        if code is None:
            continue
        how = (f"was killed by {signal.Signals(-code).name}" if code < 0
               else f"exited with status {code}")
        dead.append(f"rank {k} (pid {p.pid}) {how}")
    return "; ".join(dead) or None


def _child_main(spec: ParallelSpec, rv: Rendezvous, rank: int) -> None:
    """Entry point of a follower that launch() started as a local process."""
    import signal
    # Ctrl-C in a terminal reaches the whole process group: rank 0 handles it (a server
    # drains) and then shuts its followers down; a follower interrupted on its own would
    # only break the group under it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["STRATA_LOCAL_WORLD"] = str(rv.world)
    sys.exit(run_follower(spec, rv, rank, rank))


# ---- rank 0 ------------------------------------------------------------------------------------
class Driver:
    """Rank 0's side of the command protocol: queued state ops go out with the next forward."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.lock = threading.RLock()  # finalizers may queue from inside a send (same thread)
        self.pending: list[tuple[int, ...]] = []
        self.closed = False
        self._ids = itertools.count(1)

    def new_id(self) -> int:
        return next(self._ids)

    def queue(self, op: Op, sid: int = 0, a: int = 0) -> None:
        with self.lock:
            if not self.closed and self.comm.broken is None:
                self.pending.append((int(op), sid, a, 0, 0, 0, 0))

    def send(self, last: tuple[int, ...], tokens: list[int] | None = None) -> None:
        """Broadcast the queued records, then `last` (with its tokens)."""
        with self.lock:
            self.comm.check()
            recs, self.pending = self.pending + [last], []
            per = (HEADER - 2) // REC
            for i in range(0, len(recs), per):
                chunk = recs[i:i + per]
                words = [len(chunk), 0] + [w for r in chunk for w in r]
                separate = False
                if i + per >= len(recs) and tokens is not None:
                    if len(words) + len(tokens) <= HEADER:
                        words[1] = len(tokens)
                        words += tokens
                    else:
                        words[1], separate = -1, True
                words += [0] * (HEADER - len(words))
                self.comm.broadcast(torch.tensor(words, dtype=torch.int64,
                                                 device=self.comm.device), 0)
                if separate:
                    self.comm.broadcast(torch.tensor(tokens, dtype=torch.int64,
                                                     device=self.comm.device), 0)


class ParallelState(State):
    """Rank 0's State in a multi-device group: its own part of the caches, with every
    snapshot, rollback, truncation, bookmark and clone mirrored on the other ranks (applied
    here first, so an invalid one raises before anything is sent)."""

    _driver: Driver
    sid: int

    def _join(self, driver: Driver) -> None:
        self._driver, self.sid = driver, driver.new_id()
        weakref.finalize(self, driver.queue, Op.FREE_STATE, self.sid)

    def begin(self):
        j = super().begin()
        self._driver.queue(Op.BEGIN, self.sid)
        return j

    def commit(self) -> None:
        super().commit()
        self._driver.queue(Op.COMMIT, self.sid)

    def rollback(self, to: int | None = None) -> None:
        super().rollback(to)
        self._driver.queue(Op.ROLLBACK, self.sid, -1 if to is None else to)

    def truncate(self, to: int) -> None:
        super().truncate(to)
        self._driver.queue(Op.TRUNCATE, self.sid, to)

    def bookmark(self) -> Bookmark:
        bm = super().bookmark()
        bm.parallel_id = self._driver.new_id()
        self._driver.queue(Op.BOOKMARK, self.sid, bm.parallel_id)
        weakref.finalize(bm, self._driver.queue, Op.DROP_BOOKMARK, 0, bm.parallel_id)
        return bm

    def restore(self, bm: Bookmark) -> None:
        pid = getattr(bm, "parallel_id", None)
        if pid is None:
            raise ValueError("this bookmark was not taken on a state of this parallel group")
        super().restore(bm)
        self._driver.queue(Op.RESTORE, self.sid, pid)

    def clone(self) -> "ParallelState":
        other = super().clone()
        other.__class__ = ParallelState
        other._join(self._driver)
        self._driver.queue(Op.CLONE_STATE, self.sid, other.sid)
        return other


_ACTIVE: "set[ParallelModel]" = set()  # open groups this process leads (closed at exit)


class ParallelModel:
    """Rank 0's handle on the group, with Model's interface (forward, new_state, cfg, numerics,
    embed, head, dspark, ...): Session, the DSpark decoder, the engine and the benchmarks use
    it unchanged."""

    def __init__(self, model: Model, comm: Comm, executor, spec: ParallelSpec,
                 children: list) -> None:
        self.local, self.comm, self.executor, self.spec = model, comm, executor, spec
        self.mode, self.world = spec.mode, comm.world
        self.cfg, self.numerics, self.hasher = model.cfg, model.numerics, model.hasher
        self.device, self.part = model.device, model.part
        self.embed, self.head, self.norm, self.dspark = model.embed, model.head, model.norm, \
            model.dspark
        self.layers, self.engram_stores = model.layers, model.engram_stores
        self.draft_expert_cache = getattr(model, "draft_expert_cache", None)
        self.driver = Driver(comm)
        self._children = children
        self._closed = False
        self._threads = torch.get_num_threads()
        self._graphed: "weakref.WeakSet[GraphedGroup]" = weakref.WeakSet()
        _ACTIVE.add(self)

    def new_state(self, capacity: int) -> ParallelState:
        state = self.local.new_state(capacity)
        state.__class__ = ParallelState
        state._join(self.driver)
        self.driver.queue(Op.NEW_STATE, state.sid, capacity)
        return state

    def prefetch_engram(self, tokens: torch.Tensor, state: State) -> None:
        self.local.prefetch_engram(tokens, state)

    # The encoder-decoder shape comes from the config alone (Model's definitions).
    decoder_start = Model.decoder_start
    prefill_reach = Model.prefill_reach
    rows_from = Model.rows_from
    check_decoder_from = Model.check_decoder_from

    def graphed(self, state: State) -> "GraphedGroup":
        """Forwards on `state` replayed from CUDA graphs on every rank, kept on the state
        like Model.graphed's."""
        if state.graphs is None or state.graphs.model is not self:
            state.graphs = GraphedGroup(self, state)
            self._graphed.add(state.graphs)
        return state.graphs

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, state: State, logits: str = "all",
                numerics: Numerics | None = None, decoder_from: int | None = None,
                graphed: GraphedForward | None = None):
        """Model.forward over the group: (logits on rank 0, the forward's context);
        decoder_from as in Model.forward (the decoder-skipping prefill). `graphed` (rank 0's
        GraphedForward of `state`): where it can run, every rank replays its graph of the
        forward (captured together, collectives or hand-offs included)."""
        nx = numerics or self.numerics
        if not isinstance(state, ParallelState) or state._driver is not self.driver:
            raise ValueError("this state was not made by this parallel model's new_state()")
        if self.mode == "layer" and nx.vendor_stale_index_k:
            raise ConfigError("vendor_stale_index_k reads a later layer's index keys in an "
                              "earlier layer, across the layer split: use one device or tp")
        self.comm.check()
        host = tokens.detach().reshape(-1).cpu()
        tokens = self.local.check_forward(tokens, state, logits)
        self.check_decoder_from(state.position, tokens.numel(), logits, decoder_from)
        graphs = (graphed is not None and decoder_from is None and numerics is None
                  and graphed.usable())
        t0 = time.perf_counter()
        self.driver.send((int(Op.FORWARD), state.sid, tokens.numel(), LOGITS.index(logits),
                          _nx_code(nx), state.position,
                          int(graphs) | (decoder_from is not None) << 1
                          | (0 if decoder_from is None else decoder_from - state.position) << 2),
                         host.tolist())
        if graphs:
            # No journal of its own: a replay does not fail part-way (a lost peer breaks
            # the group, whose states are then gone anyway).
            out = graphed.run(host, logits)
            self.comm.wait_device()
            self._count(t0)
            return out
        own = state.journal is None
        if own:
            State.begin(state)  # this rank's own; the followers open theirs the same way
        try:
            out = self.executor.forward(tokens, state, logits, nx, decoder_from)
            self.comm.wait_device()  # (a dead peer raises here, not hangs the caller later)
        except BaseException as e:
            if own:
                State.rollback(state)
            if not isinstance(e, ParallelError):
                self.comm.fail(f"failed during a forward: {type(e).__name__}: {e}")
            raise
        if own:
            State.commit(state)
        self._count(t0)
        return out

    def _count(self, t0: float) -> None:
        st = self.comm.stats
        st.forwards += 1
        st.forward_s += time.perf_counter() - t0

    # ---- measurement -------------------------------------------------------------------------
    def set_timing(self, on: bool) -> None:
        """Synchronise the device around every collective on every rank (from the next
        forward), so comm time is the collectives' own: for the compute/communication split."""
        self.comm.timing = on
        self.driver.queue(Op.TIMING, 0, int(on))

    def stats(self, reset: bool = False) -> list[dict]:
        """Per rank: forwards, forward seconds, collectives, bytes and seconds in them."""
        self.driver.send((int(Op.STATS), 0, int(reset), 0, 0, 0, 0))
        rows = _exchange_stats(self.comm, reset)
        keys = ("forwards", "forward_s", "collectives", "bytes", "comm_s", "idle_s")
        return [dict(zip(keys, r), rank=k) for k, r in enumerate(rows)]

    def memory(self, reset_peak: bool = False) -> list[DeviceMemory]:
        """Every rank's device memory, in rank order (Model.memory's, gathered)."""
        self.driver.send((int(Op.MEMORY), 0, int(reset_peak), 0, 0, 0, 0))
        return _exchange_memory(self.comm, reset_peak)

    # ---- shutdown ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the followers and leave the group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        clean = self.comm.broken is None
        if clean:
            try:
                self.driver.send((int(Op.SHUTDOWN), 0, 0, 0, 0, 0, 0))
                clean = self.comm.wait_byes(30.0)
            except ParallelError:
                clean = False
        else:
            self.comm.fail(f"shutting the group down after: {self.comm.broken}")
            time.sleep(2 * self.comm.monitor.interval)  # let the followers read why
        with self.driver.lock:
            self.driver.closed = True
            self.driver.pending = []
        for g in list(self._graphed):  # (before the group is destroyed: see
            g.local.release()          # GraphedForward.release)
        self.comm.close()
        for p in self._children:
            p.join(timeout=15 if clean else 2)
            if p.is_alive():  # a broken group's follower that did not leave by itself
                p.kill()
                p.join(5)
        _ACTIVE.discard(self)
        torch.set_num_threads(self._threads)

    def __enter__(self) -> "ParallelModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class GraphedGroup:
    """A Session's graphs of one state over a group: rank 0's own GraphedForward, driven
    through ParallelModel.forward so that every rank captures and replays the same forwards
    together (each rank its own graph of its share, collectives or hand-offs inside)."""

    def __init__(self, model: ParallelModel, state: State) -> None:
        self.model = model
        self.local = GraphedForward(model.local, state, GRAPH_BACKENDS[model.spec.graph_backend](),
                                    route=model.executor)

    def forward(self, tokens: torch.Tensor, logits: str = "last", host_tokens=None):
        """`tokens` (host_tokens() where they are on the device: a group's forward takes
        them on the host) on every rank, each from its graphs."""
        if host_tokens is not None:
            tokens = host_tokens()
        return self.model.forward(tokens, self.local.state, logits, graphed=self.local)

    def __getattr__(self, name: str):  # captures, replays, capture_s: rank 0's counts
        return getattr(self.local, name)


def close_all() -> None:
    """Close every group this process leads (the CLI's exit path; also at interpreter exit)."""
    for m in list(_ACTIVE):
        m.close()


atexit.register(close_all)


def launch(spec: ParallelSpec, environ: dict | None = None) -> ParallelModel:
    """Start or join the group; load this rank's part.

    On rank 0, returns the ParallelModel. On any other rank of an environment-launched group
    (torchrun or the same command on each host), serves rank 0's commands until it shuts the
    group down, then exits the process (SystemExit)."""
    env = os.environ if environ is None else environ
    if spec.mode not in MODES:
        raise StrataError(f"parallel mode {spec.mode!r}: expected one of {', '.join(MODES)}")
    if spec.graph_backend not in GRAPH_BACKENDS:
        raise StrataError(f"graph backend {spec.graph_backend!r}: expected one of "
                          f"{', '.join(GRAPH_BACKENDS)}")
    devices = parse_devices(",".join(spec.devices))
    cfg = spec_config(spec)
    world = len(devices)
    if spec.mode == "tp":
        if spec.split:
            raise StrataError("--split is for --parallel layer")
        check_tp(cfg, world, spec.tp_attention)
        split = None
    else:
        split = (check_split(spec.split, cfg.n_layers, world) if spec.split
                 else plan_split(spec, cfg))
        if spec.vendor_stale_index_k:
            raise ConfigError("vendor_stale_index_k reads a later layer's index keys in an "
                              "earlier layer, across the layer split: use one device or tp")
    spec = replace(spec, split=split)
    backend = backend_for(torch.device(devices[0].split(":")[0]))
    children: list = []
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, n = int(env["RANK"]), int(env["WORLD_SIZE"])
        if n != world:
            raise StrataError(f"WORLD_SIZE={n} but --devices lists {world} devices (one per rank)")
        if "MASTER_PORT" not in env:
            raise StrataError("RANK/WORLD_SIZE are set but MASTER_PORT is not")
        rv = Rendezvous(env.get("MASTER_ADDR", "127.0.0.1"), int(env["MASTER_PORT"]), world,
                        backend, spec.peer_timeout,
                        host_store=env.get("TORCHELASTIC_USE_AGENT_STORE") != "True")
        local_rank = int(env.get("LOCAL_RANK", rank))
        if rank != 0:
            raise SystemExit(run_follower(spec, rv, rank, local_rank))
        store = None
    else:
        local_rank = 0
        rv0 = Rendezvous("127.0.0.1", 0, world, backend, spec.peer_timeout)
        store = connect_store(rv0, 0, master=True)
        rv = Rendezvous("127.0.0.1", store.port, world, backend, spec.peer_timeout)
        ctx = torch.multiprocessing.get_context("spawn")
        for k in range(1, world):
            p = ctx.Process(target=_child_main, args=(spec, rv, k), name=f"strata-rank-{k}")
            p.start()
            children.append(p)
            print(f"strata: rank {k} on {devices[k]} (pid {p.pid})", file=sys.stderr, flush=True)
    device = _device(devices[0], local_rank)
    threads = _share_cpu(device, env if children == [] else {"STRATA_LOCAL_WORLD": world})
    try:
        comm = Comm(rv, 0, device, store)
    except BaseException:
        for p in children:
            p.kill()
        torch.set_num_threads(threads)
        raise
    if children:
        comm.peer_report = lambda: _dead_children(children)
    try:
        model, executor = load_part(spec, cfg, comm, split)
        _ready(comm)
    except BaseException as e:
        if not isinstance(e, ParallelError):
            comm.fail(f"failed while loading: {type(e).__name__}: {e}")
        time.sleep(2 * comm.monitor.interval)
        comm.close()
        for p in children:
            p.join(5)
            if p.is_alive():
                p.terminate()
        torch.set_num_threads(threads)
        raise
    pm = ParallelModel(model, comm, executor, spec, children)
    pm._threads = threads
    return pm
