"""The store master's state machine: object metadata, replicas, leases, eviction.

Pure: no sockets, no threads, the clock injected. Every change is one of the operations in
`tsukimi.store.protocol`, applied by `apply` (one at a time: the server serialises them), plus
`tick`, which lets time pass (expired puts, leases, clients; the high watermark).

An object is first *pending* (put_start gave the writer its replicas), then *complete*
(put_end made it visible). An upsert's new version stays pending while readers keep seeing
the old one; when it completes, the old replicas are *retired*: freed once the old version's
lease ends, so a reader holding a lease never sees its bytes reused.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter

from tsukimi.clock import Clock
from tsukimi.config import MasterConfig
from tsukimi.errors import (
    InvalidArgument,
    LeaseHeld,
    ObjectExists,
    ObjectNotFound,
    OffloadPending,
    OutOfSpace,
    Recovering,
)
from tsukimi.eviction import EvictionPolicy, make_policy
from tsukimi.store.master import groups, pins
from tsukimi.store.master.changes import Changes, TrackedDict
from tsukimi.store.master.groups import ObjectTable
from tsukimi.store.master.hot import HotReplication
from tsukimi.store.master.records import ObjectRecord
from tsukimi.store.master.segments import Placement, SegmentRegistry
from tsukimi.store.master.tasks import TaskTable
from tsukimi.store.master.tiers import Tiering
from tsukimi.store.protocol import MAX_OBJECT_BYTES, MountSegment, ObjectInfo, ReplicaConfig, ReplicaLocation, check_key

__all__ = ["Changes", "MasterState", "ObjectRecord"]

logger = logging.getLogger(__name__)


class MasterState:
    """Object and segment metadata. Not thread-safe: one caller at a time."""

    def __init__(
        self, config: MasterConfig, clock: Clock, policy: EvictionPolicy[str] | None = None, epoch: int = 1
    ) -> None:
        """`epoch` tells this master run's put ids from an earlier run's (the server draws it)."""
        self.config = config
        self._put_ids = itertools.count((epoch << 32) + 1)
        self.clock = clock
        self.registry = SegmentRegistry(config)
        self.objects = ObjectTable()  # complete, visible; with the replica groups' members (groups.py)
        self.pending: dict[str, ObjectRecord] = TrackedDict()  # put started, not ended
        self.retired: list[tuple[float, Placement]] = []  # (free at, block) of replaced/removed leased objects
        self.policy: EvictionPolicy[str] = policy or make_policy(config.eviction)
        self.counters: Counter[str] = Counter()
        self.recovering_until = 0.0  # a new HA leader: holders restored from the log may not have heartbeated yet
        self.tasks = TaskTable((epoch << 32) + 1)  # copy / move tasks (tasks.py, admin.py)
        self.tiers = Tiering(self)  # holders' disks (tiers.py)
        self.hot = HotReplication(self)  # extra replicas of hot keys (hot.py)

    def take_changes(self) -> Changes:
        """The rows changed since the last call, and start tracking if not yet (mutates)."""
        registry = self.registry
        objects, pending = self.objects, self.pending
        assert isinstance(objects, TrackedDict) and isinstance(pending, TrackedDict)
        changes = Changes(
            registry.changed_segments or set(),
            registry.changed_blocks or set(),
            objects.changed or set(),
            pending.changed or set(),
        )
        registry.changed_segments, registry.changed_blocks = set(), set()
        objects.changed, pending.changed = set(), set()
        return changes

    # -- writes ----------------------------------------------------------------------

    def put_start(
        self,
        client_id: str,
        key: str,
        size: int,
        config: ReplicaConfig,
        upsert: bool,
        put_id: int = 0,
        checksum: int | None = None,
    ) -> list[ReplicaLocation]:
        """Allocate replicas for a new object (or a new version, with `upsert`), evicting if
        needed. A retry of a put this writer already started with the same non-zero `put_id`
        returns the same replicas. Mutates. Raises InvalidArgument, ObjectExists, OutOfSpace."""
        check_key(key)
        if not 0 < size <= MAX_OBJECT_BYTES:
            raise InvalidArgument(f"object size must be in 1..{MAX_OBJECT_BYTES}, got {size}")
        if not 0 <= put_id < 1 << 63 or (checksum is not None and not 0 <= checksum < 1 << 32):
            raise InvalidArgument(f"put_id {put_id} or checksum {checksum} out of range")
        pending = self.pending.get(key)
        if pending is not None and put_id and (pending.writer, pending.put_id) == (client_id, put_id):
            return self._locations(pending.replicas, pending.size)  # a retry: the same put
        if pending is not None:
            raise ObjectExists(f"{key!r} is being written")
        if key in self.objects and not upsert:
            raise ObjectExists(f"{key!r} exists (use upsert to replace it)")
        groups.check_room(self.objects, key, config)
        now = self.clock.now()
        placed = self._allocate(client_id, size, config, now)
        self.registry.know(client_id, now)  # NOTE: a dead writer's puts are reclaimed: see tick
        record = ObjectRecord(key, size, config, placed, client_id, now + self.config.put_timeout_s)
        record.put_id, record.checksum = put_id or next(self._put_ids), checksum
        self.pending[key] = record
        self.counters["puts_started"] += 1
        return self._locations(placed, size)

    def _allocate(self, client_id: str, size: int, config: ReplicaConfig, now: float) -> list[Placement]:
        wanted = self.registry.wanted_replicas(config, size, now)
        if wanted == 0 and now < self.recovering_until and self.registry.segments:
            raise Recovering("this master just took over and waits for the holders' heartbeats: retry")
        if wanted == 0:
            raise OutOfSpace("no healthy segment is mounted")
        while True:
            placed = self.registry.place(size, config, client_id, now)
            if len(placed) >= wanted:
                return placed
            for p in placed:
                self.registry.free(p)
            need = max(int(self.config.evict_ratio * self.registry.capacity), size * wanted)
            if self._evict(need, now) == 0:
                break
        placed = self.registry.place(size, config, client_id, now)  # best effort: fewer replicas
        if not placed and self.tiers.offloading():
            raise OffloadPending(f"no room for {size} bytes yet: objects are being copied to disk to free memory")
        if not placed:
            raise OutOfSpace(f"no room for {size} bytes: every segment is full of leased, pinned or pending objects")
        return placed

    def put_end(self, client_id: str, key: str, put_id: int = 0) -> None:
        """Make a pending object visible; an older version is retired. Mutates.
        Raises ObjectNotFound (never started, revoked, reclaimed or lost; or `put_id`, when
        given, names another put of the key). Ending a put that already ended is a no-op
        (a client retrying after a lost reply)."""
        done = self.objects.get(key)
        if key not in self.pending and put_id and done and (done.writer, done.put_id) == (client_id, put_id):
            return
        record = self._pending_of(client_id, key, put_id)
        del self.pending[key]
        old = self.objects.pop(key, None)
        pins.settle(record, old, self.clock.now(), self.config.soft_pin_ttl_s)
        groups.settle(record, old)
        if old is not None:
            self._retire(old, self.clock.now())
        self.objects[key] = record
        self.policy.insert(key)
        self.tiers.written(record, self.clock.now())
        self.counters["puts_completed"] += 1

    def put_revoke(self, client_id: str, key: str, put_id: int = 0) -> None:
        """Abandon a pending put and free its replicas. Mutates. Raises ObjectNotFound."""
        record = self._pending_of(client_id, key, put_id)
        del self.pending[key]
        self.quarantine(record.replicas, self.clock.now())
        self.counters["puts_revoked"] += 1

    def _pending_of(self, client_id: str, key: str, put_id: int) -> ObjectRecord:
        record = self.pending.get(key)
        if record is None or record.writer != client_id or (put_id and record.put_id != put_id):
            raise ObjectNotFound(f"no put of {key!r} by this client is in progress (revoked, reclaimed or lost)")
        return record

    # -- reads -----------------------------------------------------------------------

    def get_replicas(self, key: str) -> tuple[list[ReplicaLocation], int]:
        """Complete replicas (empty on a miss), those on healthy holders first, and the size;
        grants a read lease and marks the object recently used (`read` at the clock's now).
        Mutates."""
        record, replicas = self.read(key, self.clock.now())
        return replicas, 0 if record is None else record.size

    def read(self, key: str, now: float) -> tuple[ObjectRecord | None, list[ReplicaLocation]]:
        """A get of `key` at `now`: the complete object's record (None on a miss) and its
        replicas, those on healthy holders first; grants a read lease and marks it recently
        used. An object only on disk has no replica (`tiers.locations` lists its copies; the
        get may promote it). Mutates. Raises InvalidArgument: a bad key.

        NOTE: the hot path of every KV read (a batch calls it per key with one `now`)."""
        check_key(key)
        record = self.objects.get(key)
        if record is None:
            self.counters["misses"] += 1
            return None, []
        lease_until = now + self.config.lease_ttl_s
        policy = self.policy
        for member in (record, *self.objects.others(record)) if record.config.group else (record,):
            if member.lease_until < lease_until:  # NOTE: a group is read, and kept, as one
                member.lease_until = lease_until
            if member.key in policy:
                policy.touch(member.key)
        self.tiers.on_hit(record, now)
        self.hot.on_read(key, now)
        self.counters["hits"] += 1
        # NOTE: replicas on holders that missed heartbeats (stopped, cut off) go last, so a
        # reader does not spend its lease on them while a healthy replica exists.
        order = record.replicas
        if len(order) > 1:
            segments, registry = self.registry.segments, self.registry
            order = sorted(order, key=lambda p: not registry.healthy(segments[p.segment_id].client_id, now))
        return record, self._locations(order, record.size)

    def exists(self, key: str) -> bool:
        """Whether a complete object exists. Grants no lease and leaves the LRU order alone."""
        check_key(key)
        return key in self.objects

    def remove(self, key: str, force: bool) -> None:
        """Remove a complete object. Mutates. Raises ObjectNotFound, LeaseHeld (unless force)."""
        check_key(key)
        record = self.objects.get(key)
        if record is None:
            raise ObjectNotFound(f"no object {key!r}")
        now = self.clock.now()
        if record.lease_until > now and not force:
            raise LeaseHeld(f"{key!r} is leased to readers for {record.lease_until - now:.2f} s more")
        del self.objects[key]
        self.policy.remove(key)
        self._retire(record, now)
        self.counters["removes"] += 1

    def remove_all(self, force: bool) -> int:
        """Remove every complete object (leased ones only with force). Mutates; returns how many."""
        now = self.clock.now()
        keys = [k for k, r in self.objects.items() if force or r.lease_until <= now]
        for key in keys:
            self.remove(key, force=True)
        return len(keys)

    def describe(self, key: str) -> ObjectInfo:
        """What the master knows of `key` (complete or pending). Raises ObjectNotFound."""
        check_key(key)
        record = self.objects.get(key) or self.pending.get(key)
        if record is None:
            raise ObjectNotFound(f"no object {key!r}")
        return ObjectInfo(
            key,
            record.size,
            key in self.objects and self.objects[key] is record,
            self._locations(record.replicas, record.size),
            record.config.soft_pin,
            record.config.hard_pin,
            max(0.0, record.lease_until - self.clock.now()),
            self.tiers.locations(record, self.clock.now()),
            record.config.group,
            record.config.session,
        )

    # -- segments and time -----------------------------------------------------------

    def mount(self, op: MountSegment) -> None:
        """Mount a segment (mutates). A mount of a TE segment that another incarnation of its
        process had mounted means that process is gone (it restarted under the same name,
        empty): its clients are dropped with their replicas first, so none is ever served.
        Raises InvalidArgument, ObjectExists (see SegmentRegistry.mount)."""
        for stale in self.registry.stale_incarnations(op):
            logger.warning("%s restarted (new incarnation): dropping client %s and its replicas", op.te_segment, stale)
            self._drop_client(stale)
        self.registry.mount(op, self.clock.now())

    def unmount(self, client_id: str, segment_id: str) -> None:
        """Unmount a segment and drop the replicas in it. Mutates. Raises ObjectNotFound."""
        self.registry.unmount(client_id, segment_id)
        self._drop_replicas_in({segment_id})

    def tick(self) -> None:
        """Let time pass: reclaim abandoned puts, free retired blocks, drop silent clients,
        evict above the high watermark. Mutates."""
        now = self.clock.now()
        for record in [r for r in self.pending.values() if r.put_deadline <= now]:
            del self.pending[record.key]
            self.quarantine(record.replicas, now)
            self.counters["puts_reclaimed"] += 1
            logger.info("reclaimed the abandoned put of %r", record.key)
        due = [p for at, p in self.retired if at <= now]
        self.retired = [(at, p) for at, p in self.retired if at > now]
        for placement in due:
            self.registry.free(placement)
        self.quarantine(self.tasks.fail_expired(now), now)
        for client_id in self.registry.expired_clients(now):
            logger.warning("client %s missed its heartbeats: dropping it", client_id)
            self._drop_client(client_id)
        self.tiers.tick(now)
        self.hot.tick(now)
        capacity = self.registry.capacity
        if capacity and self.registry.used > self.config.high_watermark * capacity:
            self._evict(int(self.config.evict_ratio * capacity), now)

    # -- internals -------------------------------------------------------------------

    def _evict(self, target_bytes: int, now: float) -> int:
        """Evict unleased, unpinned objects in the policy's order (LRU by default), soft-pinned last,
        until `target_bytes` are freed; a member of a replica group takes along the other members
        that pass the same checks (groups.py). An object on a holder's disk only loses its
        memory; one a holder's disk can take is offloaded instead (kept until its copy is made),
        up to `target_bytes` of such offloads (tiers.on_evict). Returns the bytes freed now."""
        freed, offloading = self.hot.shed(target_bytes, now), 0  # extras of cooled keys go first
        for soft_pass in (False, True) if freed < target_bytes else ():
            for key in self.policy.victims():
                record = self.objects.get(key)  # NOTE: None: gone with its group earlier in this pass
                if record is None or pins.soft_pinned(record, now) != soft_pass:
                    continue
                if not self._evictable(record, now, soft_pass):
                    continue
                along = [m for m in self.objects.others(record) if self._evictable(m, now, soft_pass)]
                for victim in [record, *along]:
                    kept = self.tiers.on_evict(victim, now, may_offload=offloading < target_bytes)
                    if kept is None:
                        del self.objects[victim.key]
                        self.policy.remove(victim.key)
                        self._free(victim)
                        kept = victim.size * len(victim.replicas)
                        self.counters["evictions"] += 1
                        self.counters["evicted_bytes"] += victim.size
                    elif not kept:
                        offloading += victim.size * len(victim.replicas)
                    freed += kept
                if freed >= target_bytes:
                    return freed
        return freed

    def _evictable(self, record: ObjectRecord, now: float, soft_pass: bool) -> bool:
        """Whether eviction may take `record` now: in memory, unleased, not hard-pinned, and
        not soft-pinned unless this is the soft-pinned pass."""
        if record.config.hard_pin or record.lease_until > now or record.key not in self.policy:
            return False
        return soft_pass or not pins.soft_pinned(record, now)

    def _retire(self, record: ObjectRecord, now: float) -> None:
        self.tiers.drop_copies(record, now)
        if record.lease_until > now:
            self.retired.extend((record.lease_until, p) for p in record.replicas)
        else:
            self._free(record)

    def quarantine(self, blocks: list[Placement], now: float) -> None:
        """Blocks of a failed put: its writer may still have bytes in flight to them, which
        must not land in the next object placed there, so they wait `write_grace_s`."""
        if self.config.write_grace_s > 0:
            self.retired.extend((now + self.config.write_grace_s, p) for p in blocks)
        else:
            for placement in blocks:
                self.registry.free(placement)

    def _free(self, record: ObjectRecord) -> None:
        for placement in record.replicas:
            self.registry.free(placement)

    def _drop_client(self, client_id: str) -> None:
        """Forget a dead client: its segments with the replicas in them, and its puts in
        progress (their blocks are quarantined for write_grace_s), its disk's copies. Mutates."""
        self.tiers.drop_client(client_id, self.clock.now())
        segments = self.registry.drop_client(client_id)
        self._drop_replicas_in({s.segment_id for s in segments})
        for record in [r for r in self.pending.values() if r.writer == client_id]:
            del self.pending[record.key]
            self.quarantine(record.replicas, self.clock.now())
            self.counters["puts_reclaimed"] += 1

    def _drop_replicas_in(self, segment_ids: set[str]) -> None:
        self.retired = [(at, p) for at, p in self.retired if p.segment_id not in segment_ids]
        self.quarantine(self.tasks.fail_in(segment_ids, self.clock.now()), self.clock.now())
        self.tiers.segments_dropped(segment_ids)
        for key, record in list(self.pending.items()):
            if any(p.segment_id in segment_ids for p in record.replicas):  # the writer's put_end will fail
                del self.pending[key]
                self.quarantine([p for p in record.replicas if p.segment_id not in segment_ids], self.clock.now())
        for key, record in list(self.objects.items()):
            kept = [p for p in record.replicas if p.segment_id not in segment_ids]
            if len(kept) == len(record.replicas):
                continue
            record.replicas = kept
            self.objects[key] = record  # NOTE: marks the row changed for the HA log
            if not record.replicas:
                self.policy.remove(key)
            if not record.replicas and not record.disks:
                del self.objects[key]
                self.counters["objects_lost"] += 1

    def _locations(self, placed: list[Placement], size: int) -> list[ReplicaLocation]:
        segments = self.registry.segments
        return [
            ReplicaLocation(segments[p.segment_id].te_segment, segments[p.segment_id].base + p.offset, size)
            for p in placed
        ]

    def check_invariants(self) -> None:
        """Every replica and retired block is allocated exactly once in a mounted segment;
        replicas of an object are on distinct segments; the policy knows exactly the
        complete objects."""
        owners: Counter[tuple[str, int]] = Counter()
        for record in [*self.objects.values(), *self.pending.values()]:
            assert record.replicas or record.key in self.objects, f"{record.key} has no replica"
            assert len({p.segment_id for p in record.replicas}) == len(record.replicas)
            owners.update((p.segment_id, p.offset) for p in record.replicas)
        owners.update((p.segment_id, p.offset) for _, p in self.retired)
        owners.update((p.segment_id, p.offset) for p in self.tasks.placements())
        self.tasks.check_invariants()
        self.hot.check_invariants()
        self.tiers.check_invariants(owners)
        assert all(n == 1 for n in owners.values()), "a block is owned twice"
        per_segment = Counter(sid for sid, _ in owners)
        for sid, seg in self.registry.segments.items():
            seg.allocator.check_invariants()
            assert seg.allocator.num_allocations == per_segment[sid], f"{sid}: leaked or foreign blocks"
        assert set(per_segment) <= set(self.registry.segments), "a replica in an unmounted segment"
        self.objects.check_invariants()
        in_memory = [key for key, record in self.objects.items() if record.replicas]
        assert len(self.policy) == len(in_memory) and all(key in self.policy for key in in_memory)
