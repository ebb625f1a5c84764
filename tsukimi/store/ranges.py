"""`RangeReads`: byte ranges of objects straight into the caller's buffers (`get_ranges`), a
part of client.py's `StoreClient` (which delegates to it).

    client.get_ranges([RangeRead("a", 128, view[0:64]), RangeRead("b", 0, view[64:96])])

One master round trip gets (and leases) the replicas of every key named, then one Transfer
Engine batch READs every range from its object's first replica, the failed ones from the
next replica, and so on, like a whole-object get (replica_io.py). A range is checked against
its object's size first: one that does not fit fails alone, with InvalidArgument. Checksums
cover whole objects, so a range read is not checked against one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tsukimi.clock import Clock
from tsukimi.errors import InvalidArgument, TsukimiError
from tsukimi.store import protocol as p
from tsukimi.store.master_batch import call_batch
from tsukimi.store.master_link import MasterLink
from tsukimi.store.replica_io import LEASE_SHARE, MIN_READ_S, GetResult, transfer_error
from tsukimi.transfer import OpCode, RequestState, TransferEngine, TransferRequest
from tsukimi.transfer.segment import byte_view


@dataclass(frozen=True, slots=True)
class RangeRead:
    """Read `len(dest)` bytes of object `key`, from byte `offset` of it, into `dest` (any
    writable buffer: a memoryview slice, a numpy array, an (address, length) tuple...)."""

    key: str
    offset: int
    dest: object


@dataclass(slots=True)
class _Pending:
    view: memoryview
    offset: int
    replicas: list[p.ReplicaLocation]
    attempt: int = 0


class RangeReads:
    """Range reads with the client's master link and Transfer Engine; keeps no state of its
    own between calls (thread-safe)."""

    def __init__(self, link: MasterLink, engine: TransferEngine, clock: Clock) -> None:
        self._link = link
        self._engine = engine
        self._clock = clock

    def get_ranges(self, reads: Sequence[RangeRead]) -> list[GetResult]:
        """Each read's `GetResult`, in order: `data` a view of its `dest` holding the bytes;
        a miss is `GetResult()`; `error` InvalidArgument (a bad key, a range outside the
        object), InvalidBufferError (a `dest` that is not a writable buffer), TransferError
        (no replica readable). Raises only for the whole call (RpcTimeout / MasterUnavailable)."""
        results = [GetResult()] * len(reads)
        pending: dict[int, _Pending] = {}
        keys = list(dict.fromkeys(r.key for r in reads if isinstance(r.key, str) and r.key))
        found = self._locate(keys)
        for i, read in enumerate(reads):
            try:
                target = self._target(read, found)
            except TsukimiError as exc:
                results[i] = GetResult(error=exc)
                continue
            if target is not None:
                pending[i] = target
        lease_s = min((r.lease_s for r in found.values() if isinstance(r, p.GetReplicasResult)), default=0.0)
        self._read(pending, results, self._clock.now() + LEASE_SHARE * lease_s)
        return results

    def _locate(self, keys: list[str]) -> dict[str, p.BatchResultItem]:
        found: dict[str, p.BatchResultItem] = {}
        for start in range(0, len(keys), p.MAX_BATCH):
            chunk = keys[start : start + p.MAX_BATCH]
            found.update(zip(chunk, call_batch(self._link, [p.GetReplicas(k) for k in chunk]), strict=True))
        return found

    @staticmethod
    def _target(read: RangeRead, found: dict[str, p.BatchResultItem]) -> _Pending | None:
        """The read to do, or None for a miss. Raises the read's own error."""
        p.check_key(read.key)
        result = found[read.key]
        if isinstance(result, p.Failure):
            raise p.error_of(result)
        assert isinstance(result, p.GetReplicasResult)
        if not result.replicas:
            return None
        view = byte_view(read.dest, writable=True, with_address=False)[0]
        if not isinstance(read.offset, int) or read.offset < 0 or read.offset + len(view) > result.size:
            raise InvalidArgument(
                f"bytes [{read.offset}, {read.offset}+{len(view)}) are outside {read.key!r} ({result.size} bytes)"
            )
        return _Pending(view, read.offset, list(result.replicas))

    def _read(self, pending: dict[int, _Pending], results: list[GetResult], lease_end: float) -> None:
        """READ rounds: every range still unread tries its next replica."""
        while pending:
            order = list(pending)
            requests = []
            for i in order:
                loc = pending[i].replicas[pending[i].attempt]
                requests.append(
                    TransferRequest(OpCode.READ, loc.te_segment, loc.address + pending[i].offset, pending[i].view)
                )
            timeout_s = max(MIN_READ_S, lease_end - self._clock.now())
            for i, status in zip(order, self._engine.transfer(requests, timeout_s=timeout_s), strict=True):
                target = pending[i]
                target.attempt += 1
                if status.state is RequestState.COMPLETED:
                    results[i] = GetResult(target.view)
                elif target.attempt >= len(target.replicas):
                    results[i] = GetResult(error=transfer_error(status, "no replica of a range was readable"))
                else:
                    continue
                del pending[i]
