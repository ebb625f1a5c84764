"""Memory as Mooncake's store API sees it: `BufferHandle` (what `get_buffer` returns), the
buffers registered with `register_buffer`, and the local buffer that copying calls stage in.

tsukimi reads into and writes from any memory, so registration only records ranges here:
`get_into_ranges` writes inside registered buffers only, as Mooncake does, so a range that
overflows its buffer is refused instead of scribbling past it. Mooncake stages the bytes of
copying calls (put/get of Python bytes) in `local_buffer_size` bytes of registered memory;
tsukimi needs no staging, but keeps the limit so code that relies on it (a zero local buffer
allows zero-copy calls only) behaves the same.

Pointers may be device memory (SGLang's and vLLM's Mooncake connectors pass GPU pointers):
`memory_at` names such a range as device memory, which the store stages (device_io.py), so
no host view is ever built over it. Registering one only records it, as for host memory.
"""

from __future__ import annotations

import bisect
import ctypes
import threading

from tsukimi.device import DeviceRange, locate
from tsukimi.errors import InvalidArgument, InvalidBufferError


class BufferHandle(bytearray):
    """`mooncake.store.BufferHandle`: an object's bytes in memory this process owns (a
    bytearray: any buffer consumer reads it; `ptr()` and `size()` as Mooncake's)."""

    def ptr(self) -> int:
        """The address of the bytes (0 when empty); valid while the handle lives, unresized."""
        if not self:
            return 0
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))

    def size(self) -> int:
        return len(self)


class RegisteredBuffers:
    """Ranges [address, address + size) given to `register_buffer`; none overlap. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._sizes: dict[int, int] = {}

    def register(self, address: int, size: int) -> None:
        """Raises InvalidBufferError: a null address, no bytes, or an overlap with a range
        registered already (the same one included)."""
        if not isinstance(address, int) or not isinstance(size, int) or address <= 0 or size <= 0:
            raise InvalidBufferError(f"cannot register {size!r} bytes at {address!r}")
        with self._lock:
            i = bisect.bisect_left(self._starts, address)
            after = self._starts[i] if i < len(self._starts) else None
            before = self._starts[i - 1] if i else None
            if (after is not None and after < address + size) or (
                before is not None and before + self._sizes[before] > address
            ):
                raise InvalidBufferError(f"[{address:#x}, +{size}) overlaps a registered buffer")
            self._starts.insert(i, address)
            self._sizes[address] = size

    def unregister(self, address: int) -> None:
        """Raises InvalidBufferError: not the start of a registered buffer."""
        with self._lock:
            if address not in self._sizes:
                raise InvalidBufferError(f"no buffer is registered at {address!r}")
            del self._sizes[address]
            self._starts.remove(address)

    def clear(self) -> None:
        """Forget every buffer (the store closed). Mutates."""
        with self._lock:
            self._starts.clear()
            self._sizes.clear()

    def size_at(self, address: int) -> int:
        """The size of the buffer registered at `address`. Raises InvalidBufferError."""
        with self._lock:
            size = self._sizes.get(address)
        if size is None:
            raise InvalidBufferError(f"no buffer is registered at {address:#x} (register_buffer it first)")
        return size


class LocalBuffer:
    """The copying calls' limit: one value moved by copy must fit in `size` bytes."""

    def __init__(self, size: int) -> None:
        self.size = size

    def check(self, key: str, nbytes: int) -> None:
        """Raises InvalidArgument when a copy of `nbytes` would not fit."""
        if nbytes > self.size:
            raise InvalidArgument(
                f"{key!r}: {nbytes} bytes do not fit in the local buffer ({self.size} bytes, setup's "
                f"local_buffer_size); use the zero-copy calls (put_from, get_into) for such values"
            )


def memory_at(address: int, size: int) -> DeviceRange | tuple[int, int]:
    """The memory at [address, address + size) as the store takes it: a DeviceRange when it is
    device memory, else the (address, size) host buffer.

    Raises:
        InvalidBufferError: device memory that runs past its allocation.
    """
    return locate(address, size) or (address, size)
