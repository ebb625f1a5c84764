"""The store's boundary types: every master operation and its result, as msgspec Structs,
the RPC `CODEC` that carries them, and `LeaderInfo`, the record an HA leader publishes.

They are at once the arguments of `MasterState` (the pure state machine), the RPC messages
between clients and the master, and the records of the master's operation log: every state
change is one of these operations, applied in order. Clients import only this module (and
the RPC client), never the master's server or its HA controller.

Addresses: a replica lives in a client's mounted segment; `ReplicaLocation.address` is the
address in the holder's Transfer Engine segment (`te_segment`), ready for a TE READ/WRITE.
A copy on a holder's disk is a `DiskLocation` (the disk tier's types: disk_protocol.py).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from tsukimi.errors import InvalidArgument, TsukimiError, error_from_code
from tsukimi.rpc.codec import Codec
from tsukimi.store import disk_protocol as disk
from tsukimi.store.disk_protocol import DiskLocation

MAX_KEY_BYTES = 4096
MAX_REPLICAS = 8
MAX_BATCH = 4096
MAX_OBJECT_BYTES = 1 << 40


def check_key(key: str) -> None:
    """Raises InvalidArgument unless `key` is a non-empty str of at most MAX_KEY_BYTES UTF-8 bytes."""
    if not isinstance(key, str) or not key:
        raise InvalidArgument(f"a key must be a non-empty string, got {key!r:.80}")
    if len(key.encode()) > MAX_KEY_BYTES:
        raise InvalidArgument(f"key of {len(key.encode())} bytes is over the limit of {MAX_KEY_BYTES}")


class ReplicaConfig(msgspec.Struct, frozen=True):
    """How an object is stored: replica count, pins, preferred holders (TE segment names).

    A soft pin lasts `soft_pin_ttl_s` (None: the master's `soft_pin_ttl_s`); then the object
    is evicted like any other. `keep_soft_pin`: the new version of an upsert takes the old
    version's soft pin as it is (none for a new key); it excludes `soft_pin` and a TTL.

    `group` ("" none) makes the object a member of a replica group (master/groups.py): a read
    of any member renews every member's lease, and eviction takes the members along. A key
    joins its group when its first version completes and stays in it while it exists.
    `session` names the writing session (Mooncake's `session_ids`), kept as metadata."""

    replicas: int = 1
    soft_pin: bool = False
    hard_pin: bool = False
    preferred_segments: tuple[str, ...] = ()
    soft_pin_ttl_s: float | None = None
    keep_soft_pin: bool = False
    group: str = ""
    session: str = ""

    def __post_init__(self) -> None:
        if not 1 <= self.replicas <= MAX_REPLICAS:
            raise InvalidArgument(f"replicas must be in 1..{MAX_REPLICAS}, got {self.replicas}")
        if self.soft_pin_ttl_s is not None and not (self.soft_pin and 0 <= self.soft_pin_ttl_s < 1e9):
            raise InvalidArgument(f"soft_pin_ttl_s {self.soft_pin_ttl_s} needs soft_pin and a value in [0, 1e9)")
        if self.keep_soft_pin and self.soft_pin:
            raise InvalidArgument("keep_soft_pin takes the old version's soft pin: it excludes soft_pin")
        for name, value in (("group", self.group), ("session", self.session)):
            if len(value.encode()) > MAX_KEY_BYTES:
                raise InvalidArgument(f"{name} of {len(value.encode())} bytes is over the limit of {MAX_KEY_BYTES}")


class ReplicaLocation(msgspec.Struct, frozen=True):
    te_segment: str
    address: int
    size: int


# -- operations (requests) ------------------------------------------------------------


class Heartbeat(msgspec.Struct, frozen=True, tag=True):
    client_id: str


class MountSegment(msgspec.Struct, frozen=True, tag=True):
    """A client contributes [base, base + size) of its TE segment `te_segment`.

    `incarnation` names the process behind the TE segment (new on every start): a mount of
    the same `te_segment` by another incarnation means the old process is gone (the holder
    restarted under the same name, empty), so its segments and replicas are dropped."""

    client_id: str
    segment_id: str
    te_segment: str
    base: int
    size: int
    incarnation: str = ""


class UnmountSegment(msgspec.Struct, frozen=True, tag=True):
    client_id: str
    segment_id: str


class PutStart(msgspec.Struct, frozen=True, tag=True):
    """`put_id`: 0 lets the master draw one; a client that may retry proposes its own
    (random, non-zero), which makes a retried PutStart return the same put. `checksum`: the
    crc32c of the value, stored and handed to readers (None: not checked)."""

    client_id: str
    key: str
    size: int
    config: ReplicaConfig = ReplicaConfig()
    upsert: bool = False
    put_id: int = 0
    checksum: int | None = None


class PutEnd(msgspec.Struct, frozen=True, tag=True):
    """`put_id` (from PutStartResult) names the put being ended: a stale PutEnd of a put that
    was reclaimed cannot complete a newer put of the same key. 0: unchecked."""

    client_id: str
    key: str
    put_id: int = 0


class PutRevoke(msgspec.Struct, frozen=True, tag=True):
    client_id: str
    key: str
    put_id: int = 0


class GetReplicas(msgspec.Struct, frozen=True, tag=True):
    key: str


class Exists(msgspec.Struct, frozen=True, tag=True):
    key: str


class ExistsMany(msgspec.Struct, frozen=True, tag=True):
    """Whether each of `keys` (at most MAX_BATCH) exists: one message with one list of keys,
    where a `Batch` of `Exists` would carry a tagged struct per key each way (the look-up
    every vLLM/SGLang scheduler step makes). A bad key fails the whole call."""

    keys: list[str]


class Remove(msgspec.Struct, frozen=True, tag=True):
    key: str
    force: bool = False


class RemoveAll(msgspec.Struct, frozen=True, tag=True):
    force: bool = False


class Batch(msgspec.Struct, frozen=True, tag=True):
    """Several operations applied in order; each gets its own result or error."""

    ops: list[PutStart | PutEnd | PutRevoke | GetReplicas | Exists | Remove]


class QueryKey(msgspec.Struct, frozen=True, tag=True):
    key: str


class ListSegments(msgspec.Struct, frozen=True, tag=True):
    pass


class ClearReplicas(msgspec.Struct, frozen=True, tag=True):
    """Drop the replicas of complete, unleased objects: all of them (`te_segment` ""), or
    those held in `te_segment`; an object left with none is gone. Leased keys are skipped."""

    keys: list[str]
    te_segment: str = ""


class RemoveMatching(msgspec.Struct, frozen=True, tag=True):
    """Remove every complete object whose key `re.search`es `pattern` (leased ones only with force)."""

    pattern: str
    force: bool = False


class DescribeKeys(msgspec.Struct, frozen=True, tag=True):
    keys: list[str]  # QueryKey for several keys at once (grants no lease)


class CreateCopyTask(msgspec.Struct, frozen=True, tag=True):
    """Copy a complete object onto each of `targets` (TE segment names) that lacks a replica.
    `task_id`: as PutStart's put_id (0: the master draws one; a retry returns the same task)."""

    key: str
    targets: list[str]
    task_id: int = 0


class CreateMoveTask(msgspec.Struct, frozen=True, tag=True):
    """Move an object's replica from the holder `source` to `target` (TE segment names)."""

    key: str
    source: str
    target: str
    task_id: int = 0


class QueryTask(msgspec.Struct, frozen=True, tag=True):
    task_id: int


class FinishTask(msgspec.Struct, frozen=True, tag=True):
    """A task's executor reports it done: `error` "" (the targets hold the bytes) or why not."""

    client_id: str
    task_id: int
    error: str = ""


# -- results ------------------------------------------------------------------------------


class Ok(msgspec.Struct, frozen=True, tag=True):
    pass


class TaskAssignment(msgspec.Struct, frozen=True):
    """A copy or move task handed to its executor: READ the object (`size` bytes) from one of
    `sources`, WRITE it to every one of `targets`, then send `FinishTask`."""

    task_id: int
    key: str
    size: int
    sources: list[ReplicaLocation]
    targets: list[ReplicaLocation]


class HeartbeatResult(msgspec.Struct, frozen=True, tag=True):
    known: bool  # False: the master does not know this client (it restarted): remount
    tasks: list[TaskAssignment] = []  # copy / move tasks this client is to carry out now


class PutStartResult(msgspec.Struct, frozen=True, tag=True):
    """Where to write; `timeout_s` is how long the master keeps the put open before it
    reclaims it (0: a master that does not say)."""

    replicas: list[ReplicaLocation]
    put_id: int = 0
    timeout_s: float = 0.0


class GetReplicasResult(msgspec.Struct, frozen=True, tag=True):
    """Complete replicas in the order to try them; empty on a miss. `lease_s` is how long
    the replicas are guaranteed to stay in place; `checksum` the writer's crc32c, if any."""

    replicas: list[ReplicaLocation]
    size: int = 0
    lease_s: float = 0.0
    checksum: int | None = None
    disk: list[DiskLocation] = []  # copies on holders' disks, tried after `replicas`

    @property
    def found(self) -> bool:
        return bool(self.replicas or self.disk)


class ExistsResult(msgspec.Struct, frozen=True, tag=True):
    exists: bool


class ExistsManyResult(msgspec.Struct, frozen=True, tag=True):
    exists: list[bool]


class RemoveAllResult(msgspec.Struct, frozen=True, tag=True):
    removed: int


class Failure(msgspec.Struct, frozen=True, tag=True):
    """One failed operation of a batch: an error code and message (see tsukimi.errors)."""

    code: str
    message: str


BatchResultItem = Ok | PutStartResult | GetReplicasResult | ExistsResult | Failure
"""The result of one operation of a `Batch`, in its place."""


def error_of(failure: Failure) -> TsukimiError:
    """The error a `Failure` stands for, as the class raised on the master (pure)."""
    return error_from_code(failure.code, failure.message)


class BatchResult(msgspec.Struct, frozen=True, tag=True):
    results: list[BatchResultItem]


class ObjectInfo(msgspec.Struct, frozen=True, tag=True):
    key: str
    size: int
    complete: bool
    replicas: list[ReplicaLocation]
    soft_pin: bool
    hard_pin: bool
    lease_remaining_s: float
    disk_replicas: list[DiskLocation] = []
    group: str = ""  # the replica group ("" none: ReplicaConfig.group)
    session: str = ""  # the session that wrote this version ("" none: ReplicaConfig.session)


class SegmentInfo(msgspec.Struct, frozen=True):
    segment_id: str
    te_segment: str
    client_id: str
    capacity: int
    used: int
    healthy: bool


class SegmentsResult(msgspec.Struct, frozen=True, tag=True):
    segments: list[SegmentInfo]


class KeysResult(msgspec.Struct, frozen=True, tag=True):
    keys: list[str]


class DescribeResult(msgspec.Struct, frozen=True, tag=True):
    infos: list[ObjectInfo | None]  # per key, in order; None: no such object


class TaskCreated(msgspec.Struct, frozen=True, tag=True):
    task_id: int


TaskKind = Literal["copy", "move"]
TaskStatus = Literal["pending", "processing", "succeeded", "failed"]


class TaskInfo(msgspec.Struct, frozen=True, tag=True):
    """A task as the master sees it; `age_s` / `updated_s`: seconds since it was created /
    last changed state (the master's clock is monotonic: callers add their own wall time)."""

    task_id: int
    kind: TaskKind
    key: str
    status: TaskStatus
    executor: str
    message: str
    age_s: float
    updated_s: float


Request = (
    Heartbeat
    | MountSegment
    | UnmountSegment
    | PutStart
    | PutEnd
    | PutRevoke
    | GetReplicas
    | Exists
    | ExistsMany
    | Remove
    | RemoveAll
    | Batch
    | QueryKey
    | ListSegments
    | ClearReplicas
    | RemoveMatching
    | DescribeKeys
    | CreateCopyTask
    | CreateMoveTask
    | QueryTask
    | FinishTask
    | disk.MountDisk
    | disk.UnmountDisk
    | disk.RegisterDiskFiles
    | disk.DiskSync
    | disk.MasterInfo
)
Response = (
    Ok
    | HeartbeatResult
    | PutStartResult
    | GetReplicasResult
    | ExistsResult
    | ExistsManyResult
    | RemoveAllResult
    | BatchResult
    | ObjectInfo
    | SegmentsResult
    | disk.DiskSyncResult
    | disk.DiskFilesResult
    | disk.MasterInfoResult
    | Failure
    | KeysResult
    | DescribeResult
    | TaskCreated
    | TaskInfo
)
REQUEST_TYPES: tuple[type[msgspec.Struct], ...] = (
    Heartbeat,
    MountSegment,
    UnmountSegment,
    PutStart,
    PutEnd,
    PutRevoke,
    GetReplicas,
    Exists,
    ExistsMany,
    Remove,
    RemoveAll,
    Batch,
    QueryKey,
    ListSegments,
    ClearReplicas,
    RemoveMatching,
    DescribeKeys,
    CreateCopyTask,
    CreateMoveTask,
    QueryTask,
    FinishTask,
    *disk.DISK_REQUESTS,
)
RESPONSE_TYPES: tuple[type[msgspec.Struct], ...] = (
    Ok,
    HeartbeatResult,
    PutStartResult,
    GetReplicasResult,
    ExistsResult,
    ExistsManyResult,
    RemoveAllResult,
    BatchResult,
    ObjectInfo,
    SegmentsResult,
    Failure,
    KeysResult,
    DescribeResult,
    TaskCreated,
    TaskInfo,
    *disk.DISK_RESULTS,
)
CODEC = Codec(REQUEST_TYPES, RESPONSE_TYPES)
"""The master's RPC codec: the server and every client use this one."""
