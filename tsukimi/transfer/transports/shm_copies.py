"""Raw copies of the shm transport's prepared calls: (destination, source, bytes) address
triples, copied with memmove (ctypes releases the GIL for it), and the latch by which a
prepared call waits for the shares of them that the copy workers took.

The caller guarantees that both ends stay mapped while the copies run (the shm transport
pins its peer's file and the caller keeps its own buffers alive).
"""

from __future__ import annotations

import ctypes
import threading

Copy = tuple[int, int, int]  # (destination address, source address, bytes)


def copy_all(copies: list[Copy]) -> None:
    """memmove each copy."""
    for destination, source, size in copies:
        ctypes.memmove(destination, source, size)


class Latch:
    """Counts down the shares handed to workers; `wait` says whether every one ran."""

    def __init__(self, count: int) -> None:
        self._lock = threading.Lock()
        self._left, self._ok = count, True
        self._event = threading.Event()
        if count == 0:
            self._event.set()

    def done(self, ran: bool) -> None:
        with self._lock:
            self._ok = self._ok and ran
            self._left -= 1
            if self._left == 0:
                self._event.set()

    def wait(self) -> bool:
        self._event.wait()
        return self._ok


class Copies:
    """One share of a prepared call's copies, for a copy worker."""

    __slots__ = ("copies", "latch")

    def __init__(self, copies: list[Copy], latch: Latch) -> None:
        self.copies, self.latch = copies, latch

    def run(self) -> None:
        try:
            copy_all(self.copies)
        except BaseException:
            self.latch.done(False)
            raise
        self.latch.done(True)

    def refuse(self) -> None:
        """The workers are closed: the share did not run."""
        self.latch.done(False)
