"""What the same-host transports (shm, cma, device_ipc) share: a peer process pinned by a
pidfd, the table of peers they copy to, the copy workers that take large submits, the slice
filter that runs before every copy, and the re-check of slices after the owner changed its
registrations.

A peer is named by (host, pid, start time): the descriptor carries the owner's start time, so
a pid the kernel recycled after the owner died is never taken for it. The pidfd then tells,
before and after each copy, whether that very process is still alive.
"""

from __future__ import annotations

import os
import queue
import select
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from tsukimi.clock import Clock
from tsukimi.errors import ClosedError, OutOfBounds, PeerError, TsukimiError
from tsukimi.transfer.segment import SegmentDescriptor, process_start_time
from tsukimi.transfer.transports.base import Slice

MAX_RETIRED = 64  # pidfds of restarted peers kept open for threads that may still use them


class PeerProcess:
    """One same-host peer process: its pid and a pidfd that pins its identity.

    Raises (constructor): ProcessLookupError (gone, or its pid now names another process),
    OSError (another pid namespace)."""

    def __init__(self, desc: SegmentDescriptor) -> None:
        self.name, self.pid = desc.name, desc.pid
        self.pidfd = os.pidfd_open(desc.pid)
        if desc.pid_start and process_start_time(desc.pid) != desc.pid_start:
            os.close(self.pidfd)
            raise ProcessLookupError(f"pid {desc.pid} is no longer the process that published {desc.name}")

    def alive(self) -> bool:
        """Whether the process still runs (its pidfd turns readable when it exits); False
        too when the pidfd was closed under the caller (the transport closed, or a retired
        peer's pidfd: the copy then fails as a peer error instead of raising).
        NOTE: select, not a kept poll object: that one refuses concurrent callers."""
        try:
            readable, _, _ = select.select([self.pidfd], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def close(self) -> None:
        os.close(self.pidfd)


P = TypeVar("P", bound=PeerProcess)
T = TypeVar("T")


class PeerTable(Generic[P]):
    """Peers by segment name, each opened once (racing first contacts share one); a peer that
    restarted (another pid) is replaced, and the old one closed only on `close`, since other
    threads may still be copying with it. Thread-safe."""

    def __init__(self, what: str, make: Callable[[SegmentDescriptor], P]) -> None:
        self._what, self._make = what, make
        self._lock = threading.Lock()
        self._peers: dict[str, P] = {}
        self._retired: list[P] = []
        self._closed = False

    def get(self, desc: SegmentDescriptor) -> P:
        """The peer behind `desc`. Raises ClosedError, or what the peer's constructor raises."""
        if self._closed:
            raise ClosedError(f"{self._what} transport is closed")
        state = self._peers.get(desc.name)
        if state is not None and state.pid == desc.pid:
            return state
        with self._lock:
            state = self._peers.get(desc.name)
            if state is not None and state.pid == desc.pid:
                return state
            fresh = self._peers[desc.name] = self._make(desc)
            if state is not None:
                self._retired.append(state)
                while len(self._retired) > MAX_RETIRED:
                    self._retired.pop(0).close()
        return fresh

    def close(self) -> None:
        with self._lock:
            self._closed = True
            peers = [*self._peers.values(), *self._retired]
            self._peers, self._retired = {}, []
        for state in peers:
            state.close()


class CopyWorkers(Generic[T]):
    """Threads that run `run(item)` for items put in order; `close` stops them after what
    is queued, and fails every item put afterwards through `refuse`."""

    def __init__(self, count: int, name: str, run: Callable[[T], None], refuse: Callable[[T], None]) -> None:
        self._run, self._refuse = run, refuse
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[T | None] = queue.SimpleQueue()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(count)]
        for thread in self._threads:
            thread.start()

    def put(self, item: T) -> None:
        with self._lock:  # NOTE: never behind the stop signals
            if self._closed:
                self._refuse(item)
            else:
                self._queue.put(item)

    def close(self, join_s: float = 5.0) -> None:
        with self._lock:
            self._closed = True
            for _ in self._threads:
                self._queue.put(None)
        for thread in self._threads:
            thread.join(timeout=join_s)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            self._run(item)


def still_registered(
    peer: SegmentDescriptor,
    version: Callable[[SegmentDescriptor], int | None],
    fetch: Callable[[str], SegmentDescriptor],
    slices: list[Slice],
) -> tuple[SegmentDescriptor | None, list[Slice]]:
    """After the owner's registration `version` moved past `peer.version`: its fresh
    descriptor (None when it cannot be had) and the slices whose ranges it still registers,
    each pointed at the buffer that holds it now. The others end here: out of bounds
    (released), or a peer error (the owner cannot be asked, or keeps changing)."""
    try:
        fresh = fetch(peer.name)
    except TsukimiError as exc:
        _fail(slices, PeerError(f"{peer.name} changed its registrations and cannot be asked: {exc}"))
        return None, []
    if fresh.version != version(fresh):
        _fail(slices, PeerError(f"{peer.name} is changing its registrations; try again"))
        return None, []
    live = []
    for piece in slices:
        found = fresh.find(piece.remote_offset, piece.nbytes)
        if found is None:
            where = f"[{piece.remote_offset:#x}, +{piece.nbytes})"
            _fail([piece], OutOfBounds(f"{where} of {peer.name} was released (no longer registered)"))
        else:
            piece.buffer = found
            live.append(piece)
    return fresh, live


def _fail(pieces: list[Slice], error: TsukimiError) -> None:
    for piece in pieces:
        piece.record.slice_failed(str(error), error.code)


def live_slices(slices: list[Slice], clock: Clock) -> list[Slice]:
    """The slices worth copying now; the others end here (a sibling already failed the
    request, or the deadline passed before the copy started)."""
    now = clock.now()
    live = []
    for piece in slices:
        if piece.record.doomed:
            piece.record.slice_failed("")  # a sibling slice failed; only account for this one
        elif now >= piece.record.deadline:
            piece.record.slice_failed("deadline passed before the copy started", timed_out=True)
        else:
            live.append(piece)
    return live


def split_by_bytes(items: list[T], parts: int, size_of: Callable[[T], int]) -> list[list[T]]:
    """`items` (slices, copies) cut into at most `parts` runs of consecutive items of about
    equal bytes: what a large submit hands the copy workers (one queue item per run, not per
    slice)."""
    share = max(1, -(-sum(size_of(item) for item in items) // max(1, parts)))
    runs: list[list[T]] = []
    run: list[T] = []
    size = 0
    for item in items:
        run.append(item)
        size += size_of(item)
        if size >= share:
            runs.append(run)
            run, size = [], 0
    if run:
        runs.append(run)
    return runs


def copy_now_or_hand_off(
    state: P, slices: list[Slice], run: Callable[[P, Slice], None], workers: CopyWorkers[tuple[P, Slice]], inline: int
) -> None:
    """Copy a submit of at most `inline` bytes on the caller's thread (a hand-off to a worker
    costs more than such a copy); hand larger ones to the workers, which copy in parallel
    (numpy's copies and the device backends' release the GIL)."""
    if sum(piece.nbytes for piece in slices) <= inline:
        for piece in slices:
            run(state, piece)
        return
    for piece in slices:
        workers.put((state, piece))
