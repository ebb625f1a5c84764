"""Mooncake's batch-id transfer API over tsukimi's Transfer Engine.

Mooncake's C++ engine (and code written for it) works with batch ids: allocate a batch of a
given capacity, submit requests into it (possibly in several calls), poll each request's
status, free the batch once every request ended. tsukimi's engine has one call instead,
`submit(requests) -> Batch`; `BatchTable` keeps Mooncake's shape on top of it:

    table = BatchTable(engine)
    batch_id = table.allocate(capacity=8)
    table.submit(batch_id, requests)      # all or none: a caller error starts nothing
    table.status(batch_id)                # BatchStatus(done, per-request statuses)
    table.wait(batch_id); table.free(batch_id)
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from tsukimi.errors import ConfigError, OutOfBounds, TransferError
from tsukimi.transfer import Batch, RequestStatus, TransferEngine, TransferRequest

BatchId = int


@dataclass(frozen=True, slots=True)
class BatchStatus:
    """Every request submitted into a batch id, in submission order."""

    batch_id: BatchId
    done: bool
    requests: list[RequestStatus]


@dataclass(slots=True)
class _Slot:
    capacity: int
    submitted: list[Batch] = field(default_factory=list)
    count: int = 0

    @property
    def done(self) -> bool:
        return all(batch.done for batch in self.submitted)


class BatchTable:
    """Batch ids for one engine (thread-safe)."""

    def __init__(self, engine: TransferEngine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._slots: dict[BatchId, _Slot] = {}

    def allocate(self, capacity: int = 4096) -> BatchId:
        """A new, empty batch that will hold up to `capacity` requests. Raises ConfigError."""
        if capacity <= 0:
            raise ConfigError(f"batch capacity must be positive, got {capacity}")
        with self._lock:
            batch_id = next(self._ids)
            self._slots[batch_id] = _Slot(capacity)
        return batch_id

    def submit(self, batch_id: BatchId, requests: Sequence[TransferRequest], timeout_s: float | None = None) -> None:
        """Start `requests` in the batch (all or none).

        Raises:
            OutOfBounds: the batch would hold more than its capacity.
            ConfigError: no such batch. And what `TransferEngine.submit` raises.
        """
        with self._lock:
            slot = self._slot(batch_id)
            if slot.count + len(requests) > slot.capacity:
                raise OutOfBounds(f"batch {batch_id} holds at most {slot.capacity} requests")
            slot.count += len(requests)  # NOTE: reserved before submitting, given back on a refusal
        try:
            batch = self._engine.submit(requests, timeout_s)
        except BaseException:
            with self._lock:
                slot.count -= len(requests)
            raise
        with self._lock:
            slot.submitted.append(batch)

    def status(self, batch_id: BatchId) -> BatchStatus:
        """Per-request states of the batch (does not wait). Raises ConfigError for no such batch."""
        with self._lock:
            submitted = list(self._slot(batch_id).submitted)
        return BatchStatus(batch_id, all(b.done for b in submitted), [s for b in submitted for s in b.statuses()])

    def wait(self, batch_id: BatchId, timeout_s: float | None = None) -> BatchStatus:
        """Block until every request of the batch ended (or each submit's own wait bound)."""
        with self._lock:
            submitted = list(self._slot(batch_id).submitted)
        for batch in submitted:
            batch.wait(timeout_s)
        return self.status(batch_id)

    def free(self, batch_id: BatchId) -> None:
        """Forget a finished batch. Raises TransferError while requests are pending."""
        with self._lock:
            if not self._slot(batch_id).done:
                raise TransferError(f"batch {batch_id} still has pending requests")
            del self._slots[batch_id]

    def _slot(self, batch_id: BatchId) -> _Slot:
        slot = self._slots.get(batch_id)
        if slot is None:
            raise ConfigError(f"no batch {batch_id} (never allocated, or already freed)")
        return slot
