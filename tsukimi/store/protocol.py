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

import json
from dataclasses import asdict, dataclass

import msgspec

from tsukimi.errors import InvalidArgument, ProtocolError, TsukimiError, error_from_code
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
    """How an object is stored: replica count, pins, preferred holders (TE segment names)."""

    replicas: int = 1
    soft_pin: bool = False
    hard_pin: bool = False
    preferred_segments: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.replicas <= MAX_REPLICAS:
            raise InvalidArgument(f"replicas must be in 1..{MAX_REPLICAS}, got {self.replicas}")


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


# -- results ------------------------------------------------------------------------------


class Ok(msgspec.Struct, frozen=True, tag=True):
    pass


class HeartbeatResult(msgspec.Struct, frozen=True, tag=True):
    known: bool  # False: the master does not know this client (it restarted): remount


class PutStartResult(msgspec.Struct, frozen=True, tag=True):
    replicas: list[ReplicaLocation]
    put_id: int = 0


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


class SegmentInfo(msgspec.Struct, frozen=True):
    segment_id: str
    te_segment: str
    client_id: str
    capacity: int
    used: int
    healthy: bool


class SegmentsResult(msgspec.Struct, frozen=True, tag=True):
    segments: list[SegmentInfo]


Request = (
    Heartbeat
    | MountSegment
    | UnmountSegment
    | PutStart
    | PutEnd
    | PutRevoke
    | GetReplicas
    | Exists
    | Remove
    | RemoveAll
    | Batch
    | QueryKey
    | ListSegments
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
    | RemoveAllResult
    | BatchResult
    | ObjectInfo
    | SegmentsResult
    | disk.DiskSyncResult
    | disk.DiskFilesResult
    | disk.MasterInfoResult
    | Failure
)
REQUEST_TYPES: tuple[type[msgspec.Struct], ...] = (
    Heartbeat, MountSegment, UnmountSegment, PutStart, PutEnd, PutRevoke, GetReplicas, Exists, Remove,
    RemoveAll, Batch, QueryKey, ListSegments, *disk.DISK_REQUESTS,
)  # fmt: skip
RESPONSE_TYPES: tuple[type[msgspec.Struct], ...] = (
    Ok, HeartbeatResult, PutStartResult, GetReplicasResult, ExistsResult, RemoveAllResult, BatchResult,
    ObjectInfo, SegmentsResult, *disk.DISK_RESULTS, Failure,
)  # fmt: skip
CODEC = Codec(REQUEST_TYPES, RESPONSE_TYPES)
"""The master's RPC codec: the server and every client use this one."""


@dataclass(frozen=True, slots=True)
class LeaderInfo:
    """What an HA leader publishes under `leader_key` and clients read to find it."""

    rpc: str
    http: str
    name: str
    pid: int = 0

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> LeaderInfo:
        """Raises ProtocolError on a malformed value."""
        try:
            fields = json.loads(data)
            return cls(str(fields["rpc"]), str(fields["http"]), str(fields["name"]), int(fields.get("pid", 0)))
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"malformed leader record in etcd: {exc}") from exc


def leader_key(cluster: str) -> bytes:
    """The etcd key of the HA group `cluster`'s leader record."""
    return f"/tsukimi/{cluster}/leader".encode()
