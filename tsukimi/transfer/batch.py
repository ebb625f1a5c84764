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
    """Mutable progress of one request; updated by transport threads under `batch.lock`."""

    __slots__ = ("batch", "code", "deadline", "done_bytes", "length", "reason", "slices_left", "state")

    def __init__(self, batch: Batch, length: int, deadline: float) -> None:
        self.batch = batch
        self.length = length
        self.deadline = deadline
        self.slices_left = 0
        self.done_bytes = 0
        self.state = RequestState.PENDING
        self.reason = ""
        self.code = ""

    def slice_done(self, nbytes: int) -> None:
        with self.batch.lock:
            self.done_bytes += nbytes
            self.slices_left -= 1
            if self.slices_left == 0 and self.state is RequestState.PENDING:
                self._finish(RequestState.COMPLETED)

    def slice_failed(self, reason: str, code: str = "", timed_out: bool = False) -> None:
        with self.batch.lock:
            self.slices_left -= 1
            if self.state is RequestState.PENDING:
                self.reason, self.code = reason, code or TransferError.code
                self._finish(RequestState.TIMED_OUT if timed_out else RequestState.FAILED)

    def fail_now(self, exc: TsukimiError) -> None:
        """Fail a request before any slice was dispatched (e.g. out of bounds)."""
        with self.batch.lock:
            self.reason, self.code = str(exc), exc.code
            self._finish(RequestState.FAILED)

    def _finish(self, state: RequestState) -> None:
        # Called with batch.lock held. Late slices of a failed request only decrement counts.
        self.state = state
        self.batch.request_finished()

    def status(self) -> RequestStatus:
        return RequestStatus(self.state, self.done_bytes, self.reason, self.code)


class Batch:
    """Requests submitted together; `capacity` bounds how many (as in Mooncake)."""

    def __init__(self, batch_id: BatchId, capacity: int) -> None:
        self.batch_id = batch_id
        self.capacity = capacity
        self.lock = threading.Lock()
        self.records: list[RequestRecord] = []
        self.unfinished = 0
        self.future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.future.set_result(None)  # an empty batch is complete

    def add(self, length: int, deadline: float) -> RequestRecord:
        record = RequestRecord(self, length, deadline)
        with self.lock:
            if len(self.records) >= self.capacity:
                raise OutOfBounds(f"batch {self.batch_id} holds at most {self.capacity} requests")
            if self.unfinished == 0:
                self.future = concurrent.futures.Future()
            self.records.append(record)
            self.unfinished += 1
        return record

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
