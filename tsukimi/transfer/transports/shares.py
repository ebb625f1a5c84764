"""A prepared call's work cut in shares (tsukimi/transfer/prepared.py): the calling thread
runs the first share, the transport's copy workers the others, and a latch tells the caller
when every share ran and whether each did all it had to. The shm transport's shares are raw
copies (memmove of address triples, which releases the GIL); cma's are its prepared
process_vm_readv/writev calls.

The caller keeps both ends of every copy mapped until `run_shares` returns. It waits for the
workers' shares at most until its deadline; then it cancels the shares no worker started
(a share checks, under the latch's lock, before it starts), waits only for those already
running (a copy cannot hang), and reports failure, so the requests end as the ordinary path
ends them past their deadline (timed out).
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time
from collections.abc import Callable, Sequence

from tsukimi.transfer.native import NATIVE, Copy, packed


def copy_all(copies: list[Copy]) -> bool:
    """memmove each copy (always True: a copy cannot come up short)."""
    for destination, source, size in copies:
        ctypes.memmove(destination, source, size)
    return True


def copier(copies: list[Copy]) -> Callable[[], bool]:
    """A share's work: `copy_all(copies)`, in one native call where tsukimi/transfer/native.py
    has one (~0.3 us less per copy: the ctypes call)."""
    if NATIVE is None:
        return functools.partial(copy_all, copies)
    return functools.partial(NATIVE.copy_packed, packed(copies))


class Latch:
    """Counts down the shares handed to workers; `wait` says whether every one succeeded
    (see the module: a share that has not started by the caller's deadline never starts)."""

    def __init__(self, count: int) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._left, self._running, self._ok, self._cancelled = count, 0, True, False

    def start(self) -> bool:
        """Whether a share may start now (False once the caller gave up: the share then ended)."""
        with self._cond:
            if self._cancelled:
                self._left -= 1
                return False
            self._running += 1
            return True

    def done(self, ok: bool, started: bool = True) -> None:
        """A share ended (`started`: it had called `start`)."""
        with self._cond:
            self._ok = self._ok and ok
            self._left -= 1
            self._running -= started
            self._cond.notify_all()

    def wait(self, timeout_s: float) -> bool:
        """Whether every share succeeded, waiting at most `timeout_s` for the shares not yet
        started (then cancelled: False) and for those running however long they take."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._left <= 0, max(0.0, timeout_s)):
                self._cancelled, self._ok = True, False
                self._cond.wait_for(lambda: self._running <= 0)
            return self._ok


class Share:
    """One share of a prepared call's work, for a copy worker."""

    __slots__ = ("latch", "work")

    def __init__(self, work: Callable[[], bool], latch: Latch) -> None:
        self.work, self.latch = work, latch

    def run(self) -> None:
        if not self.latch.start():  # NOTE: its caller gave up: its memory may be gone
            return
        ok = False
        try:
            ok = self.work()
        finally:
            self.latch.done(ok)

    def refuse(self) -> None:
        """The workers are closed: the share did not run."""
        self.latch.done(False, started=False)


def run_shares(works: Sequence[Callable[[], bool]], put: Callable[[Share], None], timeout_s: float) -> bool:
    """Run `works[0]` here and put the others to the workers; whether every one succeeded
    within `timeout_s` (see the module)."""
    if len(works) == 1:
        return works[0]()
    until = time.monotonic() + timeout_s
    latch = Latch(len(works) - 1)
    for work in works[1:]:
        put(Share(work, latch))
    mine = False
    try:
        mine = works[0]()
    finally:
        others = latch.wait(until - time.monotonic())  # NOTE: even when ours raised: the caller unpins after this
    return mine and others
