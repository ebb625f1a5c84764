"""`ReplicaAdmin`: a store client's calls on many keys and on replica sets, a part of
client.py's `StoreClient` (which delegates to it): clearing replicas, removing by pattern,
describing keys (where each replica is), and copying or moving an object's replicas with
master-tracked tasks.

    client.clear_replicas(["a", "b"], te_segment="node1:12345")   # keys cleared
    client.remove_matching(r"^session-17/")                     # how many removed
    client.describe(["a", "b"])                                 # ObjectInfo | None each
    task_id = client.copy("a", ["node2:12346"])                 # or client.move(key, src, dst)
    client.wait_task(task_id)                                   # TaskInfo, status "succeeded"

A task is carried out by the client that owns its target segment (tsukimi/store/task_runner.py)
and tracked by the master (tsukimi/store/master/tasks.py); these calls only start and watch it.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from tsukimi.clock import Clock
from tsukimi.errors import InvalidArgument, RpcTimeout, TaskNotFound
from tsukimi.store import protocol as p
from tsukimi.store.master_link import MasterLink

TASK_POLL_S = 0.05


def _new_task_id() -> int:
    """A random task id: a create retried after a lost reply (HA failover) is the same task."""
    return secrets.randbits(62) | 1


class ReplicaAdmin:
    """Replica calls over the client's master link; keeps no state of its own (thread-safe)."""

    def __init__(self, link: MasterLink, clock: Clock) -> None:
        self._link = link
        self._clock = clock

    def clear_replicas(self, keys: Sequence[str], te_segment: str = "") -> list[str]:
        """Drop the replicas of those `keys` whose read leases have ended: all of them
        (`te_segment` ""), or those held by the TE segment `te_segment`. An object left
        without a replica is gone. Mutates the store.

        Returns:
            The keys cleared, each once; missing, leased, pending and (with `te_segment`)
            keys with no replica there are skipped.
        Raises:
            InvalidArgument (a bad key: nothing cleared), RpcTimeout / MasterUnavailable.
        """
        cleared: list[str] = []
        for start in range(0, len(keys), p.MAX_BATCH):
            chunk = list(keys[start : start + p.MAX_BATCH])
            cleared += self._link.call_as(p.ClearReplicas(chunk, te_segment), p.KeysResult).keys
        return list(dict.fromkeys(cleared))

    def remove_matching(self, pattern: str, force: bool = False) -> int:
        """Remove every object whose key matches the regular expression `pattern` (Python's
        `re.search`, run by the master: keep it simple); leased ones only with `force`.
        Returns how many were removed. Raises InvalidArgument (not a regular expression)."""
        return self._link.call_as(p.RemoveMatching(pattern, force), p.RemoveAllResult).removed

    def describe(self, keys: Sequence[str]) -> list[p.ObjectInfo | None]:
        """What the master knows of each key (its replicas, size, pins; `complete` False
        while a put is in progress), or None. Grants no lease. Raises InvalidArgument."""
        infos: list[p.ObjectInfo | None] = []
        for start in range(0, len(keys), p.MAX_BATCH):
            chunk = list(keys[start : start + p.MAX_BATCH])
            infos += self._link.call_as(p.DescribeKeys(chunk), p.DescribeResult).infos
        return infos

    def copy(self, key: str, targets: Sequence[str]) -> int:
        """Start copying `key` onto each TE segment in `targets` that holds no replica of it
        yet; returns the task's id (`task`, `wait_task`). Mutates the store.

        Raises:
            InvalidArgument: a bad key; no target, one twice, one not mounted.
            ObjectNotFound: no complete object `key`.
            TaskInFlight: `key` has a copy or move task in flight.
            OutOfSpace: a target has no room (tasks do not evict).
        """
        request = p.CreateCopyTask(key, list(targets), _new_task_id())
        return self._link.call_as(request, p.TaskCreated).task_id

    def move(self, key: str, source: str, target: str) -> int:
        """Start moving the replica of `key` that TE segment `source` holds to `target`;
        returns the task's id. Raises as `copy`, and InvalidArgument when `source` holds no
        replica or `target` holds one already."""
        request = p.CreateMoveTask(key, source, target, _new_task_id())
        return self._link.call_as(request, p.TaskCreated).task_id

    def task(self, task_id: int) -> p.TaskInfo:
        """A task's state. Raises TaskNotFound (unknown, or forgotten after many others)."""
        if not isinstance(task_id, int) or not 0 < task_id < 1 << 63:
            raise TaskNotFound(f"no task {task_id!r}: task ids are in 1..2**63-1")
        return self._link.call_as(p.QueryTask(task_id), p.TaskInfo)

    def wait_task(self, task_id: int, timeout_s: float = 30.0) -> p.TaskInfo:
        """Poll a task until it has succeeded or failed; its final state.
        Raises TaskNotFound, RpcTimeout (still in flight after `timeout_s`)."""
        if timeout_s <= 0:
            raise InvalidArgument(f"timeout_s must be > 0, got {timeout_s}")
        deadline = self._clock.now() + timeout_s
        while True:
            info = self.task(task_id)
            if info.status in ("succeeded", "failed"):
                return info
            if self._clock.now() >= deadline:
                raise RpcTimeout(f"task {task_id} is still {info.status} after {timeout_s} s")
            self._clock.sleep(TASK_POLL_S)
