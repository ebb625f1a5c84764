"""Transfer requests and batches: what a caller submits and the per-request state it polls.

A request is split into slices (one per transport operation); it completes when all its
slices did, fails with the first failing slice's reason, and times out at its deadline.
A batch (the requests of one submit) completes when all its requests reached a final state;
it then resolves a `concurrent.futures.Future` so threads can wait and asyncio callers can
await.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tsukimi.clock import Clock
from tsukimi.errors import RpcTimeout, TransferError, TsukimiError, error_from_code

WAIT_GRACE_S = 2.0  # past the deadline: socket ticks, retries and thread scheduling


class OpCode(enum.Enum):
    READ = "read"  # remote segment -> local buffer
    WRITE = "write"  # local buffer -> remote segment


class RequestState(enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"
    TIMED_OUT = "timed_out"


@dataclass(frozen=True, slots=True)
class SegmentHandle:
    """An opened remote segment (from `TransferEngine.open_segment`); `transport` is
    "auto", "shm" or "tcp"."""

    handle_id: int
    name: str
    transport: str = "auto"


@dataclass(frozen=True, slots=True)
class TransferRequest:
    """Move `length` bytes between `local[local_offset:]` and the remote segment at
    `remote_offset` (an address in the owner's address space). `length` defaults to the
    rest of the local buffer. `local` is any buffer: bytes-like, numpy, torch CPU tensor."""

    op: OpCode
    segment: SegmentHandle | str
    remote_offset: int
    local: object
    length: int | None = None
    local_offset: int = 0


@dataclass(frozen=True, slots=True)
class RequestStatus:
    """Where one request stands. `error_code` is a `TsukimiError.code` when it failed."""

    state: RequestState
    transferred_bytes: int = 0
    reason: str = ""
    error_code: str = ""

    def error(self) -> TsukimiError | None:
        """The error this status stands for, or None when it completed or is pending."""
        if self.state is RequestState.TIMED_OUT:
            return RpcTimeout(self.reason or "request timed out")
        if self.state is RequestState.FAILED:
            return error_from_code(self.error_code or TransferError.code, self.reason)
        return None


class RequestRecord:
    """Mutable progress of one request; updated by transport threads under `batch.lock`.

    A request becomes final only when every one of its slices has ended, so once a caller
    sees a final state nothing touches its buffer any more. The first failure is kept as the
    reason (`doomed`), and later slices of a doomed request are not sent. `keepalive` holds
    the caller's buffer object (a torch tensor, say) until then.
    """

    __slots__ = ("batch", "code", "deadline", "done_bytes", "keepalive", "reason", "slices_left", "state", "timed_out")

    def __init__(self, batch: Batch, deadline: float, keepalive: object) -> None:
        self.batch = batch
        self.deadline = deadline
        self.keepalive: object = keepalive
        self.slices_left = 0
        self.done_bytes = 0
        self.state = RequestState.PENDING
        self.reason = ""
        self.code = ""
        self.timed_out = False

    @property
    def doomed(self) -> bool:
        """A slice failed: the request will end FAILED or TIMED_OUT."""
        return bool(self.code)

    def slice_done(self, nbytes: int) -> None:
        with self.batch.lock:
            self.done_bytes += nbytes
            self._slice_ended()

    @staticmethod
    def slices_done(pieces: list[tuple[RequestRecord, int]]) -> None:
        """`slice_done` for several slices of one batch, under one acquisition of its lock."""
        if not pieces:
            return
        with pieces[0][0].batch.lock:
            for record, nbytes in pieces:
                record.done_bytes += nbytes
                record._slice_ended()

    def slice_failed(self, reason: str, code: str = "", timed_out: bool = False) -> None:
        """End one slice as failed; the first failure's reason and code are kept."""
        with self.batch.lock:
            if not self.code:
                self.reason, self.code, self.timed_out = reason, code or TransferError.code, timed_out
            self._slice_ended()

    def fail_now(self, exc: TsukimiError) -> None:
        """Fail a request none of whose slices were dispatched (e.g. out of bounds)."""
        with self.batch.lock:
            self.reason, self.code = str(exc), exc.code
            self.slices_left = 0
            self._finish()

    def _slice_ended(self) -> None:
        # Called with batch.lock held.
        self.slices_left -= 1
        if self.slices_left == 0:
            self._finish()

    def _finish(self) -> None:
        # Called with batch.lock held, once per request.
        if not self.code:
            self.state = RequestState.COMPLETED
        else:
            self.state = RequestState.TIMED_OUT if self.timed_out else RequestState.FAILED
        self.keepalive = None
        self.batch.request_finished()

    def status(self) -> RequestStatus:
        if self.state is RequestState.PENDING:
            return RequestStatus(self.state, self.done_bytes)
        return RequestStatus(self.state, self.done_bytes, self.reason, self.code)


class Batch:
    """Requests submitted together (`TransferEngine.submit`): one record per request; `wait`
    and `wait_async` return once every one of them reached a final state.

    NOTE: a batch that a transport finished inline (the common small one) never builds a
    waiter: the event and the future are made only for a caller that has to wait."""

    __slots__ = ("_clock", "_event", "_future", "_on_done", "deadline", "lock", "records", "unfinished")

    def __init__(
        self, keepalives: list[object], deadline: float, clock: Clock, on_done: Callable[[], None] | None = None
    ) -> None:
        """`on_done` (optional) is called once every request ended, with `lock` held: it must
        not block or touch this batch (the staged transport hands work on from it)."""
        self.lock = threading.Lock()
        self._on_done = on_done
        self.deadline = deadline
        self._clock = clock
        self._event: threading.Event | None = None
        self._future: concurrent.futures.Future[None] | None = None
        self.records = [RequestRecord(self, deadline, keep) for keep in keepalives]
        self.unfinished = len(self.records)

    def request_finished(self) -> None:
        # Called with self.lock held.
        self.unfinished -= 1
        if self.unfinished == 0:
            if self._event is not None:
                self._event.set()
            if self._future is not None:
                self._future.set_result(None)
            if self._on_done is not None:
                self._on_done()

    def complete_all(self, sizes: Sequence[int]) -> None:
        """End every request COMPLETED with its size: a prepared call moved them all before
        any slice was cut (tsukimi/transfer/plan_memo.py)."""
        with self.lock:
            for record, size in zip(self.records, sizes, strict=True):
                record.done_bytes, record.slices_left = size, 0
                record._finish()

    def set_on_done(self, on_done: Callable[[], None]) -> None:
        """Set the call made once every request ended (see the constructor); before any
        request can end."""
        self._on_done = on_done

    def statuses(self) -> list[RequestStatus]:
        """Each request's state now (does not wait)."""
        with self.lock:
            return [r.status() for r in self.records]

    @property
    def done(self) -> bool:
        return self.unfinished == 0

    def wait(self, timeout_s: float | None = None) -> list[RequestStatus]:
        """Block until every request ended, or `timeout_s` passed (default: the deadline plus
        a grace period, by when all have ended); their statuses."""
        if self.unfinished:
            with self.lock:
                if self.unfinished and self._event is None:
                    self._event = threading.Event()
                event = self._event
            if event is not None:
                if timeout_s is None:
                    timeout_s = max(0.0, self.deadline - self._clock.now()) + WAIT_GRACE_S
                event.wait(timeout_s)
        return self.statuses()

    async def wait_async(self) -> list[RequestStatus]:
        """Await the end of every request (each is bounded by its deadline); their statuses."""
        with self.lock:
            if self.unfinished and self._future is None:
                self._future = concurrent.futures.Future()
            future = self._future if self.unfinished else None
        if future is not None:
            await asyncio.wrap_future(future)
        return self.statuses()


def first_error(statuses: Sequence[RequestStatus]) -> TsukimiError | None:
    """The error of the first request that did not complete, if any."""
    for status in statuses:
        if status.state is not RequestState.COMPLETED:
            return status.error() or TransferError("request still pending")
    return None
