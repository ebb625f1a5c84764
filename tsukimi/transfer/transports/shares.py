"""A prepared call's work cut in shares (tsukimi/transfer/prepared.py): the calling thread
runs the first share, the transport's copy workers the others, and a latch tells the caller
when every share ran and whether each did all it had to. The shm transport's shares are raw
copies (memmove of address triples, which releases the GIL); cma's are its prepared
process_vm_readv/writev calls.

The caller keeps both ends of every copy mapped until `run_shares` returns (it waits for the
workers' shares even when its own raised).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence

Copy = tuple[int, int, int]  # (destination address, source address, bytes)


def copy_all(copies: list[Copy]) -> bool:
    """memmove each copy (always True: a copy cannot come up short)."""
    for destination, source, size in copies:
        ctypes.memmove(destination, source, size)
    return True


class Latch:
    """Counts down the shares handed to workers; `wait` says whether every one succeeded."""

    def __init__(self, count: int) -> None:
        self._lock = threading.Lock()
        self._left, self._ok = count, True
        self._event = threading.Event()
        if count == 0:
            self._event.set()

    def done(self, ok: bool) -> None:
        with self._lock:
            self._ok = self._ok and ok
            self._left -= 1
            if self._left == 0:
                self._event.set()

    def wait(self) -> bool:
        self._event.wait()
        return self._ok


class Share:
    """One share of a prepared call's work, for a copy worker."""

    __slots__ = ("latch", "work")

    def __init__(self, work: Callable[[], bool], latch: Latch) -> None:
        self.work, self.latch = work, latch

    def run(self) -> None:
        ok = False
        try:
            ok = self.work()
        finally:
            self.latch.done(ok)

    def refuse(self) -> None:
        """The workers are closed: the share did not run."""
        self.latch.done(False)


def run_shares(works: Sequence[Callable[[], bool]], put: Callable[[Share], None]) -> bool:
    """Run `works[0]` here and put the others to the workers; whether every one succeeded."""
    if len(works) == 1:
        return works[0]()
    latch = Latch(len(works) - 1)
    for work in works[1:]:
        put(Share(work, latch))
    mine = False
    try:
        mine = works[0]()
    finally:
        others = latch.wait()  # NOTE: even when ours raised: the caller unpins after this
    return mine and others
