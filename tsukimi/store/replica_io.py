"""The bytes of store objects on their way to and from replicas, through the Transfer Engine.

The master hands out replica addresses; this module moves the bytes. `write_replicas` WRITEs
every replica of every started put in one TE batch; `read_replicas` READs each object from a
replica on the reader's host if it has one, else from one picked at random (`spread`), the
failed ones from the next in the master's order, and so on, all before the read lease ends (a
read that could finish later might read blocks already given to another object).
`read_disk_copies` then reads the objects that have no readable memory replica from a copy
on a holder's disk (tsukimi/store/disk_server.py).

An object may be moved in parts (`PutItem.parts`, `read_parts`): its bytes are the parts'
concatenation, and each part is one TE request at its own offset in the replica, straight
from or into the caller's buffer (no gathering copy):

    replica at A:  |  part 0 (n0 bytes)  |  part 1 (n1 bytes)  | ... |
                   A                     A + n0                A + n0 + n1

A replica that could not be moved is a `TransferError` for the store's caller (the put was
revoked, or the get failed on every replica: retriable, nothing half-done), whatever the
Transfer Engine reported; the engine's own error (`OutOfBounds` from a holder whose range
moved, `RpcTimeout`, `PeerError`, ...) is chained as its `__cause__`.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import crc32c

from tsukimi.clock import Clock
from tsukimi.device import DeviceRange
from tsukimi.errors import ChecksumMismatch, InvalidBufferError, TransferError, TsukimiError
from tsukimi.store import protocol as p
from tsukimi.store.disk_server import DiskReader
from tsukimi.store.local_replicas import gather, local_view, scatter
from tsukimi.transfer import OpCode, RequestState, RequestStatus, TransferEngine, TransferRequest

logger = logging.getLogger(__name__)

_PICK = random.Random()
LEASE_SHARE = 0.8  # reads must end within this share of the read lease
MIN_READ_S = 0.05


@dataclass(frozen=True, slots=True)
class GetResult:
    """One key of a get. `data` holds the bytes read: a view of the caller's buffer when one
    was given, else a new bytearray; None on a miss or a failure. `device`: the device range
    the bytes were read into, when the caller's buffer was device memory (`data` is then
    None). `error` says why a read failed (a miss is not an error)."""

    data: bytearray | memoryview | None = None
    error: TsukimiError | None = None
    device: DeviceRange | None = None

    @property
    def found(self) -> bool:
        return self.data is not None or self.device is not None

    @property
    def size(self) -> int:
        """Bytes read (0 on a miss or a failure)."""
        if self.device is not None:
            return self.device.length
        return 0 if self.data is None else len(self.data)

    def value(self) -> bytearray | memoryview | None:
        """The bytes in host memory, or None on a miss (and for a read into device memory:
        see `found`, `size`, `device`). Raises the error of a failed read."""
        if self.error is not None:
            raise self.error
        return self.data


@dataclass(frozen=True, slots=True)
class PartsResult:
    """One key of a get into parts: `size` bytes read (the object's size) when `found`;
    `error` says why a read failed (a miss is not an error)."""

    found: bool = False
    size: int = 0
    error: TsukimiError | None = None


@dataclass(frozen=True, slots=True)
class PutItem:
    """One object to put: its key, its bytes (the concatenation of `parts`, at least one)
    and how to store it."""

    key: str
    parts: tuple[memoryview, ...]
    config: p.ReplicaConfig
    upsert: bool

    @property
    def size(self) -> int:
        return sum(len(part) for part in self.parts)

    def crc32c(self) -> int:
        return parts_crc32c(self.parts)


def parts_crc32c(parts: Sequence[bytearray | memoryview]) -> int:
    """The crc32c of the parts' concatenation (computed part by part: nothing is joined)."""
    value = 0
    for part in parts:
        value = crc32c.crc32c(part, value)
    return value


@dataclass(slots=True)
class _Target:
    """A get in progress: where the bytes go (in order), the replicas to try in order, the crc32c."""

    key: str
    parts: tuple[bytearray | memoryview, ...]
    replicas: list[p.ReplicaLocation]
    checksum: int | None
    size: int


def spread(
    replicas: Sequence[p.ReplicaLocation],
    rng: random.Random = _PICK,
    on_this_host: Callable[[str], bool] | None = None,
    mine: str = "",
) -> list[p.ReplicaLocation]:
    """The order in which a get tries `replicas` (the master's order): those in the reader's
    own segment `mine` first (a memcpy: local_replicas.py), then the others on this host
    (`on_this_host(te_segment)`: shm beats any link), then one of the rest picked at random,
    then the rest in the master's order. Pure but for `rng`.

    NOTE: always reading the master's first replica would leave a hot key's extra replicas
    (master/hot.py) idle: every reader would still pull from the one holder. A random first
    pick spreads reads over the holders' links, as Mooncake's client does. The master lists
    replicas on silent holders last; a random pick may start there (1 in N while a holder is
    silent but not yet dropped), and then fails over to the master's first.
    """
    if len(replicas) < 2:
        return list(replicas)
    local = [r for r in replicas if on_this_host(r.te_segment)] if on_this_host is not None else []
    local.sort(key=lambda r: r.te_segment != mine)  # NOTE: stable: the master's order otherwise
    remote = [r for r in replicas if r not in local] if local else list(replicas)
    if len(remote) > 1:
        first = rng.randrange(len(remote))
        remote = [remote[first], *(r for i, r in enumerate(remote) if i != first)]
    return [*local, *remote]


def transfer_error(status: RequestStatus, what: str) -> TransferError:
    """A TransferError for a failed request, naming `what`, with the engine's error as cause."""
    error = TransferError(f"{what}: {status.reason}")
    error.__cause__ = status.error()
    return error


def write_replicas(
    engine: TransferEngine,
    puts: Sequence[PutItem],
    started: Sequence[p.BatchResultItem],
    errors: list[TsukimiError | None],
) -> None:
    """WRITE every replica of every started put, in one batch; a put whose write failed gets
    its error in `errors` (mutates it)."""
    requests: list[TransferRequest] = []
    owners: list[int] = []
    for i, result in enumerate(started):
        if isinstance(result, p.PutStartResult):
            for loc in result.replicas:
                view = local_view(engine, loc.te_segment, loc.address, puts[i].size)
                if view is not None:  # in our own segment: a memcpy (local_replicas.py)
                    gather(puts[i].parts, view)
                    continue
                requests += _part_requests(OpCode.WRITE, loc, puts[i].parts)
                owners += [i] * len(puts[i].parts)
    statuses = engine.transfer(requests) if requests else []
    for i, status in zip(owners, statuses, strict=True):
        if status.state is not RequestState.COMPLETED and errors[i] is None:
            errors[i] = transfer_error(status, f"writing a replica of {puts[i].key!r}")


def _part_requests(
    opcode: OpCode, loc: p.ReplicaLocation, parts: Sequence[bytearray | memoryview]
) -> list[TransferRequest]:
    """One request per part, each at its offset in the replica at `loc` (see the module)."""
    requests, offset = [], 0
    for part in parts:
        requests.append(TransferRequest(opcode, loc.te_segment, loc.address + offset, part))
        offset += len(part)
    return requests


def read_replicas(
    engine: TransferEngine,
    clock: Clock,
    keys: Sequence[str],
    found: Sequence[p.BatchResultItem],
    into: Sequence[memoryview] | None,
    checksum: bool,
    allocate: Callable[[int], bytearray] = bytearray,
) -> list[GetResult]:
    """READ each found object into its buffer (or a new `allocate(size)`), failing over
    replica by replica; misses stay `GetResult()`, master errors become failed results."""
    results = [GetResult()] * len(keys)
    targets: dict[int, _Target] = {}
    for i, result in enumerate(found):
        if isinstance(result, p.Failure):
            results[i] = GetResult(error=p.error_of(result))
        elif isinstance(result, p.GetReplicasResult) and result.replicas:
            dest: bytearray | memoryview = into[i] if into is not None else allocate(result.size)
            if len(dest) < result.size:
                error = InvalidBufferError(f"{keys[i]!r} is {result.size} bytes; the buffer holds {len(dest)}")
                results[i] = GetResult(error=error)
                continue
            if len(dest) > result.size:
                dest = memoryview(dest)[: result.size]
            targets[i] = _Target(
                keys[i],
                (dest,),
                spread(result.replicas, on_this_host=engine.on_this_host, mine=engine.name),
                result.checksum if checksum else None,
                result.size,
            )
    for i, failure in _read_rounds(engine, clock, targets, _lease_end(clock, found)).items():
        results[i] = GetResult(error=failure) if failure else GetResult(targets[i].parts[0])
    return results


def read_parts(
    engine: TransferEngine,
    clock: Clock,
    keys: Sequence[str],
    found: Sequence[p.BatchResultItem],
    into: Sequence[tuple[memoryview, ...]],
    checksum: bool,
) -> list[PartsResult]:
    """READ each found object into its parts, part i at the sum of the sizes before it
    (failing over replica by replica, like `read_replicas`). Parts whose sizes do not add up
    to the object's size are refused (InvalidBufferError): they would leave bytes unread or a
    part unfilled. Misses, and objects with disk copies only, stay `PartsResult()`."""
    results = [PartsResult()] * len(keys)
    targets: dict[int, _Target] = {}
    for i, result in enumerate(found):
        if isinstance(result, p.Failure):
            results[i] = PartsResult(error=p.error_of(result))
        elif isinstance(result, p.GetReplicasResult) and result.replicas:
            total = sum(len(part) for part in into[i])
            if total != result.size:
                what = f"{keys[i]!r} is {result.size} bytes; its {len(into[i])} buffers hold {total}"
                results[i] = PartsResult(error=InvalidBufferError(what))
                continue
            targets[i] = _Target(
                keys[i],
                into[i],
                spread(result.replicas, on_this_host=engine.on_this_host, mine=engine.name),
                result.checksum if checksum else None,
                total,
            )
    for i, failure in _read_rounds(engine, clock, targets, _lease_end(clock, found)).items():
        results[i] = PartsResult(error=failure) if failure else PartsResult(True, sum(map(len, targets[i].parts)))
    return results


def _lease_end(clock: Clock, found: Sequence[p.BatchResultItem]) -> float:
    """When reads must be done: a share of the shortest read lease granted."""
    lease_s = min((r.lease_s for r in found if isinstance(r, p.GetReplicasResult) and r.replicas), default=0.0)
    return clock.now() + LEASE_SHARE * lease_s


def _read_rounds(
    engine: TransferEngine, clock: Clock, targets: dict[int, _Target], lease_end: float
) -> dict[int, TsukimiError | None]:
    """One READ round per replica rank: the targets still unread try their next replica.
    Each target's outcome: None (read, checksum matched) or why it failed on every replica.
    A replica in our own segment is copied here and now (local_replicas.py)."""
    outcomes: dict[int, TsukimiError | None] = {}
    pending, attempt = dict(targets), 0
    while pending:
        order = list(pending)
        requests: list[TransferRequest] = []
        copied: set[int] = set()
        for i in order:
            target = pending[i]
            loc = target.replicas[attempt]
            view = local_view(engine, loc.te_segment, loc.address, target.size)
            if view is not None:
                scatter(view, target.parts)
                copied.add(i)
            else:
                requests += _part_requests(OpCode.READ, loc, target.parts)
        timeout_s = max(MIN_READ_S, lease_end - clock.now())
        statuses = iter(engine.transfer(requests, timeout_s=timeout_s) if requests else ())
        attempt += 1
        for i in order:
            target = pending[i]
            failed = None
            if i not in copied:
                parts_status = [next(statuses) for _ in target.parts]
                failed = next((s for s in parts_status if s.state is not RequestState.COMPLETED), None)
            if failed is None:
                if target.checksum is None or parts_crc32c(target.parts) == target.checksum:
                    outcomes[i] = None
                    del pending[i]
                    continue
                reason = f"crc32c mismatch in {target.replicas[attempt - 1].te_segment}"
                logger.warning("get %r: %s", target.key, reason)
            else:
                reason = failed.reason
            if attempt >= len(target.replicas):
                what = f"no replica of {target.key!r} was readable"
                outcomes[i] = transfer_error(failed, what) if failed else ChecksumMismatch(f"{what}: {reason}")
                logger.warning("get %r failed on every replica: %s", target.key, reason)
                del pending[i]
    return outcomes


def read_disk_copies(
    reader: DiskReader,
    keys: Sequence[str],
    found: Sequence[p.BatchResultItem],
    into: Sequence[memoryview] | None,
    results: list[GetResult],
    checksum: bool,
    allocate: Callable[[int], bytearray] = bytearray,
) -> list[GetResult]:
    """Read from a holder's disk each found object that no memory replica served (it has
    none, or none was readable); mutates and returns `results`."""
    for i, result in enumerate(found):
        got = results[i]
        if not isinstance(result, p.GetReplicasResult) or not result.disk or got.found:
            continue
        if got.error is not None and not isinstance(got.error, TransferError):
            continue  # e.g. the buffer is too small: no copy fits better
        dest: bytearray | memoryview = into[i] if into is not None else allocate(result.size)
        if len(dest) < result.size:
            error = InvalidBufferError(f"{keys[i]!r} is {result.size} bytes; the buffer holds {len(dest)}")
            results[i] = GetResult(error=error)
            continue
        view = memoryview(dest)[: result.size]
        failed = reader.read(keys[i], result.disk, view)
        if failed is None and checksum and result.checksum is not None and crc32c.crc32c(view) != result.checksum:
            failed = ChecksumMismatch(f"the disk copy of {keys[i]!r} does not match the writer's crc32c")
        if failed is not None:
            results[i] = GetResult(error=failed)
        else:
            results[i] = GetResult(dest if len(dest) == result.size else view)
    return results
