"""Transfer requests and batches: what a caller submits and the per-request state it polls.

A request is split into slices (one per transport operation); it completes when all its
slices did, fails with the first failing slice's reason, and times out at its deadline.
A batch completes when all its requests reached a final state; it then resolves a
`concurrent.futures.Future` so threads can wait and asyncio callers can await.
"""

from __future__ import annotations

import concurrent.futures
import enum
import threading
from dataclasses import dataclass

from tsukimi.errors import OutOfBounds, RpcTimeout, TransferError, TsukimiError, error_from_code

BatchId = int


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
    """Requests submitted together; `capacity` bounds how many (as in Mooncake)."""

    def __init__(self, batch_id: BatchId, capacity: int) -> None:
        self.batch_id = batch_id
        self.capacity = capacity
        self.lock = threading.Lock()
        self.records: list[RequestRecord] = []
        self.unfinished = 0
        self.latest_deadline = 0.0
        self.future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.future.set_result(None)  # an empty batch is complete

    def add_many(self, keepalives: list[object], deadline: float) -> list[RequestRecord]:
        """Add one record per request, all or none (mutates).

        Raises:
            OutOfBounds: the batch would hold more than `capacity` requests.
        """
        records = [RequestRecord(self, deadline, keep) for keep in keepalives]
        with self.lock:
            if len(self.records) + len(records) > self.capacity:
                raise OutOfBounds(f"batch {self.batch_id} holds at most {self.capacity} requests")
            if records and self.unfinished == 0:
                self.future = concurrent.futures.Future()
            self.records += records
            self.unfinished += len(records)
            self.latest_deadline = max(self.latest_deadline, deadline)
        return records

    def request_finished(self) -> None:
        # Called with self.lock held.
        self.unfinished -= 1
        if self.unfinished == 0:
            self.future.set_result(None)

    def statuses(self) -> list[RequestStatus]:
        with self.lock:
            return [r.status() for r in self.records]

    @property
    def done(self) -> bool:
        return self.future.done()
