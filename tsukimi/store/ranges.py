"""`RangeReads`: byte ranges of objects straight into the caller's buffers (`get_ranges`), a
part of client.py's `StoreClient` (which delegates to it).

    client.get_ranges([RangeRead("a", 128, view[0:64]), RangeRead("b", 0, view[64:96])])

One master round trip gets (and leases) the replicas of every key named, then one Transfer
Engine batch READs every range from its object's first replica, the failed ones from the
next replica, and so on, like a whole-object get (replica_io.py). A range is checked against
its object's size first: one that does not fit fails alone, with InvalidArgument. Checksums
cover whole objects, so a range read is not checked against one.

A caller that reads the same objects many times (a layer-wise reader: one call per layer)
looks them up once with `locate` and passes what it got to `get_ranges(reads, located)`:
no master round trip then, only the Transfer Engine batch. A `Located` is good until its
`lease_end` (a share of the read lease the master granted); after that its blocks may hold
another object, and reading it is the caller's mistake (`Located.expired` tells).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tsukimi.clock import Clock
from tsukimi.errors import InvalidArgument, TsukimiError
from tsukimi.store import protocol as p
from tsukimi.store.local_replicas import local_view, scatter
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


@dataclass(frozen=True, slots=True)
class Located:
    """The complete memory replicas of one object, in the order to read them, its `size`,
    and until when (`lease_end`, on the client's clock) the master keeps them in place."""

    replicas: tuple[p.ReplicaLocation, ...]
    size: int
    lease_end: float

    def expired(self, now: float) -> bool:
        """Whether the lease is over at `now` (the replicas may have moved). Pure."""
        return now >= self.lease_end


Lookup = Located | TsukimiError | None  # one key of `locate`: found, failed, or a miss


@dataclass(slots=True)
class _Pending:
    view: memoryview
    offset: int
    replicas: list[p.ReplicaLocation]
    lease_end: float
    attempt: int = 0


class RangeReads:
    """Range reads with the client's master link and Transfer Engine; keeps no state of its
    own between calls (thread-safe)."""

    def __init__(self, link: MasterLink, engine: TransferEngine, clock: Clock) -> None:
        self._link = link
        self._engine = engine
        self._clock = clock

    def get_ranges(self, reads: Sequence[RangeRead], located: Mapping[str, Lookup] | None = None) -> list[GetResult]:
        """Each read's `GetResult`, in order: `data` a view of its `dest` holding the bytes;
        a miss is `GetResult()`; `error` InvalidArgument (a bad key, a range outside the
        object, a key `located` lacks), InvalidBufferError (a `dest` that is not a writable
        buffer), TransferError (no replica readable).

        Args:
            reads: the ranges to read.
            located: what `locate` returned for the keys read (no master round trip then;
                the caller checks `Located.expired` first); None: look them up now.
        Raises:
            Only for the whole call: RpcTimeout / MasterUnavailable.
        """
        results = [GetResult()] * len(reads)
        if located is None:
            keys = list(dict.fromkeys(r.key for r in reads if isinstance(r.key, str) and r.key))
            located = dict(zip(keys, self.locate(keys), strict=True))
        pending: dict[int, _Pending] = {}
        lease_end = math.inf
        for i, read in enumerate(reads):
            try:
                target = self._target(read, located)
            except TsukimiError as exc:
                results[i] = GetResult(error=exc)
                continue
            if target is not None:
                pending[i] = target
                lease_end = min(lease_end, target.lease_end)
        self._read(pending, results, lease_end)
        return results

    def locate(self, keys: Sequence[str]) -> list[Lookup]:
        """Each key's complete memory replicas (a read lease, one master round trip per
        `p.MAX_BATCH` keys): a `Located`, the master's error for the key, or None on a miss
        (disk copies alone are a miss here). Raises only for the whole call."""
        now = self._clock.now()  # NOTE: before the round trip: the lease may start any time during it
        lookups: list[Lookup] = []
        for start in range(0, len(keys), p.MAX_BATCH):
            chunk = keys[start : start + p.MAX_BATCH]
            for result in call_batch(self._link, [p.GetReplicas(k) for k in chunk]):
                if isinstance(result, p.Failure):
                    lookups.append(p.error_of(result))
                elif isinstance(result, p.GetReplicasResult) and result.replicas:
                    lease_end = now + LEASE_SHARE * result.lease_s
                    lookups.append(Located(tuple(result.replicas), result.size, lease_end))
                else:
                    lookups.append(None)
        return lookups

    @staticmethod
    def _target(read: RangeRead, located: Mapping[str, Lookup]) -> _Pending | None:
        """The read to do, or None for a miss. Raises the read's own error."""
        p.check_key(read.key)
        if read.key not in located:
            raise InvalidArgument(f"{read.key!r} was not located")
        found = located[read.key]
        if isinstance(found, TsukimiError):
            raise found
        if found is None:
            return None
        view = byte_view(read.dest, writable=True, with_address=False)[0]
        if not isinstance(read.offset, int) or read.offset < 0 or read.offset + len(view) > found.size:
            raise InvalidArgument(
                f"bytes [{read.offset}, {read.offset}+{len(view)}) are outside {read.key!r} ({found.size} bytes)"
            )
        return _Pending(view, read.offset, list(found.replicas), found.lease_end)

    def _read(self, pending: dict[int, _Pending], results: list[GetResult], lease_end: float) -> None:
        """READ rounds: every range still unread tries its next replica."""
        while pending:
            order = []
            requests = []
            for i in list(pending):
                target = pending[i]
                loc = target.replicas[target.attempt]
                mine = local_view(self._engine, loc.te_segment, loc.address + target.offset, len(target.view))
                if mine is not None:  # in our own segment: a memcpy (local_replicas.py)
                    scatter(mine, [target.view])
                    results[i] = GetResult(target.view)
                    del pending[i]
                    continue
                order.append(i)
                requests.append(TransferRequest(OpCode.READ, loc.te_segment, loc.address + target.offset, target.view))
            if not requests:
                return
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
