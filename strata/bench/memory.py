"""This process's resident memory from /proc/self/status (Linux): what the benchmarks and the
bounded-memory tests report."""
from __future__ import annotations

import threading
import time


def proc_status(key: str) -> int:
    """A /proc/self/status size field (VmRSS, VmHWM, ...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


class PeakRss:
    """`with PeakRss() as p: ...` → p.over: the peak resident bytes inside the block above the
    resident bytes at its start. The kernel's high-water mark (VmHWM) is reset on entry through
    /proc/self/clear_refs; where that is refused, a thread samples VmRSS every 0.5 ms instead."""

    def __init__(self) -> None:
        self.baseline = self.over = 0
        self._sampled = 0
        self._hwm = False
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._done.is_set():
            self._sampled = max(self._sampled, proc_status("VmRSS"))
            time.sleep(0.0005)

    def __enter__(self) -> "PeakRss":
        self.baseline = proc_status("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := current RSS
            self._hwm = True
        except OSError:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._done.set()
            self._thread.join()
        peak = proc_status("VmHWM") if self._hwm else self._sampled
        self.over = max(peak, proc_status("VmRSS")) - self.baseline
