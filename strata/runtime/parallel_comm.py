"""The process group of a multi-device run: joining it, the few collectives the parallel modes
use, and failure detection (runtime/parallel.py builds on this).

One process per device over torch.distributed: NCCL between GPUs, gloo between CPU processes.
Rank 0 hosts the rendezvous store (a TCPStore at MASTER_ADDR:MASTER_PORT, or a free port when
strata launches the ranks itself); every rank joins through it, so the same code spans hosts.

Failure handling. A collective blocked on a peer that died must not hang the others:
- gloo reports a closed connection at once (a killed process on any host whose kernel is up);
- every rank runs a heartbeat thread on the store: it bumps its own counter each interval and
  watches the others'. A counter that stops moving for `peer_timeout` seconds (a dead host, a
  hung or stopped process, a GPU stuck in a collective under NCCL), an error a rank posted
  (`strata/abort`) or losing the store (rank 0, which hosts it, is gone) is a failure;
- on a failure a follower prints why and exits (status 75); rank 0 aborts the process group so
  the blocked collective returns with an error, and exits itself if it is still blocked after a
  grace period. Every later call raises ParallelError with the first reason seen;
- an NCCL collective returns before it runs, so rank 0 is not blocked in it but in whatever
  next waits for the GPU: each forward ends waiting for its GPU work in a loop that watches
  the heartbeat (Comm.wait_device), which aborts the group and raises.
The process group's own timeout is set far out: an idle server's followers wait for the next
command indefinitely, and liveness is the heartbeat's job, not the collectives'.
"""
from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from strata.errors import StrataError

EXIT_PEER_LOST = 75
PG_TIMEOUT = datetime.timedelta(days=7)
ABORT_KEY = "strata/abort"


class ParallelError(StrataError):
    """A rank of the multi-device group failed or is gone; the group cannot continue."""


@dataclass(frozen=True)
class Rendezvous:
    """Where and how the ranks meet (picklable: launched ranks receive it)."""

    addr: str
    port: int
    world: int
    backend: str            # "nccl" | "gloo"
    peer_timeout: float     # seconds without a heartbeat before a peer counts as gone
    host_store: bool = True  # rank 0 creates the store (False: a launcher's agent hosts it)


@dataclass
class CommStats:
    """What this rank spent in collectives (and forwards) since the last reset."""

    ops: int = 0
    bytes: int = 0
    comm_s: float = 0.0      # inside collectives (a follower's wait for the next command: idle_s)
    idle_s: float = 0.0
    forwards: int = 0
    forward_s: float = 0.0
    by_op: dict[str, int] = field(default_factory=dict)

    def as_list(self) -> list[float]:
        return [self.forwards, self.forward_s, self.ops, self.bytes, self.comm_s, self.idle_s]


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def connect_store(rv: Rendezvous, rank: int, master: bool) -> dist.TCPStore:
    timeout = datetime.timedelta(seconds=max(30.0, rv.peer_timeout))
    if master:
        return dist.TCPStore(rv.addr, rv.port, rv.world, is_master=True, timeout=timeout,
                             wait_for_workers=False)
    try:
        return dist.TCPStore(rv.addr, rv.port, rv.world, is_master=False, timeout=timeout)
    except Exception as e:  # noqa: BLE001 (torch raises several types here)
        raise ParallelError(f"rank {rank}: cannot reach the rendezvous store at "
                            f"{rv.addr}:{rv.port} (rank 0 hosts it): {e}") from None


