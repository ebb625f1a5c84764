"""The replica-level part of `MooncakeDistributedStore` and its types: where an object's
replicas are (`ReplicaDescriptor`), clearing them, removing by pattern, and copy / move tasks
(`QueryTaskResponse`).

`ReplicaAdmin` maps each onto tsukimi's `StoreClient` (replica_admin.py). Segment names are
Transfer Engine segment names, what `get_hostname()` returns. Task ids are Mooncake's (high,
low) pairs of tsukimi's integer ids; times are milliseconds since the epoch, as Mooncake's.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from tsukimi.auth import wall_time
from tsukimi.compat.mooncake.codes import OK, RPC_FAIL, code_of
from tsukimi.compat.mooncake.connection import StoreConnection
from tsukimi.errors import InvalidArgument, TsukimiError
from tsukimi.store import protocol as p
from tsukimi.store.client import StoreClient

logger = logging.getLogger(__name__)

_U64 = (1 << 64) - 1
TaskId = tuple[int, int]


class ReplicaStatus(enum.IntEnum):
    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class TaskType(enum.IntEnum):
    REPLICA_COPY = 0
    REPLICA_MOVE = 1


class TaskStatus(enum.IntEnum):
    PENDING = 0
    PROCESSING = 1
    FAILED = 2
    SUCCESS = 3


@dataclass
class Descriptor:
    """Where a memory replica is: its address in the holder's TE segment `transport_endpoint`."""

    buffer_address: int = 0
    size: int = 0
    transport_endpoint: str = ""


@dataclass
class MemoryDescriptor:
    buffer_descriptor: Descriptor = field(default_factory=Descriptor)


@dataclass
class DiskDescriptor:
    file_path: str = ""
    object_size: int = 0


@dataclass
class ReplicaDescriptor:
    """One replica of an object: in a holder's memory, or a copy on a holder's disk
    (Mooncake's LOCAL_DISK; tsukimi has no shared-filesystem DISK replicas)."""

    memory: MemoryDescriptor | None = None
    status: ReplicaStatus = ReplicaStatus.COMPLETE
    disk: DiskDescriptor | None = None

    def is_memory_replica(self) -> bool:
        return self.memory is not None

    def is_disk_replica(self) -> bool:
        return False

    def is_local_disk_replica(self) -> bool:
        return self.disk is not None

    def get_memory_descriptor(self) -> MemoryDescriptor:
        if self.memory is None:
            raise RuntimeError("Expected MemoryDescriptor: this is a disk replica")
        return self.memory

    def get_disk_descriptor(self) -> DiskDescriptor:
        if self.disk is None:
            raise RuntimeError("Expected DiskDescriptor: this is a memory replica")
        return self.disk


@dataclass
class QueryTaskResponse:
    """A task's state, as `query_task` returns it."""

    id: TaskId
    type: TaskType
    status: TaskStatus
    created_at_ms_epoch: int
    last_updated_at_ms_epoch: int
    assigned_client: TaskId
    message: str


_STATUS = {
    "pending": TaskStatus.PENDING,
    "processing": TaskStatus.PROCESSING,
    "succeeded": TaskStatus.SUCCESS,
    "failed": TaskStatus.FAILED,
}


