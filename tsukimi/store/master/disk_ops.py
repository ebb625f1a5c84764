"""The disk tier's operations of holders on the master: mounting and unmounting a disk,
registering the files it holds (adopting copies), and `sync`, which takes the results of a
holder's disk tasks and hands it new ones.

Functions of the state machine's `Tiering` (tiers.py), pure like it: time is passed in.
A file is adopted as a copy when it is the current version of a known object, or, for an
object the master does not know, when this disk had that version when its holder was
dropped (a "lost" copy not removed or replaced since), or when the master never saw this
disk (it restarted: the disk is all that is left). A task result is applied only while its
object is still the version the task was for; otherwise the work is undone (a file written
for a stale version is deleted, a promoted block is quarantined).
"""

from __future__ import annotations

import logging

from tsukimi.errors import InvalidArgument, ObjectNotFound
from tsukimi.store import disk_protocol as dp
from tsukimi.store.master.disks import Disk, Task
from tsukimi.store.master.records import ObjectRecord
from tsukimi.store.master.tiers import Tiering
from tsukimi.store.protocol import MAX_BATCH, ReplicaConfig, check_key

logger = logging.getLogger(__name__)


def mount(tiers: Tiering, op: dp.MountDisk, now: float) -> None:
    """Mount a disk (mutates); the same mount again is a no-op. A disk of the same id or
    of the same client is dropped first (its copies become lost copies).
    Raises InvalidArgument."""
    if not op.disk_id or not op.endpoint.startswith("tcp://") or op.capacity_bytes <= 0:
        raise InvalidArgument(f"cannot mount disk {op.disk_id!r} at {op.endpoint!r} of {op.capacity_bytes} bytes")
    disks = tiers.registry
    old = disks.disks.get(op.disk_id)
    if old is not None and (old.client_id, old.endpoint, old.capacity) == (
        op.client_id,
        op.endpoint,
        op.capacity_bytes,
    ):
        return
    if old is not None:
        tiers.drop_disk(old, now)
    other = disks.of_client(op.client_id)
    if other is not None:
        tiers.drop_disk(other, now)
    # NOTE: the client is not made known here: a heartbeat must still tell a client whose
    # segments a restarted master lost to mount them again
    disks.add(Disk(op.disk_id, op.client_id, op.endpoint, op.capacity_bytes))


def unmount(tiers: Tiering, client_id: str, disk_id: str, now: float) -> None:
    """Unmount a disk (mutates): its copies become lost copies. Raises ObjectNotFound."""
    disk = tiers.registry.disks.get(disk_id)
    if disk is None or disk.client_id != client_id:
        raise ObjectNotFound(f"client {client_id} has no disk {disk_id}")
    tiers.drop_disk(disk, now)


def register(tiers: Tiering, op: dp.RegisterDiskFiles, now: float) -> list[bool]:
    """Which of the files a mounted disk reports the master keeps as copies (mutates): a
    file of the object's current version, or of an object the master does not know that
    this disk had when its holder was dropped (or any, for a disk never seen before).
    Raises InvalidArgument, ObjectNotFound (the disk is not mounted by this client)."""
    if len(op.files) > MAX_BATCH:
        raise InvalidArgument(f"at most {MAX_BATCH} files per registration, got {len(op.files)}")
    disk = tiers.registry.disks.get(op.disk_id)
    if disk is None or disk.client_id != op.client_id:
        raise ObjectNotFound(f"client {op.client_id} has no disk {op.disk_id}")
    accepted = [_adopt(tiers, disk, f) for f in op.files]
    if op.last:
        tiers.registry.lost.pop(disk.disk_id, None)
    return accepted


def _adopt(tiers: Tiering, disk: Disk, file: dp.DiskFile) -> bool:
    check_key(file.key)
    objects = tiers.state.objects
    record = objects.get(file.key)
    if record is not None:
        same = (record.put_id, record.size) == (file.put_id, file.size)
        if not same or record.checksum not in (None, file.checksum):
            return False
        if disk.disk_id in record.disks:
            return True  # NOTE: a registration retried after a lost reply: the copy is known
    else:
        lost = tiers.registry.lost.get(disk.disk_id)
        copy = lost.get(file.key) if lost is not None else None
        adoptable = tiers.adopt_unknown if lost is None else copy is not None and copy[0] == file.put_id
        if not adoptable or file.size <= 0:
            return False
        # NOTE: its replica group and writer session again (its pins ended with its placements)
        config = ReplicaConfig(group=copy[1].group, session=copy[1].session) if copy is not None else ReplicaConfig()
        record = ObjectRecord(
            file.key, file.size, config, [], disk.client_id, 0.0, put_id=file.put_id, checksum=file.checksum
        )
    record.disks.append(disk.disk_id)
    objects[file.key] = record
    disk.keys.insert(file.key)
    disk.used += file.size
    tiers.state.counters["disk_adopted"] += 1
    return True


