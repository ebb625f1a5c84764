"""The master's view of disks: the disk each holder offers, which keys have a copy on it
(in least recently used order), its usage, the tasks queued for its holder or handed out,
and the copies of disks whose holder was dropped (`lost`: they may come back when the disk
is registered again).

Pure bookkeeping, no object knowledge (tsukimi/store/master/tiers.py decides). A disk's
`used` counts its copies, the bytes reserved for offloads in flight, and copies retired
under a read lease; a copy's bytes are given back when its DeleteTask is queued (deletes
go to the front of the queue and a holder runs its tasks in order, so the holder has
deleted the file before it writes anything the freed space was given to).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from tsukimi.eviction import LruPolicy
from tsukimi.store.master.segments import Placement
from tsukimi.store.protocol import ReplicaConfig

TaskKind = Literal["offload", "promote", "delete"]


@dataclass(slots=True)
class Task:
    """One piece of disk work for a holder. `placement`: the memory replica an offload
    reads, or the block a promotion writes. `deadline`: 0 while queued; once handed out,
    when the master gives up on it."""

    task_id: int
    kind: TaskKind
    disk_id: str
    key: str
    put_id: int
    size: int
    placement: Placement | None = None
    evict_after: bool = False  # an offload for eviction: free the memory once copied
    deadline: float = 0.0


@dataclass(slots=True)
class Disk:
    disk_id: str
    client_id: str
    endpoint: str
    capacity: int
    used: int = 0
    inflight: int = 0  # bytes of offloads queued or handed out
    keys: LruPolicy[str] = field(default_factory=LruPolicy)
    queue: deque[int] = field(default_factory=deque)


class DiskRegistry:
    """Disks, their tasks and the lost copies. Not thread-safe."""

    def __init__(self) -> None:
        self.disks: dict[str, Disk] = {}
        self.by_client: dict[str, str] = {}  # client id -> its disk id
        self.tasks: dict[int, Task] = {}
        # disk id -> {key: (put id, config)} of the copies it had (an adopted copy's object
        # gets its replica group and writer session back from the config)
        self.lost: dict[str, dict[str, tuple[int, ReplicaConfig]]] = {}
        self._ids = itertools.count(1)

    def add(self, disk: Disk) -> None:
        """Mount `disk` (mutates). The caller dropped any disk of the same id or client."""
        assert disk.disk_id not in self.disks and disk.client_id not in self.by_client
        self.disks[disk.disk_id] = disk
        self.by_client[disk.client_id] = disk.disk_id

    def of_client(self, client_id: str) -> Disk | None:
        disk_id = self.by_client.get(client_id)
        return None if disk_id is None else self.disks[disk_id]

    def remove(self, disk: Disk) -> list[Task]:
        """Unmount `disk` and forget its tasks, which are returned (mutates)."""
        del self.disks[disk.disk_id]
        del self.by_client[disk.client_id]
        tasks = [t for t in self.tasks.values() if t.disk_id == disk.disk_id]
        for task in tasks:
            del self.tasks[task.task_id]
        return tasks

    def queue(self, disk: Disk, task: Task) -> Task:
        """Queue `task` (its id is drawn here) for `disk`'s holder; deletes first (mutates)."""
        task.task_id = next(self._ids)
        task.deadline = 0.0
        self.tasks[task.task_id] = task
        if task.kind == "delete":
            disk.queue.appendleft(task.task_id)
        else:
            disk.queue.append(task.task_id)
        return task

    def requeue(self, disk: Disk, task: Task) -> None:
        """Queue a handed-out task again, at the front, under the same id (mutates)."""
        task.deadline = 0.0
        self.tasks[task.task_id] = task
        disk.queue.appendleft(task.task_id)

    def unqueue(self, disk: Disk, task: Task) -> None:
        """Forget a task not yet handed out (mutates)."""
        assert task.deadline == 0.0
        del self.tasks[task.task_id]
        disk.queue.remove(task.task_id)

    def hand_out(self, disk: Disk, max_tasks: int, deadline: float) -> list[Task]:
        """Up to `max_tasks` queued tasks of `disk`, in order, now due by `deadline` (mutates)."""
        out: list[Task] = []
        while disk.queue and len(out) < max_tasks:
            task = self.tasks[disk.queue.popleft()]
            task.deadline = deadline
            out.append(task)
        return out

    def expired(self, now: float) -> list[Task]:
        """Handed-out tasks past their deadline, removed (mutates)."""
        late = [t for t in self.tasks.values() if 0 < t.deadline <= now]
        for task in late:
            del self.tasks[task.task_id]
        return late

    def forget_lost(self, key: str) -> None:
        """`key` was written or removed: no lost copy of it may come back (mutates)."""
        for copies in self.lost.values():
            copies.pop(key, None)

    def check_invariants(self) -> None:
        """Every task's disk is mounted and queued tasks are exactly those without deadline."""
        queued = {tid for disk in self.disks.values() for tid in disk.queue}
        assert len(queued) == sum(len(d.queue) for d in self.disks.values()), "a task queued twice"
        for task in self.tasks.values():
            assert task.disk_id in self.disks, f"task {task.task_id} of an unmounted disk"
            assert (task.deadline == 0.0) == (task.task_id in queued), f"task {task.task_id} queue state"
        assert queued <= set(self.tasks)
        assert {d.client_id: d.disk_id for d in self.disks.values()} == self.by_client
        for disk in self.disks.values():
            assert disk.inflight >= 0 and disk.used >= 0, f"{disk.disk_id}: negative usage"