class ReplicaAdmin:
    """Replica sets, pattern removal and copy / move tasks (answers Mooncake's codes, logged;
    raises TypeError for arguments of the wrong type, as Mooncake's bindings)."""

    def __init__(self, connection: StoreConnection) -> None:
        self._connection = connection

    def describe(self, keys: list[str]) -> dict[str, list[ReplicaDescriptor]]:
        """The replicas of each key that has an object (others are left out; {} on error)."""
        client = self._connection.ready()
        if client is None:
            return {}
        try:
            infos = client.describe(keys)
        except TsukimiError as exc:
            logger.error("batch_get_replica_desc failed: %s", exc)
            return {}
        return {
            info.key: _descriptors(info) for info in infos if info is not None and (info.replicas or info.disk_replicas)
        }

    def clear(self, keys: list[str], segment_name: str) -> list[str]:
        """Clear the replicas (all, or those in `segment_name`) of the keys whose leases have
        ended; the keys cleared. Invalid keys are logged and skipped."""
        client = self._connection.ready()
        if client is None:
            return []
        valid = []
        for key in keys:
            try:
                p.check_key(key)
                valid.append(key)
            except InvalidArgument as exc:
                logger.error("batch_replica_clear: %s", exc)
        try:
            return client.clear_replicas(valid, segment_name)
        except TsukimiError as exc:
            logger.error("batch_replica_clear failed: %s", exc)
            return []

    def remove_matching(self, regex_pattern: str, force: bool) -> int:
        """How many objects whose keys match were removed, or a negative code."""
        client = self._connection.ready()
        if client is None:
            return RPC_FAIL
        try:
            return client.remove_matching(regex_pattern, force)
        except TsukimiError as exc:
            logger.error("remove_by_regex(%r) failed: %s", regex_pattern, exc)
            return code_of(exc)

    def copy(self, key: str, targets: list[str]) -> tuple[TaskId, int]:
        """(task id, 0), or ((0, 0), a negative code). TypeError for targets not a list of str."""
        if isinstance(targets, str) or not all(isinstance(t, str) for t in targets):
            raise TypeError(f"targets must be a list of segment names, got {targets!r}")
        return self._task(lambda client: client.copy(key, list(targets)), f"copy of {key!r}")

    def move(self, key: str, source: str, target: str) -> tuple[TaskId, int]:
        """(task id, 0), or ((0, 0), a negative code)."""
        return self._task(lambda client: client.move(key, source, target), f"move of {key!r}")

    def query(self, task_id: TaskId) -> tuple[QueryTaskResponse | None, int]:
        """(the task's state, 0), or (None, a negative code: -1400 for an unknown task)."""
        if not (isinstance(task_id, tuple) and len(task_id) == 2 and all(isinstance(v, int) for v in task_id)):
            raise TypeError(f"task_id must be a (high, low) pair of ints, got {task_id!r}")
        client = self._connection.ready()
        if client is None:
            return None, RPC_FAIL
        try:
            info = client.task((task_id[0] << 64) | task_id[1])
        except TsukimiError as exc:
            logger.error("query_task %s failed: %s", task_id, exc)
            return None, code_of(exc)
        now_ms = wall_time() * 1000
        executor = int(info.executor, 16) if info.executor else 0
        response = QueryTaskResponse(
            _pair(info.task_id),
            TaskType.REPLICA_COPY if info.kind == "copy" else TaskType.REPLICA_MOVE,
            _STATUS[info.status],
            int(now_ms - info.age_s * 1000),
            int(now_ms - info.updated_s * 1000),
            _pair(executor),
            info.message,
        )
        return response, OK

    def _task(self, start: Callable[[StoreClient], int], what: str) -> tuple[TaskId, int]:
        client = self._connection.ready()
        if client is None:
            return (0, 0), RPC_FAIL
        try:
            return _pair(start(client)), OK
        except TsukimiError as exc:
            logger.error("%s failed: %s", what, exc)
            return (0, 0), code_of(exc)


def _descriptors(info: p.ObjectInfo) -> list[ReplicaDescriptor]:
    status = ReplicaStatus.COMPLETE if info.complete else ReplicaStatus.PROCESSING
    memory = [
        ReplicaDescriptor(MemoryDescriptor(Descriptor(r.address, r.size, r.te_segment)), status) for r in info.replicas
    ]
    disk = [ReplicaDescriptor(disk=DiskDescriptor(d.endpoint, d.size)) for d in info.disk_replicas]
    return memory + disk


def _pair(value: int) -> TaskId:
    return value >> 64 & _U64, value & _U64