def sync(tiers: Tiering, op: dp.DiskSync, now: float) -> dp.DiskSyncResult:
    """Take a holder's finished tasks and hand it new ones (mutates). Raises InvalidArgument."""
    if not 0 <= op.max_tasks <= MAX_BATCH or len(op.done) > MAX_BATCH:
        raise InvalidArgument(f"max_tasks and the results must be at most {MAX_BATCH}")
    disk = tiers.registry.disks.get(op.disk_id)
    if disk is None or disk.client_id != op.client_id:
        return dp.DiskSyncResult(known=False)
    for result in op.done:
        _finish(tiers, result, now)
    timeout_s = tiers.config.disk_task_timeout_s
    tasks = tiers.registry.hand_out(disk, op.max_tasks, now + timeout_s)
    segments = tiers.state.registry.segments
    out: list[dp.DiskTask] = []
    for task in tasks:
        if task.kind == "delete":
            out.append(dp.DeleteTask(task.task_id, task.key, task.put_id))
            continue
        assert task.placement is not None
        seg = segments[task.placement.segment_id]
        address = seg.base + task.placement.offset
        if task.kind == "offload":
            out.append(dp.OffloadTask(task.task_id, task.key, task.put_id, task.size, address, timeout_s))
        else:
            out.append(
                dp.PromoteTask(task.task_id, task.key, task.put_id, task.size, seg.te_segment, address, timeout_s)
            )
    return dp.DiskSyncResult(known=True, tasks=out)


def _finish(tiers: Tiering, result: dp.TaskResult, now: float) -> None:
    task = tiers.registry.tasks.get(result.task_id)
    if task is None or task.deadline == 0.0:
        return  # unknown (it timed out, or its disk was dropped) or never handed out
    del tiers.registry.tasks[task.task_id]
    current = tiers.active.get(task.key) == task.task_id
    if current:
        del tiers.active[task.key]
    record = tiers.state.objects.get(task.key) if current else None
    if task.kind == "offload":
        _offloaded(tiers, task, record, result, now)
    elif task.kind == "promote":
        _promoted(tiers, task, record, result, now)
    elif not result.ok:
        logger.warning("disk %s could not delete %r: %s", task.disk_id, task.key, result.message)


def _offloaded(tiers: Tiering, task: Task, record: ObjectRecord | None, result: dp.TaskResult, now: float) -> None:
    disk = tiers.registry.disks[task.disk_id]
    disk.inflight -= task.size
    counters = tiers.state.counters
    good = record is not None and result.ok and record.checksum in (None, result.checksum)
    if record is None or not good or task.placement not in record.replicas:
        counters["offloads_failed" if not result.ok else "offloads_discarded"] += 1
        if result.ok:  # written, but stale or wrong: the holder deletes it
            tiers.delete(disk, task.key, task.put_id, task.size)
        else:
            disk.used -= task.size
        return
    if disk.disk_id in record.disks:  # NOTE: the same file, registered meanwhile: already counted
        disk.used -= task.size
        return
    record.disks.append(disk.disk_id)
    disk.keys.insert(task.key)
    tiers.state.objects[task.key] = record
    counters["offloads"] += 1
    counters["offloaded_bytes"] += task.size
    counters["offload_us"] += int(result.elapsed_s * 1e6)
    if task.evict_after and record.lease_until <= now and not record.config.hard_pin:
        tiers.release_memory(record)


def _promoted(tiers: Tiering, task: Task, record: ObjectRecord | None, result: dp.TaskResult, now: float) -> None:
    assert task.placement is not None
    counters = tiers.state.counters
    gone = task.placement.segment_id not in tiers.state.registry.segments
    if record is None or not result.ok or gone:
        counters["promotions_failed" if not result.ok else "promotions_discarded"] += 1
        tiers.state.quarantine([task.placement], now)
        return
    record.replicas.append(task.placement)
    record.disk_hits = 0
    tiers.state.objects[task.key] = record
    tiers.state.policy.insert(task.key)
    counters["promotions"] += 1
    counters["promoted_bytes"] += task.size
    counters["promotion_us"] += int(result.elapsed_s * 1e6)
