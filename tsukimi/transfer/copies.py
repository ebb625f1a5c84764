"""One host-memory copy between two byte views of equal length, the way every in-process copy
path does it (the shm and local transports, the store's own-segment replicas): a memoryview
assignment up to MEMCPY_BYTES (one memcpy, cheaper than building two arrays), np.copyto above
(which releases the GIL, so other threads run during a large copy)."""

from __future__ import annotations

import numpy as np

MEMCPY_BYTES = 256 << 10


def copy_bytes(dst: bytearray | memoryview, src: bytearray | memoryview) -> None:
    """Copy `src` into `dst`: flat byte views (format "B") or bytearrays of the same length.
    Raises ValueError: the lengths differ, or a view was released."""
    if len(src) <= MEMCPY_BYTES:
        dst[:] = src
    else:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))
