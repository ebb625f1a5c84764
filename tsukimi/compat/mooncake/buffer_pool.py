"""`mooncake.buffer_pool` (and `mooncake.store.BufferPool`): host buffers registered with a
store, leased by size and given back, so zero-copy puts and gets (`put_from`, `get_into`)
need not register memory per call.

    pool = BufferPool(store)                    # store: a set-up MooncakeDistributedStore
    with pool.buffer(4096) as lease:            # lease.ptr, lease.size, lease.buffer (memoryview)
        lease.buffer[:5] = b"hello"
        store.put_from("k", lease.ptr, 5)

How the pool lays memory out (tsukimi's own; the wheel's is not observable):

    size class = max(min_size_class, next power of two >= size), 64-byte aligned slots
    region     = one anonymous mapping of max(alignment, class) bytes, registered with the
                 store once, cut into slots of one class; kept until close()

Answers follow the wheel's (0.3.13.post1, probed): a lease's `size` is the size asked for;
`release()` is idempotent, and refuses (RuntimeError) while the memoryview from `buffer` is
still referenced; after it `ptr` and `buffer` raise "buffer lease is closed" (`size` still
reads); leaving a `with` block releases; `close()` refuses while leases are out. A store
that is not set up, or not a store, is a RuntimeError at construction.

Limits: `max_bytes` (0: none) and `max_regions` (None: none) cap the mapped memory; a lease
that cannot be had waits for a release when blocking (`block`, else `block_on_exhaustion`)
for up to `timeout` (else `default_timeout`; None waits forever), else RuntimeError. The
wheel served a 2 MiB lease from a pool with `max_bytes` 1 MiB in our probes, so its caps
mean something else there; tsukimi's are the plain reading.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import sys
import threading
import time
from typing import Protocol

__all__ = ["BufferLease", "BufferLeaseView", "BufferPool", "RegisteredBufferPool"]

logger = logging.getLogger(__name__)

_SLOT_ALIGN = 64
_NOT_A_STORE = "BufferPool store parameter must be a PyClient or store wrapper that implements _get_pyclient_capsule()"


class PoolStore(Protocol):
    """What a pool needs of its store (the facade's MooncakeDistributedStore)."""

    def register_buffer(self, buffer_ptr: int, size: int) -> int: ...
    def unregister_buffer(self, buffer_ptr: int) -> int: ...
    def health_check(self) -> int: ...


class BufferLease:
    """One leased slot: `ptr`, `size`, `buffer`; `release()` (or leaving `with`) gives it back."""

    __slots__ = ("_pool", "_ptr", "_size", "_slot_class", "_view")
    _pool: BufferPool | None
    _ptr: int
    _size: int
    _slot_class: int
    _view: memoryview | None

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError("mooncake.store.BufferLease: No constructor defined!")

    @classmethod
    def _lease(cls, pool: BufferPool, ptr: int, size: int, slot_class: int) -> BufferLease:
        lease = cls.__new__(cls)
        lease._pool, lease._ptr, lease._size, lease._slot_class = pool, ptr, size, slot_class
        lease._view = None
        return lease

    @property
    def ptr(self) -> int:
        self._open()
        return self._ptr

    @property
    def size(self) -> int:
        return self._size

    @property
    def buffer(self) -> memoryview:
        """A writable memoryview of the lease's `size` bytes (the same object each time)."""
        pool = self._open()
        if self._view is None:
            self._view = pool._view(self._ptr, self._size)
        return self._view

    def release(self) -> None:
        """Give the slot back (idempotent; mutates the pool).

        Raises:
            RuntimeError: the memoryview from `buffer` is still referenced elsewhere.
        """
        if self._pool is None:
            return
        view = self._view
        if view is not None:
            try:
                # NOTE: 3 = our attribute, the local, getrefcount's argument: more is the caller's
                if sys.getrefcount(view) > 3:
                    raise BufferError
                view.release()
            except BufferError:
                raise RuntimeError("cannot release buffer while exported views exist") from None
        pool, self._pool, self._view = self._pool, None, None
        pool._give_back(self._slot_class, self._ptr)

    def __enter__(self) -> BufferLease:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.release()

    def _open(self) -> BufferPool:
        if self._pool is None:
            raise RuntimeError("buffer lease is closed")
        return self._pool


class BufferLeaseView:
    """`mooncake.store.BufferLeaseView`: the wheel binds it without a constructor; so here."""

    __slots__ = ("_buffer",)
    _buffer: memoryview

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError("mooncake.store.BufferLeaseView: No constructor defined!")

    @property
    def buffer(self) -> memoryview:
        return self._buffer


class BufferPool:
    """Size-classed slots in registered regions (see the module); thread-safe."""

    def __init__(
        self,
        store: object,
        max_bytes: int = 0,
        min_size_class: int = 65536,
        max_size_class: int | None = None,
        alignment: int = 8388608,
        block_on_exhaustion: bool = True,
        default_timeout: float | None = None,
        max_regions: int | None = None,
        prewarm_size: int | None = None,
        prewarm_count: int = 0,
    ) -> None:
        """Raises:
        RuntimeError: `store` is not a store, or not set up.
        TypeError: a size or limit of the wrong type (as the wheel's bindings)."""
        if not all(callable(getattr(store, name, None)) for name in ("register_buffer", "unregister_buffer")):
            raise RuntimeError(_NOT_A_STORE)
        self._store: PoolStore = store  # type: ignore[assignment]
        if self._store.health_check() == 1:
            raise RuntimeError("MooncakeDistributedStore is not initialized")
        for name, value in (("max_bytes", max_bytes), ("min_size_class", min_size_class), ("alignment", alignment)):
            _size(name, value)
        self._max_bytes = max_bytes
        self._min_class = max(_SLOT_ALIGN, min_size_class)
        self._max_class = None if max_size_class is None else _size("max_size_class", max_size_class)
        self._alignment = max(mmap.PAGESIZE, alignment)
        self._block = block_on_exhaustion
        self._timeout = default_timeout
        self._max_regions = max_regions
        self._cond = threading.Condition()
        self._regions: list[mmap.mmap] = []
        self._bases: list[int] = []  # NOTE: sorted region addresses, to find a slot's region
        self._mapped_bytes = 0
        self._free: dict[int, list[int]] = {}
        self._out = 0
        self._closed = False
        if prewarm_size is not None and prewarm_count:
            self.prewarm(prewarm_size, prewarm_count)

    def acquire(self, size: int, block: bool | None = None, timeout: float | None = None) -> BufferLease:
        """A lease of `size` bytes (mutates the pool).

        Raises:
            TypeError: `size` is not a non-negative int.
            RuntimeError: the pool is closed, `size` can never fit (`max_bytes`), or no slot
                came free in time (or at once, not blocking).
        """
        slot_class = self._class_of(_size("size", size))
        wait = self._block if block is None else bool(block)
        limit = timeout if timeout is not None else self._timeout
        deadline = None if limit is None else time.monotonic() + float(limit)
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("buffer pool is closed")
                ptr = self._take(slot_class)
                if ptr is not None:
                    self._out += 1
                    return BufferLease._lease(self, ptr, size, slot_class)
                left = None if deadline is None else deadline - time.monotonic()
                if not wait or (left is not None and left <= 0):
                    raise RuntimeError("buffer pool exhausted: no free buffer of the requested size")
                self._cond.wait(left)

    def buffer(self, size: int, block: bool | None = None, timeout: float | None = None) -> BufferLease:
        """`acquire`, named for `with pool.buffer(n) as lease:`."""
        return self.acquire(size, block, timeout)

    def prewarm(self, size: int, count: int) -> None:
        """Map (and register) room for `count` leases of `size` bytes now (mutates the pool)."""
        slot_class = self._class_of(_size("size", size))
        with self._cond:
            while len(self._free.get(slot_class, ())) < _size("count", count):
                if not self._map(slot_class):
                    raise RuntimeError("buffer pool exhausted while prewarming")

    def close(self) -> None:
        """Unregister and unmap every region (idempotent).

        Raises:
            RuntimeError: leases are still out.
        """
        with self._cond:
            if self._out:
                raise RuntimeError("cannot close buffer pool with active leases")
            self._closed = True
            regions, self._regions, self._bases, self._free = self._regions, [], [], {}
            self._cond.notify_all()
        for region in regions:
            self._store.unregister_buffer(_address(region))
            try:
                region.close()
            except BufferError:  # NOTE: a caller still holds a slice of a lease's buffer: keep it mapped
                logger.warning("BufferPool.close: a lease's memoryview is still referenced; its region stays mapped")

    def _class_of(self, size: int) -> int:
        slot_class = max(self._min_class, 1 << max(size - 1, 0).bit_length())
        if self._max_class is not None and size > self._max_class:
            slot_class = -(-size // _SLOT_ALIGN) * _SLOT_ALIGN  # NOTE: oversize: a region of its own size
        if self._max_bytes and slot_class > self._max_bytes:
            raise RuntimeError("requested buffer size exceeds pool capacity")
        return slot_class

    def _take(self, slot_class: int) -> int | None:
        free = self._free.get(slot_class)
        if not free and not self._map(slot_class):
            return None
        return self._free[slot_class].pop()

    def _map(self, slot_class: int) -> bool:
        """One more region of `slot_class` slots; False when a cap forbids it (lock held)."""
        length = -(-max(self._alignment, slot_class) // slot_class) * slot_class
        if self._max_regions is not None and len(self._regions) >= self._max_regions:
            return False
        if self._max_bytes and self._mapped_bytes + length > self._max_bytes:
            length = slot_class  # NOTE: a region of one slot may still fit under the cap
            if self._mapped_bytes + length > self._max_bytes:
                return False
        region = mmap.mmap(-1, length)
        address = _address(region)
        if self._store.register_buffer(address, length) != 0:
            region.close()
            raise RuntimeError("the store refused to register the pool's buffer")
        self._regions.insert(bisect.bisect(self._bases, address), region)
        bisect.insort(self._bases, address)
        self._mapped_bytes += length
        self._free.setdefault(slot_class, []).extend(range(address + length - slot_class, address - 1, -slot_class))
        return True

    def _view(self, ptr: int, size: int) -> memoryview:
        """A memoryview of [ptr, ptr + size), taken from its region's mapping."""
        with self._cond:
            index = bisect.bisect(self._bases, ptr) - 1
            region, offset = self._regions[index], ptr - self._bases[index]
        return memoryview(region)[offset : offset + size]

    def _give_back(self, slot_class: int, ptr: int) -> None:
        with self._cond:
            self._out -= 1
            if not self._closed:
                self._free.setdefault(slot_class, []).append(ptr)
            self._cond.notify()


RegisteredBufferPool = BufferPool


def _address(region: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(region))


def _size(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError(f"{name} must be a non-negative int, got {value!r}")
    return value
