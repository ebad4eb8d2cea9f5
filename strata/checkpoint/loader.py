"""Stream tensors from disk to their device through a fixed pool of host staging buffers.

Why: the reference box has 48 GB of RAM for a ~300 GB fp4/fp8 backbone, so no shard (and no
whole-model host copy) may ever sit in RAM. Each tensor is read with positional reads straight
into one of a few staging buffers (pinned when the target is a CUDA device, so the copy is a
DMA that can run while the next read proceeds) and copied from there into the tensor's final
home. A tensor larger than one buffer goes through in pieces.

Pipeline: one reader thread fills buffer k+1 while the calling thread copies buffer k.
- CUDA target: copies are issued `non_blocking` from pinned memory on the current stream and an
  event is recorded per buffer; a buffer is reused only after its event has completed, so the
  reads of the next tensor overlap the copies of this one.
- CPU target: the copy is a plain memcpy. The tensor's final home IS host memory there, so the
  bound this loader gives is on staging overhead *beyond the weights themselves*: peak RSS ≈
  baseline + bytes of weights kept + the pool (+ small metadata).

Host memory bound: `buffer_bytes × n_buffers` (default 4 × 256 MiB = 1 GiB), allocated lazily
(a buffer is created only when all existing ones are busy) and freed by `close()`. The loader
never keeps a reference to a loaded tensor.
"""
from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from strata.checkpoint.safetensors_io import (ST_DTYPES, ClosedOnExit, TensorInfo, _byte_view,
                                              _pread_exact)
from strata.errors import CheckpointError

DEFAULT_BUFFER_BYTES = 256 << 20
DEFAULT_N_BUFFERS = 4