class Monitor(threading.Thread):
    """Heartbeats on the store; calls on_failure(reason) once when a peer is gone."""

    def __init__(self, rv: Rendezvous, rank: int, on_failure) -> None:
        super().__init__(name=f"strata-heartbeat-{rank}", daemon=True)
        self.rv, self.rank, self.on_failure = rv, rank, on_failure
        self.interval = max(0.05, min(1.0, rv.peer_timeout / 5))
        self.failure: str | None = None
        self._stop_event = threading.Event()
        self._store: dist.TCPStore | None = None
        self._lock = threading.Lock()

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=5 * self.interval + 1)

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
        self.on_failure(reason)

    def run(self) -> None:
        rv, me = self.rv, self.rank
        try:
            self._store = store = connect_store(rv, me, master=False)
        except ParallelError as e:
            self._fail(str(e))
            return
        others = [k for k in range(rv.world) if k != me]
        seen = {k: (-1, time.monotonic()) for k in others}
        while not self._stop_event.wait(self.interval):
            try:
                store.add(f"strata/hb/{me}", 1)
                if store.check([ABORT_KEY]):
                    self._fail(store.get(ABORT_KEY).decode(errors="replace"))
                    return
                now = time.monotonic()
                for k in others:
                    v = store.add(f"strata/hb/{k}", 0)
                    if v != seen[k][0]:
                        seen[k] = (v, now)
                    elif now - seen[k][1] > rv.peer_timeout \
                            and not store.check([f"strata/bye/{k}"]):
                        self._fail(f"rank {k} stopped responding (no heartbeat for "
                                   f"{rv.peer_timeout:g} s: the process or its host is gone "
                                   "or hung)")
                        return
            except Exception as e:  # noqa: BLE001
                if self._stop_event.is_set():
                    return
                self._fail(f"lost the rendezvous store at {rv.addr}:{rv.port}, which rank 0 "
                           f"hosts: rank 0 is gone ({type(e).__name__}: {e})")
                return


