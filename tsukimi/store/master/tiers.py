"""The disk tier's decisions in the master: which object goes to which disk, when its memory
is freed, when a copy is deleted, promoted back, or adopted from a restarted holder's disk.

Part of the pure state machine (`MasterState.tiers`): no sockets, no threads, time passed in.
A copy is a version: `ObjectRecord.disks` lists the disks holding the record's own put id,
so when a put replaces an object or it is removed, the old record's copies are deleted
(after the read lease, like its memory blocks) and can never be served as the new one.

    memory only --offload--> memory + disk --free memory--> disk only --promote--> memory + disk
         ^                   (OffloadTask)   (eviction)                 (PromoteTask)
         `------------------------- copies deleted (DeleteTask) on remove / upsert / disk eviction

An object being offloaded keeps its memory replicas until the holder reports the copy, so it
stays readable throughout; a copy is recorded only if its object is still that version with
that memory replica (a copy made from memory freed meanwhile is discarded, never served).
Eviction frees the memory of copied objects and offloads the others instead of dropping them
(dropping only what no disk can take); above `offload_watermark` the tick copies the coldest
objects ahead of eviction, so eviction rarely waits for a disk.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Protocol

from tsukimi.clock import Clock
from tsukimi.config import MasterConfig
from tsukimi.eviction import EvictionPolicy
from tsukimi.store import disk_protocol as dp
from tsukimi.store.master.disks import Disk, DiskRegistry, Task
from tsukimi.store.master.records import ObjectRecord
from tsukimi.store.master.segments import Placement, SegmentRegistry
from tsukimi.store.protocol import ReplicaConfig


class TierHost(Protocol):
    """What the disk tier reads and changes of its state machine (`MasterState`)."""

    config: MasterConfig
    clock: Clock
    registry: SegmentRegistry

    @property
    def objects(self) -> dict[str, ObjectRecord]: ...  # NOTE: read-only here: the table is MasterState's

    policy: EvictionPolicy[str]
    counters: Counter[str]

    def quarantine(self, blocks: list[Placement], now: float) -> None: ...


logger = logging.getLogger(__name__)


class Tiering:
    """The disk tier of one `MasterState` (which it reads and changes). Not thread-safe."""

    def __init__(self, state: TierHost) -> None:
        self.state = state
        self.config = state.config
        self.registry = DiskRegistry()
        self.active: dict[str, int] = {}  # key -> the id of its offload or promotion in flight
        self.retired: list[tuple[float, str, str, int, int]] = []  # (delete at, disk, key, put id, size)
        self.adopt_unknown = True  # adopt every file of a disk never seen (False: an HA-restored state)

    # -- hooks of the state machine -----------------------------------------------------

    def on_evict(self, record: ObjectRecord, now: float, may_offload: bool) -> int | None:
        """Eviction chose `record` (unleased, not hard-pinned): None to drop it; else the bytes
        freed now (its memory, as it is on disk), or 0: kept, as a holder's disk can take it
        (its offload is queued, unless `may_offload` is False)."""
        if record.disks:
            return self.release_memory(record)
        if self.config.offload == "off":
            return None
        task_id = self.active.get(record.key)
        if task_id is not None:
            self.registry.tasks[task_id].evict_after = True
            return 0
        if not may_offload:
            return None if self._disk_for(record, now) is None else 0
        return None if self._offload(record, now, evict_after=True) is False else 0

    def release_memory(self, record: ObjectRecord) -> int:
        """Free the memory replicas of an object that is on disk (mutates); the bytes freed."""
        freed = record.size * len(record.replicas)
        for placement in record.replicas:
            self.state.registry.free(placement)
        record.replicas = []
        self.state.objects[record.key] = record
        self.state.policy.remove(record.key)
        self.state.counters["memory_freed_to_disk"] += 1
        return freed

    def written(self, record: ObjectRecord, now: float) -> None:
        """A put of `record` ended (mutates): lost copies of the key are stale; "on_put" copies it."""
        self.registry.forget_lost(record.key)
        if self.config.offload == "on_put":
            self._offload(record, now, evict_after=False)

    def drop_copies(self, record: ObjectRecord, now: float) -> None:
        """`record` was removed or replaced (mutates): its task is cancelled and its copies
        deleted once its read lease ends."""
        self._cancel(record, now)
        for disk_id in record.disks:
            disk = self.registry.disks[disk_id]
            disk.keys.remove(record.key)
            if record.lease_until > now:
                self.retired.append((record.lease_until, disk_id, record.key, record.put_id, record.size))
            else:
                self.delete(disk, record.key, record.put_id, record.size)
        record.disks = []
        self.registry.forget_lost(record.key)

    def drop_client(self, client_id: str, now: float) -> None:
        """A client is gone (mutates): its disk's copies become lost copies."""
        disk = self.registry.of_client(client_id)
        if disk is not None:
            self.drop_disk(disk, now)

    def segments_dropped(self, segment_ids: set[str]) -> None:
        """Segments are gone (mutates): tasks reading or writing blocks in them are given up."""
        for task in list(self.registry.tasks.values()):
            if task.placement is None or task.placement.segment_id not in segment_ids:
                continue
            if self.active.get(task.key) == task.task_id:
                del self.active[task.key]
            if task.deadline == 0.0:  # NOTE: one handed out is discarded when it ends
                disk = self.registry.disks[task.disk_id]
                self.registry.unqueue(disk, task)
                if task.kind == "offload":
                    disk.used -= task.size
                    disk.inflight -= task.size

    def on_hit(self, record: ObjectRecord, now: float) -> None:
        """A get of `record` (mutates): marks its copies used, and maybe promotes it."""
        for disk_id in record.disks:
            self.registry.disks[disk_id].keys.touch(record.key)
        if record.replicas or not record.disks or not self.config.promotion_on_hit or record.key in self.active:
            return
        record.disk_hits += 1
        if record.disk_hits >= self.config.promotion_admission_threshold:
            self._promote(record, now)

    def offloading(self) -> bool:
        """Whether any offload is queued or in flight (pure)."""
        return any(disk.inflight for disk in self.registry.disks.values())

    def locations(self, record: ObjectRecord, now: float) -> list[dp.DiskLocation]:
        """Where `record`'s copies are, those of healthy holders first (pure)."""
        if not record.disks:
            return []
        disks = [self.registry.disks[d] for d in record.disks]
        disks.sort(key=lambda d: not self.state.registry.healthy(d.client_id, now))
        return [dp.DiskLocation(d.endpoint, d.disk_id, record.put_id, record.size) for d in disks]

    def tick(self, now: float) -> None:
        """Delete retired copies, give up late tasks, keep disks under their watermark, and
        copy the coldest objects ahead of eviction (mutates)."""
        due = [r for r in self.retired if r[0] <= now]
        self.retired = [r for r in self.retired if r[0] > now]
        for _, disk_id, key, put_id, size in due:
            self.delete(self.registry.disks[disk_id], key, put_id, size)
        for task in self.registry.expired(now):
            self._expire(task, now)
        high, ratio = self.config.disk_high_watermark, self.config.evict_ratio
        for disk in list(self.registry.disks.values()):
            if disk.used > high * disk.capacity:
                self._evict_disk(disk, disk.used - int(max(0.0, high - ratio) * disk.capacity), now)
        if self.config.offload != "off" and self.registry.disks:
            self._write_back(now, 0.0 if self.config.offload == "on_put" else self.config.offload_watermark)

    # -- internals ----------------------------------------------------------------------

    def _offload(self, record: ObjectRecord, now: float, evict_after: bool) -> bool | None:
        """Queue an offload of `record` to the disk of a holder of one of its replicas, if one
        has room (mutates). True: queued; None: not now (that disk has enough in flight);
        False: no disk can take it."""
        found = None if record.key in self.active or record.config.hard_pin else self._disk_for(record, now)
        if found is None:
            return False
        disk, placement = found
        if disk.inflight + record.size > max(self.config.disk_inflight_bytes, record.size):
            return None
        if not self._reserve(disk, record.size, now):
            return False
        disk.inflight += record.size
        task = Task(0, "offload", disk.disk_id, record.key, record.put_id, record.size, placement, evict_after)
        self.active[record.key] = self.registry.queue(disk, task).task_id
        return True

    def _disk_for(self, record: ObjectRecord, now: float) -> tuple[Disk, Placement] | None:
        """The disk of a healthy holder of one of `record`'s replicas, with that replica."""
        registry = self.state.registry
        for placement in record.replicas:
            client_id = registry.segments[placement.segment_id].client_id
            disk = self.registry.of_client(client_id)
            if disk is not None and disk.capacity >= record.size and registry.healthy(client_id, now):
                return disk, placement
        return None

    def _promote(self, record: ObjectRecord, now: float) -> None:
        """Queue a copy of disk-only `record` back into memory, if there is room (mutates)."""
        registry = self.state.registry
        disk = next(
            (self.registry.disks[d] for d in record.disks if registry.healthy(self.registry.disks[d].client_id, now)),
            None,
        )
        if disk is None:
            return
        own = [s.te_segment for s in registry.segments.values() if s.client_id == disk.client_id]
        config = ReplicaConfig(preferred_segments=tuple(own[:1]))
        placed = registry.place(record.size, config, disk.client_id, now)
        if not placed and self._free_copied(record.size, now):
            placed = registry.place(record.size, config, disk.client_id, now)
        if not placed:
            self.state.counters["promotions_skipped"] += 1
            return
        task = Task(0, "promote", disk.disk_id, record.key, record.put_id, record.size, placed[0])
        self.active[record.key] = self.registry.queue(disk, task).task_id

    def _free_copied(self, size: int, now: float) -> int:
        """Free the memory of the least recently used objects that are on disk too, until
        `size` bytes are free (mutates); the bytes freed. Nothing is lost."""
        freed = 0
        for key in self.state.policy.victims():
            record = self.state.objects[key]
            if record.disks and record.lease_until <= now and not record.config.hard_pin:
                freed += self.release_memory(record)
                if freed >= size:
                    break
        return freed

    def _write_back(self, now: float, watermark: float) -> None:
        """Offload the coldest objects not on disk yet until the memory not backed by a disk
        is under `watermark` of the capacity (mutates)."""
        registry = self.state.registry
        excess = registry.used - watermark * registry.capacity
        if excess <= 0 or not registry.capacity:
            return
        for key in self.state.policy.victims():
            record = self.state.objects[key]
            excess -= record.size * len(record.replicas)
            if not record.disks and key not in self.active:
                self._offload(record, now, evict_after=False)
            if excess <= 0:
                return

    def _reserve(self, disk: Disk, size: int, now: float) -> bool:
        """Make room for `size` bytes on `disk` (evicting its coldest copies) and take it."""
        if size > disk.capacity:
            return False
        if disk.capacity - disk.used < size:
            self._evict_disk(disk, size - (disk.capacity - disk.used), now)
        if disk.capacity - disk.used < size:
            return False
        disk.used += size
        return True

    def _evict_disk(self, disk: Disk, need: int, now: float) -> int:
        """Delete `disk`'s least recently used copies (not leased, not being promoted) until
        `need` bytes are freed (mutates); an object whose only copy it was is gone."""
        freed = 0
        objects, counters = self.state.objects, self.state.counters
        for key in disk.keys.victims():
            if freed >= need:
                break
            record = objects[key]
            if record.lease_until > now or key in self.active:
                continue
            record.disks.remove(disk.disk_id)
            disk.keys.remove(key)
            self.delete(disk, key, record.put_id, record.size)
            freed += record.size
            counters["disk_evictions"] += 1
            if record.replicas or record.disks:
                objects[key] = record
            else:
                del objects[key]
                counters["evictions"] += 1
                counters["evicted_bytes"] += record.size
        return freed

    def delete(self, disk: Disk, key: str, put_id: int, size: int) -> None:
        """Give back a copy's bytes and queue its DeleteTask (mutates)."""
        disk.used -= size
        self.registry.queue(disk, Task(0, "delete", disk.disk_id, key, put_id, size))

    def _cancel(self, record: ObjectRecord, now: float) -> None:
        """Forget the task in flight for `record`; one not handed out yet is undone at once,
        one handed out is discarded when it ends or times out (mutates)."""
        task_id = self.active.pop(record.key, None)
        if task_id is None:
            return
        task = self.registry.tasks[task_id]
        if task.deadline:
            return
        disk = self.registry.disks[task.disk_id]
        self.registry.unqueue(disk, task)
        if task.kind == "offload":
            disk.used -= task.size
            disk.inflight -= task.size
        elif task.placement is not None:
            self.state.registry.free(task.placement)  # never handed out: nobody writes it

    def _expire(self, task: Task, now: float) -> None:
        disk = self.registry.disks[task.disk_id]
        if self.active.get(task.key) == task.task_id:
            del self.active[task.key]
        self.state.counters["disk_tasks_expired"] += 1
        if task.kind == "offload":
            disk.inflight -= task.size
            self.delete(disk, task.key, task.put_id, task.size)  # it may land late
        elif task.kind == "promote":
            assert task.placement is not None
            self.state.quarantine([task.placement], now)
        else:
            self.registry.requeue(disk, task)

    def drop_disk(self, disk: Disk, now: float) -> None:
        """Unmount `disk` (mutates): its tasks are given up, its copies become lost copies;
        objects left with no replica and no copy are lost."""
        for task in self.registry.remove(disk):
            if self.active.get(task.key) == task.task_id:
                del self.active[task.key]
            if task.kind == "promote" and task.placement is not None:
                self.state.quarantine([task.placement], now)
        lost = self.registry.lost.setdefault(disk.disk_id, {})
        objects = self.state.objects
        for key in disk.keys.victims():
            record = objects[key]
            record.disks.remove(disk.disk_id)
            lost[key] = (record.put_id, record.config)
            if record.replicas or record.disks:
                objects[key] = record
            else:
                del objects[key]
                self.state.counters["objects_lost"] += 1
        self.retired = [r for r in self.retired if r[1] != disk.disk_id]

    def check_invariants(self, owners: Counter[tuple[str, int]]) -> None:
        """Copies, usage, keys and tasks agree; promotion blocks are counted in `owners`."""
        self.registry.check_invariants()
        objects = self.state.objects
        used = {d: 0 for d in self.registry.disks}
        keys: dict[str, set[str]] = {d: set() for d in self.registry.disks}
        for record in objects.values():
            assert record.replicas or record.disks, f"{record.key} has neither a replica nor a copy"
            assert len(set(record.disks)) == len(record.disks), f"{record.key}: two copies on one disk"
            for disk_id in record.disks:
                used[disk_id] += record.size
                keys[disk_id].add(record.key)
        for _, disk_id, _, _, size in self.retired:
            used[disk_id] += size
        for key, task_id in self.active.items():
            task = self.registry.tasks[task_id]
            assert task.key == key and objects[key].put_id == task.put_id, f"stale task for {key}"
            assert task.kind == "offload" or not objects[key].replicas, f"{key} promoted twice"
        for task in self.registry.tasks.values():
            if task.kind == "offload":
                used[task.disk_id] += task.size
            block = task.placement
            if task.kind == "promote" and block is not None and block.segment_id in self.state.registry.segments:
                owners[(block.segment_id, block.offset)] += 1
        for disk in self.registry.disks.values():
            assert disk.used == used[disk.disk_id], f"{disk.disk_id}: used {disk.used} != {used[disk.disk_id]}"
            assert set(disk.keys.victims()) == keys[disk.disk_id], f"{disk.disk_id}: LRU disagrees with the copies"
            assert disk.inflight == sum(
                t.size for t in self.registry.tasks.values() if t.kind == "offload" and t.disk_id == disk.disk_id
            )
