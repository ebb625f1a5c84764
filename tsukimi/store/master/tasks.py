"""The master's table of copy and move tasks (Mooncake's replica copy / move).

A task copies one complete object onto holders that lack a replica of it (`copy`), or moves
the replica of one holder to another (`move`). The master places the new blocks when the
task is created, and the task holds them until it ends; an executor (the client that owns
the first target segment) learns of it with its next heartbeat, READs the object from a
source replica, WRITEs every target, and reports back (`FinishTask`):

    pending --heartbeat--> processing --FinishTask--> succeeded | failed
        \\__________ deadline passed, target segment lost ___/--> failed

While a task is in flight its object is leased to it (no eviction, no remove without
force), so the source blocks stay in place; an object replaced or removed meanwhile fails
the task when it reports. One task per object at a time.

Pure and not thread-safe, like the rest of the master. Tasks are not in the HA log: a new
leader knows none (their blocks are retired with the other unowned blocks, journal.py).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from tsukimi.errors import OutOfSpace, TaskInFlight, TaskNotFound
from tsukimi.store.master.segments import Placement
from tsukimi.store.protocol import TaskInfo, TaskKind, TaskStatus

MAX_IN_FLIGHT = 10_000
MAX_FINISHED = 10_000  # finished tasks kept for QueryTask, oldest forgotten first


@dataclass(slots=True)
class Task:
    """One task. `put_id` names the object version it copies; `source` (move only) the holder
    whose replica goes; `targets` the blocks placed for it; `lease_before` the object's read
    lease before the task leased it."""

    task_id: int
    kind: TaskKind
    key: str
    put_id: int
    source: str
    targets: list[Placement]
    executor: str
    deadline: float
    lease_before: float
    created_at: float
    updated_at: float
    status: TaskStatus = "pending"
    message: str = ""

    @property
    def in_flight(self) -> bool:
        return self.status in ("pending", "processing")

    def info(self, now: float) -> TaskInfo:
        return TaskInfo(
            self.task_id,
            self.kind,
            self.key,
            self.status,
            self.executor,
            self.message,
            now - self.created_at,
            now - self.updated_at,
        )


class TaskTable:
    """Tasks by id: those in flight, and the last MAX_FINISHED that ended."""

    def __init__(self, first_id: int = 1) -> None:
        self._ids = itertools.count(first_id)
        self._tasks: OrderedDict[int, Task] = OrderedDict()
        self._by_key: dict[str, int] = {}  # key -> its task in flight

    def next_id(self) -> int:
        return next(self._ids)

    def check_room(self, key: str) -> None:
        """Whether a task for `key` may start (pure). Raises TaskInFlight (one for `key` is),
        OutOfSpace (MAX_IN_FLIGHT are)."""
        busy = self._by_key.get(key)
        if busy is not None:
            raise TaskInFlight(f"{key!r} has task {busy} in flight")
        if len(self._by_key) >= MAX_IN_FLIGHT:
            raise OutOfSpace(f"{MAX_IN_FLIGHT} copy / move tasks are in flight already")

    def add(self, task: Task) -> None:
        """Track a new task (mutates); `check_room` said it may start."""
        assert task.key not in self._by_key and task.task_id not in self._tasks
        self._tasks[task.task_id] = task
        if task.in_flight:
            self._by_key[task.key] = task.task_id
        self._trim()

    def get(self, task_id: int) -> Task:
        """Raises TaskNotFound."""
        task = self._tasks.get(task_id)
        if task is None:
            raise TaskNotFound(f"no task {task_id} (never created, forgotten, or from an earlier master)")
        return task

    def take(self, executor: str, now: float) -> list[Task]:
        """The pending tasks of `executor`, now processing (mutates)."""
        taken = [self._tasks[i] for i in self._by_key.values() if self._tasks[i].executor == executor]
        taken = [t for t in taken if t.status == "pending"]
        for task in taken:
            task.status, task.updated_at = "processing", now
        return taken

    def end(self, task: Task, status: TaskStatus, message: str, now: float) -> None:
        """End a task in flight (mutates); its blocks are the caller's to keep or free."""
        assert task.in_flight and status in ("succeeded", "failed")
        task.status, task.message, task.updated_at = status, message, now
        del self._by_key[task.key]
        self._trim()

    def fail_expired(self, now: float) -> list[Placement]:
        """Fail the tasks in flight past their deadline (mutates); the blocks they held, now
        the caller's to free. Their lease on the object has run out with the deadline."""
        blocks: list[Placement] = []
        for task in [t for t in self.in_flight() if t.deadline <= now]:
            self.end(task, "failed", "timed out before its executor reported", now)
            blocks += task.targets
        return blocks

    def fail_in(self, segment_ids: set[str], now: float) -> list[Placement]:
        """Fail the tasks in flight with a target block in `segment_ids`, segments going away
        (mutates); their blocks elsewhere, now the caller's to free."""
        blocks: list[Placement] = []
        for task in [t for t in self.in_flight() if any(p.segment_id in segment_ids for p in t.targets)]:
            self.end(task, "failed", "a target segment was unmounted", now)
            blocks += [p for p in task.targets if p.segment_id not in segment_ids]
        return blocks

    def in_flight(self) -> list[Task]:
        return [self._tasks[i] for i in self._by_key.values()]

    def placements(self) -> list[Placement]:
        """The blocks that tasks in flight hold."""
        return [p for t in self.in_flight() for p in t.targets]

    def _trim(self) -> None:
        finished = len(self._tasks) - len(self._by_key)
        for task_id in list(self._tasks):
            if finished <= MAX_FINISHED:
                break
            if not self._tasks[task_id].in_flight:
                del self._tasks[task_id]
                finished -= 1

    def check_invariants(self) -> None:
        """The key index holds exactly the tasks in flight, one per key."""
        flying = {t.task_id for t in self._tasks.values() if t.in_flight}
        assert flying == set(self._by_key.values()), "the key index and the tasks in flight disagree"
        assert all(self._tasks[i].key == key for key, i in self._by_key.items())