class Comm:
    """This process's membership of the group and the collectives the modes use.

    Every collective goes through `_op`: it refuses to start on a broken group, counts bytes and
    time (with `timing`, the device is synchronised around each one, so the time is the
    collective's own and compute before it is not counted), and turns a failure into
    ParallelError with the clearest reason known (a peer's posted error, the heartbeat's
    finding, or the backend's message).
    """

    def __init__(self, rv: Rendezvous, rank: int, device: torch.device,
                 store: dist.TCPStore | None = None) -> None:
        self.rv, self.rank, self.world, self.device = rv, rank, rv.world, device
        self.grace_s = max(2.0, rv.peer_timeout)
        # Set by a launcher that knows its ranks' processes: () -> "rank 1 (pid N) was killed
        # by SIGKILL" or None; the clearest reason when a collective fails.
        self.peer_report = None
        self.timing = False
        self.stats = CommStats()
        self.broken: str | None = None
        self._in_op = False
        if store is None:
            store = connect_store(rv, rank, master=(rank == 0 and rv.host_store))
        self.store = store
        if device.type == "cuda":
            torch.cuda.set_device(device)
        kw = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(rv.backend, store=dist.PrefixStore("strata/pg", store),
                                rank=rank, world_size=rv.world, timeout=PG_TIMEOUT, **kw)
        self.monitor = Monitor(rv, rank, self._on_failure)
        self.monitor.start()

    # ---- failures ---------------------------------------------------------------------------
    def _on_failure(self, reason: str) -> None:
        """Heartbeat thread: a peer is gone."""
        if self.broken is None:
            self.broken = reason
        if self.rank != 0:
            print(f"strata: rank {self.rank}: {reason}; exiting", file=sys.stderr, flush=True)
            os._exit(EXIT_PEER_LOST)
        # Abort now, busy or idle: a forward may be waiting on the device behind a collective
        # that will never finish (a host read of a result, not only wait_device), and only the
        # abort returns it. The group is unusable from here; rank 0's next call raises.
        self._abort_pg()
        deadline = time.monotonic() + self.grace_s
        while self._in_op and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._in_op:
            print(f"strata: rank 0: {reason}; a collective is still blocked after "
                  f"{self.grace_s:g} s, exiting", file=sys.stderr, flush=True)
            os._exit(EXIT_PEER_LOST)

    def _abort_pg(self) -> None:
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # noqa: BLE001 — not every backend/version can abort
            pass

    def _posted(self) -> str | None:
        """A failure a rank posted, or the store's own absence (rank 0 hosts it)."""
        try:
            if self.store.check([ABORT_KEY]):
                return self.store.get(ABORT_KEY).decode(errors="replace")
        except Exception:  # noqa: BLE001
            if self.rank != 0:
                return (f"rank 0 is gone (its rendezvous store at {self.rv.addr}:{self.rv.port} "
                        "does not answer)")
        return None

    def _reason(self, e: Exception) -> str:
        report = self.peer_report() if self.peer_report is not None else None
        return self._posted() or report or self.monitor.failure or f"{type(e).__name__}: {e}"

    def _post(self, reason: str) -> None:
        """Tell the other ranks this one failed (their heartbeat stops them with this reason)."""
        try:
            if not self.store.check([ABORT_KEY]):
                self.store.set(ABORT_KEY, reason)
        except Exception:  # noqa: BLE001 — the store is gone too: the peers notice that
            pass

    def fail(self, reason: str) -> None:
        """This rank cannot go on: mark the group broken and tell the others."""
        if self.broken is None:
            self.broken = reason
        self._post(f"rank {self.rank}: {reason}")

    def check(self) -> None:
        if self.broken is None and self.monitor.failure is not None:
            self.broken = self.monitor.failure
        if self.broken is not None:
            raise ParallelError(f"the parallel group is broken: {self.broken}")

    def wait_device(self) -> None:
        """Wait for this rank's queued GPU work (its collectives with it) while watching the
        group. NCCL collectives return at once and run on the GPU; a peer that died leaves
        one waiting forever, and a plain synchronize (sampling reading the logits) would wait
        with it, out of the heartbeat's reach. Here a failure the heartbeat finds aborts the
        group (the stuck kernel returns) and raises ParallelError."""
        if self.device.type != "cuda":
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        t0 = time.monotonic()
        while not done.query():
            if self.monitor.failure is not None or self.broken is not None:
                self._abort_pg()
                self.check()
            # Yield the GIL (the heartbeat thread needs it); past 2 ms, sleep between polls.
            time.sleep(0 if time.monotonic() - t0 < 2e-3 else 1e-4)

    # ---- collectives --------------------------------------------------------------------------
    def _op(self, name: str, nbytes: int, fn, idle: bool = False) -> None:
        self.check()
        sync = self.timing and self.device.type == "cuda"
        if sync:
            torch.cuda.synchronize(self.device)
        self._in_op = True
        t0 = time.perf_counter()
        try:
            fn()
            if sync:
                torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001 — DistBackendError, RuntimeError, ...
            time.sleep(0.2)  # let a dying peer post its reason, or the heartbeat see it
            reason = self._reason(e)
            if self.broken is None:
                self.broken = f"{name} failed on rank {self.rank}: {reason}"
            self._post(f"rank {self.rank}: {name} failed: {reason}")
            raise ParallelError(f"rank {self.rank}: {name} failed: {reason}") from None
        finally:
            self._in_op = False
        s = self.stats
        if idle:
            s.idle_s += time.perf_counter() - t0
        else:
            s.comm_s += time.perf_counter() - t0
        s.ops += 1
        s.bytes += nbytes
        s.by_op[name] = s.by_op.get(name, 0) + 1

    def broadcast(self, t: torch.Tensor, src: int = 0, idle: bool = False) -> torch.Tensor:
        """`idle`: a follower waiting for rank 0's next command (timed as idle, not comm)."""
        self._op("broadcast", t.numel() * t.element_size(), lambda: dist.broadcast(t, src), idle)
        return t

    def send(self, t: torch.Tensor, dst: int) -> None:
        self._op("send", t.numel() * t.element_size(), lambda: dist.send(t, dst))

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        self._op("recv", t.numel() * t.element_size(), lambda: dist.recv(t, src))
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[world, *t.shape]: every rank's t, in rank order (one collective)."""
        flat = t.contiguous().view(-1)
        out = torch.empty((self.world * flat.numel(),), dtype=t.dtype, device=t.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._op("all_gather", out.numel() * out.element_size(), lambda: gather(out, flat))
        return out.view(self.world, *t.shape)

    # ---- shutdown -----------------------------------------------------------------------------
    def say_bye(self) -> None:
        try:
            self.store.set(f"strata/bye/{self.rank}", "1")
        except Exception:  # noqa: BLE001
            pass

    def wait_byes(self, timeout_s: float) -> bool:
        """Rank 0: wait until every follower said it is leaving (it keeps the store up)."""
        keys = [f"strata/bye/{k}" for k in range(1, self.world)]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.store.check(keys):
                    return True
            except Exception:  # noqa: BLE001
                return False
            time.sleep(0.02)
        return False

    def close(self) -> None:
        self.monitor.stop()
        if self.broken is not None:
            self._abort_pg()
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