class _Buffer:
    """One staging buffer and the event of the last copy out of it (CUDA only)."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.data = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.view = _byte_view(self.data)
        self.event: torch.cuda.Event | None = None

    def wait_reusable(self) -> None:
        # The DMA reading this buffer must finish before the reader overwrites it.
        if self.event is not None:
            self.event.synchronize()
            self.event = None


class TensorLoader(ClosedOnExit):
    """Loads checkpoint tensors (by TensorInfo) onto one device through bounded staging.

    `progress`: True shows a tqdm bar (bytes, GB/s) on stderr, False never, None only when
    stderr is a terminal. `total_bytes` sets the bar's length when the caller knows it.
    One thread calls `load` (the model is built by one thread); the reader thread is internal.
    """

    def __init__(self, device: torch.device | str = "cpu", *,
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES, n_buffers: int = DEFAULT_N_BUFFERS,
                 progress: bool | None = False, total_bytes: int | None = None,
                 desc: str = "loading") -> None:
        if buffer_bytes < 4096 or n_buffers < 1:
            raise ValueError(f"staging pool of {n_buffers} × {buffer_bytes} bytes: need at least "
                             "one buffer of ≥ 4096 bytes")
        self.device = torch.device(device)
        self.buffer_bytes, self.n_buffers = int(buffer_bytes), int(n_buffers)
        # Pinned memory only helps (and only exists) for copies to a CUDA device.
        self.pin = self.device.type == "cuda" and torch.cuda.is_available()
        self._buffers: list[_Buffer] = []
        # FIFO, so the buffer handed out next is the one whose copy was issued longest ago.
        self._free: deque[_Buffer] = deque()
        self._fds: dict[Path, int] = {}
        self._reader: ThreadPoolExecutor | None = None
        self.bytes_loaded = 0
        self.tensors_loaded = 0
        self._progress, self._total, self._desc = progress, total_bytes, desc
        self._bar = None

    @property
    def pool_bytes(self) -> int:
        """The most host memory the staging pool can take."""
        return self.buffer_bytes * self.n_buffers

    # ------------------------------------------------------------------ public
    def load(self, info: TensorInfo) -> torch.Tensor:
        """A new tensor on the loader's device holding the stored bytes of `info`."""
        if info.dtype not in ST_DTYPES:
            raise CheckpointError(f"{info.file}: tensor {info.name!r}: unknown dtype {info.dtype!r}")
        out = torch.empty(info.shape, dtype=ST_DTYPES[info.dtype][0], device=self.device)
        self.load_into(info, out)
        return out

    def load_into(self, info: TensorInfo, out: torch.Tensor) -> torch.Tensor:
        """Stream the stored bytes of `info` into `out` (contiguous, same byte size, any device)."""
        nbytes = out.numel() * out.element_size()
        if not out.is_contiguous() or nbytes != info.nbytes:
            raise CheckpointError(f"{info.file}: tensor {info.name!r}: destination holds {nbytes} "
                                  f"bytes (contiguous: {out.is_contiguous()}), tensor has "
                                  f"{info.nbytes}")
        if nbytes == 0 or out.device.type == "meta":
            return out  # (meta: a dry run checks names, dtypes and shapes; nothing is read)
        dest = out.reshape(-1).view(torch.uint8)
        fd = self._fd(info.file)
        reader = self._reader_pool()
        pending: deque[tuple[Future, _Buffer, int, int]] = deque()
        try:
            for start in range(0, nbytes, self.buffer_bytes):
                n = min(self.buffer_bytes, nbytes - start)
                buf = self._free.popleft() if self._free else self._new_buffer()
                if buf is None:  # every buffer is in flight: finish the oldest piece first
                    self._finish(pending.popleft(), dest)
                    buf = self._free.popleft()
                pending.append((reader.submit(self._read, buf, fd, info, start, n), buf, start, n))
            while pending:
                self._finish(pending.popleft(), dest)
        except BaseException:
            # Wait for reads still in flight so that no buffer is written after we return,
            # and give every buffer back to the pool (the next load must not deadlock).
            for fut, buf, _, _ in pending:
                try:
                    fut.result()
                except BaseException:
                    pass
                self._free.append(buf)
            raise
        # CUDA: no host wait here. Later work on the destination GPU's current stream is
        # ordered after these copies, and the next tensor's reads overlap them.
        self.tensors_loaded += 1
        return out

    def close(self) -> None:
        """Free the staging buffers, stop the reader thread and close the files."""
        for buf in self._buffers:
            buf.wait_reusable()
        self._buffers.clear()
        self._free.clear()
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    # ----------------------------------------------------------------- helpers
    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(f"{path}: cannot open checkpoint file: {e}") from e
            self._fds[path] = fd
        return fd

    def _reader_pool(self) -> ThreadPoolExecutor:
        # One reader thread: reads stay sequential within a file (what disks like best).
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-load")
        return self._reader

    def _new_buffer(self) -> _Buffer | None:
        if len(self._buffers) >= self.n_buffers:
            return None
        buf = _Buffer(self.buffer_bytes, self.pin)
        self._buffers.append(buf)
        return buf

    @staticmethod
    def _read(buf: _Buffer, fd: int, info: TensorInfo, start: int, n: int) -> None:
        """Reader thread: fill `buf` with bytes [start, start+n) of the tensor."""
        buf.wait_reusable()
        what = f"tensor {info.name!r}" if start == 0 and n == info.nbytes else \
            f"bytes {start}..{start + n} of tensor {info.name!r}"
        _pread_exact(fd, buf.view[:n], info.offset + start, info.file, what)

    def _finish(self, item: tuple[Future, _Buffer, int, int], dest: torch.Tensor) -> None:
        """Calling thread: copy a filled buffer into the destination and recycle it."""
        fut, buf, start, n = item
        try:
            fut.result()  # re-raises the reader's CheckpointError (truncated file, ...)
            if self.device.type == "cuda":
                dest[start:start + n].copy_(buf.data[:n], non_blocking=self.pin)
                # The copy runs on the destination GPU's current stream, which need not be
                # the current device's: record there, or the buffer is refilled mid-DMA.
                buf.event = torch.cuda.Event()
                buf.event.record(torch.cuda.current_stream(dest.device))
            else:
                dest[start:start + n].copy_(buf.data[:n])
        finally:
            self._free.append(buf)
        self.bytes_loaded += n
        self._tick(n)

    def _tick(self, n: int) -> None:
        if self._progress is False:
            return
        if self._bar is None:
            from tqdm import tqdm
            self._bar = tqdm(total=self._total, unit="B", unit_scale=True, unit_divisor=1000,
                             desc=self._desc, disable=None if self._progress is None else False,
                             dynamic_ncols=True)
        self._bar.update(n)
