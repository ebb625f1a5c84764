"""Starting a copy or move task (tasks.py): place a block on each target holder and track
the task, leasing its object to it. Shared by the admin operations (admin.py) and hot-key
replication (hot.py); pure, over the master's tables."""

from __future__ import annotations

from typing import Protocol

from tsukimi.clock import Clock
from tsukimi.config import MasterConfig
from tsukimi.errors import OutOfSpace
from tsukimi.store.master.records import ObjectRecord
from tsukimi.store.master.segments import Placement, SegmentRegistry
from tsukimi.store.master.tasks import Task, TaskTable
from tsukimi.store.protocol import TaskKind


class TaskHost(Protocol):
    """What starting a task reads and changes of the state machine (`MasterState`)."""

    config: MasterConfig
    clock: Clock
    registry: SegmentRegistry
    tasks: TaskTable


def start(state: TaskHost, kind: TaskKind, record: ObjectRecord, source: str, targets: list[str], task_id: int) -> int:
    """Place a block on each target holder and track the task; lease the object to it."""
    state.tasks.check_room(record.key)
    placed = place(state, targets, record.size)
    now = state.clock.now()
    executor = state.registry.segments[placed[0].segment_id].client_id if placed else ""
    deadline = now + state.config.put_timeout_s
    task = Task(
        task_id or state.tasks.next_id(),
        kind,
        record.key,
        record.put_id,
        source,
        placed,
        executor,
        deadline,
        record.lease_until,
        now,
        now,
    )
    if not placed:
        task.status, task.message = "succeeded", "every target holds a replica already"
    else:
        record.lease_until = max(record.lease_until, deadline)  # NOTE: the sources stay in place
    state.tasks.add(task)
    return task.task_id


def place(state: TaskHost, targets: list[str], size: int) -> list[Placement]:
    """One block of `size` in a healthy segment of each target holder, the emptiest first
    (mutates allocators). Raises OutOfSpace (none placed then): tasks do not evict."""
    registry, now = state.registry, state.clock.now()
    placed: list[Placement] = []
    for target in targets:
        candidates = [s for s in registry.segments.values() if s.te_segment == target]
        candidates = [s for s in candidates if registry.healthy(s.client_id, now)]
        candidates.sort(key=lambda s: (-s.allocator.free_bytes, s.segment_id))
        offsets = ((seg, seg.allocator.allocate(size)) for seg in candidates)
        found = next(((seg, offset) for seg, offset in offsets if offset is not None), None)
        if found is None:
            for placement in placed:
                registry.free(placement)
            raise OutOfSpace(f"no room for {size} bytes in a healthy segment of {target}")
        placed.append(Placement(found[0].segment_id, found[1]))
        if registry.changed_blocks is not None:
            registry.changed_blocks.add((found[0].segment_id, found[1]))
    return placed
