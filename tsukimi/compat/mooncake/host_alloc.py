"""`mooncake.store.MooncakeHostMemAllocator`: host memory by address, for SGLang's HiCache
host pool when its storage runs standalone (`MooncakeHostTensorAllocator` wraps it).

Mooncake's allocator maps shared memory (its standalone client process reads it); tsukimi's
store moves bytes from and into any memory of this process, so anonymous mappings serve. The
answers are the wheel's: `alloc(size)` a page-aligned address (0 bytes: RuntimeError, a
negative size: TypeError, as pybind's unsigned argument), `free(address)` 0, or -1 for an
address this allocator did not hand out (or already freed).
"""

from __future__ import annotations

import ctypes
import mmap
import threading

_UNKNOWN = -1


class MooncakeHostMemAllocator:
    """Page-aligned host memory by address; every mapping lives until `free` (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: dict[int, mmap.mmap] = {}

    def alloc(self, size: int) -> int:
        """`size` bytes of zeroed, page-aligned memory; its address.

        Raises:
            TypeError: `size` is not a non-negative int.
            RuntimeError: `size` is 0 or cannot be mapped.
        """
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise TypeError(f"alloc(): incompatible function arguments: size {size!r} is not an unsigned integer")
        if size == 0:
            raise RuntimeError("Failed to map shared memory: Invalid argument")
        try:
            mapping = mmap.mmap(-1, size)
        except (OSError, OverflowError) as exc:
            raise RuntimeError(f"Failed to map shared memory: {exc}") from exc
        probe = ctypes.c_char.from_buffer(mapping)  # NOTE: the address, without keeping an export
        address = ctypes.addressof(probe)
        del probe
        with self._lock:
            self._maps[address] = mapping
        return address

    def free(self, address: int) -> int:
        """Unmap what `alloc` returned at `address`: 0, or -1 when it is not one (any more)."""
        with self._lock:
            mapping = self._maps.pop(address, None) if isinstance(address, int) else None
        if mapping is None:
            return _UNKNOWN
        mapping.close()
        return 0
