"""The master's operations on many keys and on replica sets: clearing replicas, removing by
pattern, describing keys, and the copy / move tasks of tasks.py (create, hand to executors,
finish, query).

Functions over a `MasterState`, as pure as it is: the service calls them under the server's
lock; they mutate the state only through its tables and its registry, marking every object
row they change (for the HA log).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from tsukimi.errors import InvalidArgument, LeaseHeld, ObjectNotFound, TaskNotFound
from tsukimi.store.master.segments import Placement
from tsukimi.store.master.state import MasterState, ObjectRecord
from tsukimi.store.master.task_start import start as _start
from tsukimi.store.master.tasks import Task
from tsukimi.store.protocol import (
    MAX_BATCH,
    MAX_KEY_BYTES,
    MAX_REPLICAS,
    ObjectInfo,
    ReplicaLocation,
    TaskAssignment,
    TaskInfo,
    TaskKind,
    check_key,
)


def clear_replicas(state: MasterState, keys: Sequence[str], te_segment: str = "") -> list[str]:
    """Drop the replicas of the complete, unleased objects among `keys`: every replica, or
    those held in `te_segment`; an object left without replicas is removed. Mutates.

    Returns the keys cleared (each once, in order); leased, missing, pending keys and keys
    with no replica in `te_segment` are skipped. Raises InvalidArgument (a bad key: nothing
    is cleared)."""
    _check_keys(keys)
    now = state.clock.now()
    cleared: list[str] = []
    for key in dict.fromkeys(keys):
        record = state.objects.get(key)
        if record is None or record.lease_until > now:
            continue
        segments = state.registry.segments
        dropped = [p for p in record.replicas if not te_segment or segments[p.segment_id].te_segment == te_segment]
        if not dropped:
            continue
        if len(dropped) == len(record.replicas):
            state.remove(key, force=False)
        else:
            record.replicas = [p for p in record.replicas if p not in dropped]
            state.objects[key] = record  # NOTE: marks the row changed for the HA log
            for placement in dropped:
                state.registry.free(placement)
        cleared.append(key)
    return cleared


def remove_matching(state: MasterState, pattern: str, force: bool) -> int:
    """Remove every complete object whose key `re.search`es `pattern`, leased ones only with
    `force`. Mutates; returns how many. Raises InvalidArgument (not a regular expression)."""
    if not isinstance(pattern, str) or len(pattern.encode()) > MAX_KEY_BYTES:
        raise InvalidArgument(f"a key pattern is a str of at most {MAX_KEY_BYTES} bytes")
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise InvalidArgument(f"{pattern!r} is not a regular expression: {exc}") from exc
    removed = 0
    for key in [k for k in state.objects if regex.search(k)]:
        try:
            state.remove(key, force)
        except LeaseHeld:
            continue
        removed += 1
    return removed


def describe_keys(state: MasterState, keys: Sequence[str]) -> list[ObjectInfo | None]:
    """`MasterState.describe` per key; None where there is no object (grants no lease)."""
    _check_keys(keys)
    return [state.describe(k) if k in state.objects or k in state.pending else None for k in keys]


# -- copy and move tasks ---------------------------------------------------------------


def create_copy(state: MasterState, key: str, targets: Sequence[str], task_id: int = 0) -> int:
    """Start copying `key` onto each holder in `targets` (TE segment names) that lacks a
    replica; a task that has nothing to copy has succeeded at once. Mutates; returns its id.
    A non-zero `task_id` is the caller's: a retry of the same request returns that task.

    Raises:
        InvalidArgument: a bad key, no target, a target twice or not mounted.
        ObjectNotFound: no complete object `key`. TaskInFlight, OutOfSpace.
    """
    check_key(key)
    if not 0 < len(targets) <= MAX_REPLICAS or len(set(targets)) != len(targets):
        raise InvalidArgument(f"a copy takes 1..{MAX_REPLICAS} distinct target segments, got {list(targets)}")
    if _is_retry(state, task_id, "copy", key):
        return task_id
    record = _complete(state, key)
    _check_mounted(state, targets)
    holders = _holders(state, record)
    return _start(state, "copy", record, "", [t for t in targets if t not in holders], task_id)


def create_move(state: MasterState, key: str, source: str, target: str, task_id: int = 0) -> int:
    """Start moving the replica of `key` held by `source` to `target` (TE segment names).
    Mutates; returns the task's id (`task_id` as `create_copy`'s).

    Raises:
        InvalidArgument: a bad key; source and target the same, `source` holding no
            replica, `target` holding one already or not mounted.
        ObjectNotFound: no complete object `key`. TaskInFlight, OutOfSpace.
    """
    check_key(key)
    if source == target:
        raise InvalidArgument(f"a move needs two different segments, got {source!r} twice")
    if _is_retry(state, task_id, "move", key):
        return task_id
    record = _complete(state, key)
    holders = _holders(state, record)
    if source not in holders or target in holders:
        raise InvalidArgument(f"{key!r} is held by {sorted(holders)}: cannot move it from {source!r} to {target!r}")
    _check_mounted(state, [target])
    return _start(state, "move", record, source, [target], task_id)


def take_tasks(state: MasterState, client_id: str) -> list[TaskAssignment]:
    """The pending tasks `client_id` executes, now processing (mutates; its heartbeat)."""
    now = state.clock.now()
    out: list[TaskAssignment] = []
    for task in state.tasks.take(client_id, now):
        record = state.objects.get(task.key)
        if record is None or record.put_id != task.put_id:
            _fail(state, task, "the object was replaced or removed before the task started")
            continue
        sources = [_location(state, p, record.size) for p in record.replicas]
        targets = [_location(state, p, record.size) for p in task.targets]
        out.append(TaskAssignment(task.task_id, task.key, record.size, sources, targets))
    return out


def finish_task(state: MasterState, client_id: str, task_id: int, error: str) -> None:
    """The executor's report: on success the targets join the object's replicas (a move
    retires the source's); on `error`, or if the object changed meanwhile, the task fails
    and its blocks are freed. A report on a task that ended already is ignored (a late or
    retried one). Mutates. Raises TaskNotFound, InvalidArgument (not this client's task, or
    not started)."""
    task = state.tasks.get(task_id)
    if task.executor != client_id or task.status == "pending":
        raise InvalidArgument(f"task {task_id} is not processing in client {client_id}")
    if not task.in_flight:
        return
    record = state.objects.get(task.key)
    if error or record is None or record.put_id != task.put_id:
        _fail(state, task, error or "the object was replaced or removed while it was copied")
        return
    now = state.clock.now()
    _release_lease(state, task, record)
    if task.kind == "move":
        segments = state.registry.segments
        gone = [p for p in record.replicas if segments[p.segment_id].te_segment == task.source]
        state.retired.extend((record.lease_until, p) for p in gone)  # readers may still use them
        record.replicas = [p for p in record.replicas if p not in gone]
    record.replicas = record.replicas + task.targets
    state.objects[task.key] = record  # NOTE: marks the row changed for the HA log
    state.tasks.end(task, "succeeded", "", now)


def query_task(state: MasterState, task_id: int) -> TaskInfo:
    """Raises TaskNotFound."""
    return state.tasks.get(task_id).info(state.clock.now())


# -- internals -------------------------------------------------------------------------


def _is_retry(state: MasterState, task_id: int, kind: TaskKind, key: str) -> bool:
    """Whether a create naming `task_id` repeats one that was applied (pure). Raises
    InvalidArgument: an id out of range, or one of another task."""
    if not isinstance(task_id, int) or not 0 <= task_id < 1 << 63:
        raise InvalidArgument(f"task_id must be in 0..2**63-1, got {task_id!r}")
    if not task_id:
        return False
    try:
        task = state.tasks.get(task_id)
    except TaskNotFound:
        return False
    if (task.kind, task.key) != (kind, key):
        raise InvalidArgument(f"task id {task_id} is taken by another task")
    return True


def _fail(state: MasterState, task: Task, message: str) -> None:
    record = state.objects.get(task.key)
    if record is not None and record.put_id == task.put_id:
        _release_lease(state, task, record)
    state.tasks.end(task, "failed", message, state.clock.now())
    state.quarantine(task.targets, state.clock.now())  # NOTE: the executor may still be writing them


def _release_lease(state: MasterState, task: Task, record: ObjectRecord) -> None:
    """End the task's lease on the object: back to the readers' (those who read while the
    task held it are covered by a fresh read lease from now)."""
    record.lease_until = max(task.lease_before, state.clock.now() + state.config.lease_ttl_s)


def _complete(state: MasterState, key: str) -> ObjectRecord:
    record = state.objects.get(key)
    if record is None:
        raise ObjectNotFound(f"no object {key!r}")
    return record


def _holders(state: MasterState, record: ObjectRecord) -> set[str]:
    return {state.registry.segments[p.segment_id].te_segment for p in record.replicas}


def _check_mounted(state: MasterState, targets: Sequence[str]) -> None:
    mounted = {s.te_segment for s in state.registry.segments.values()}
    missing = [t for t in targets if t not in mounted]
    if missing:
        raise InvalidArgument(f"no segment of {missing} is mounted")


def _check_keys(keys: Sequence[str]) -> None:
    if len(keys) > MAX_BATCH:
        raise InvalidArgument(f"at most {MAX_BATCH} keys per call, got {len(keys)}")
    for key in keys:
        check_key(key)


def _location(state: MasterState, placement: Placement, size: int) -> ReplicaLocation:
    seg = state.registry.segments[placement.segment_id]
    return ReplicaLocation(seg.te_segment, seg.base + placement.offset, size)
