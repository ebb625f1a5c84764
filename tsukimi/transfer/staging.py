"""Staging: pinned host chunks that device bytes pass through on their way to or from a
socket, and the threads that copy them.

A host-only transport (tcp) cannot send from or receive into device memory, so device bytes
are staged: a WRITE copies a chunk device->host, then sends it; a READ receives into a chunk,
then copies it host->device. Chunks are cut from one anonymous mapping, allocated on first use
and pinned (backend.pin: page-locked, so the copies run at DMA speed) once per kind of device
that used them. With several chunks, one is on the socket while the next is being copied
(double buffering); the copies run on the pool's own threads (`copies`), whose jobs never wait
for a chunk, so releasing chunks always makes progress.

    initiator (transports/staged.py)          segment server (server.py)
    WRITE: to_host(chunk) -> send             recv(chunk) -> from_host (on `copies`)
    READ:  recv(chunk) -> from_host           to_host(chunk) (on `copies`) -> send
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tsukimi.device import pin_or_warn
from tsukimi.errors import ClosedError, RpcTimeout

logger = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20
NUM_COPY_THREADS = 2


class StagingPool:
    """`num_chunks` pinned chunks of `chunk_bytes` (allocated on first use) and the copy
    threads. Thread-safe; close() when done."""

    def __init__(self, name: str, num_chunks: int = 4, chunk_bytes: int = CHUNK_BYTES) -> None:
        assert num_chunks >= 2, "double buffering needs two chunks"
        self.name, self.num_chunks, self.chunk_bytes = name, num_chunks, chunk_bytes
        self._lock = threading.Lock()
        self._mm: mmap.mmap | None = None
        self._chunks: list[memoryview] = []
        self._free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
        self._unpins: dict[str, Callable[[], None]] = {}  # device kind -> its unpin
        self._closed = False
        self.copies = ThreadPoolExecutor(NUM_COPY_THREADS, thread_name_prefix=f"tsukimi-{name}")

    def acquire(self, kind: str, timeout_s: float) -> memoryview:
        """A free chunk, pinned for devices of `kind` (allocates and pins on first use). Mutates.

        Raises:
            RpcTimeout: none came free within `timeout_s`.
            ClosedError: the pool is closed.
            DeviceError: pinning failed.
        """
        if self._closed:
            raise ClosedError(f"{self.name} staging is closed")
        if kind not in self._unpins:
            self._prepare(kind)
        try:
            return self._free.get(timeout=max(0.0, timeout_s))
        except queue.Empty:
            raise RpcTimeout(f"no {self.name} chunk came free within {timeout_s:.2f} s") from None

    def release(self, chunk: memoryview) -> None:
        """Give a chunk back (mutates)."""
        self._free.put(chunk)

    def _prepare(self, kind: str) -> None:
        with self._lock:
            if self._closed:
                raise ClosedError(f"{self.name} staging is closed")
            if self._mm is None:
                self._mm = mmap.mmap(-1, self.num_chunks * self.chunk_bytes)
                whole = memoryview(self._mm)
                self._chunks = [
                    whole[i * self.chunk_bytes : (i + 1) * self.chunk_bytes] for i in range(self.num_chunks)
                ]
                whole.release()
                for chunk in self._chunks:
                    self._free.put(chunk)
            if kind not in self._unpins:
                with memoryview(self._mm) as whole:
                    self._unpins[kind] = pin_or_warn(kind, whole, f"{self.name} staging")

    def close(self) -> None:
        """Stop the copy threads (after their jobs), unpin and free the chunks. Mutates."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.copies.shutdown(wait=True)
        for unpin in self._unpins.values():
            unpin()
        self._chunks = []
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # a chunk still lent out: the GC unmaps it
                self._mm.close()
