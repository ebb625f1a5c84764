"""Hypothesis stateful test of the master state machine: random operations (puts, gets,
removes, segments coming and going, time; clearing replicas, removing by pattern, copy and
move tasks from creation to their executors' reports), invariants after every step, and a
model of which objects may exist."""

from __future__ import annotations

import contextlib

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tsukimi.clock import VirtualClock
from tsukimi.config import MasterConfig
from tsukimi.errors import InvalidArgument, LeaseHeld, ObjectExists, ObjectNotFound, OutOfSpace, TaskInFlight
from tsukimi.store.master import admin
from tsukimi.store.master.state import MasterState
from tsukimi.store.protocol import MountSegment, ReplicaConfig

KEYS = st.sampled_from([f"k{i}" for i in range(8)])
SEGMENTS = st.integers(0, 3)
HOLDERS = st.sampled_from(["te0", "te1"])
SOFT_TTLS = st.sampled_from([None, 0.0, 1.0, 100.0])
PINS = st.sampled_from(["", "soft", "hard", "keep"])
GROUPS = st.sampled_from(["", "g0", "g1"])


class MasterModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = VirtualClock()
        cfg = MasterConfig(client_ttl_s=3.0, heartbeat_interval_s=1.0, lease_ttl_s=1.0, put_timeout_s=5.0)
        self.state = MasterState(cfg, self.clock)
        self.complete: set[str] = set()  # keys put_end'ed and not removed by us
        self.hard: set[str] = set()
        self.groups: dict[str, str] = {}  # complete key -> the group its first version joined
        self.pending: dict[str, str] = {}  # key -> writer
        self.tasks: set[int] = set()  # task ids created and not yet finished by the model
        self.segments_lost = False  # a step that unmounted or dropped segments may lose objects

    @initialize()
    def two_holders(self) -> None:
        """Start with a segment in each holder, so that puts (and tasks) get going at once."""
        self.mount(0, 16)
        self.mount(1, 16)

    @rule(i=SEGMENTS, kib=st.sampled_from([4, 8, 16]))
    def mount(self, i: int, kib: int) -> None:
        if f"seg{i}" not in self.state.registry.segments:
            # segments 0 and 2 belong to one client (one engine), 1 and 3 to another
            op = MountSegment(f"client{i % 2}", f"seg{i}", f"te{i % 2}", (i + 1) << 32, kib * 1024)
            self.state.registry.mount(op, self.clock.now())

    @rule(
        key=KEYS,
        kib=st.integers(1, 3),
        replicas=st.integers(1, 3),
        pin=PINS,
        upsert=st.booleans(),
        writer=SEGMENTS,
        ttl=SOFT_TTLS,
        group=GROUPS,
    )
    def put_start(
        self, key: str, kib: int, replicas: int, pin: str, upsert: bool, writer: int, ttl: float | None, group: str
    ) -> None:
        soft = pin == "soft"
        config = ReplicaConfig(
            replicas=replicas,
            soft_pin=soft,
            hard_pin=pin == "hard",
            soft_pin_ttl_s=ttl if soft else None,
            keep_soft_pin=pin == "keep",
            group=group,
        )
        try:
            locations = self.state.put_start(f"client{writer % 2}", key, kib * 1024, config, upsert)
        except (ObjectExists, OutOfSpace):
            return
        assert 1 <= len(locations) <= replicas and len({loc.te_segment for loc in locations}) == len(locations)
        self.pending[key] = f"client{writer % 2}"

    @rule(data=st.data())
    def put_end(self, data: st.DataObject) -> None:
        if not self.pending:
            return
        key = data.draw(st.sampled_from(sorted(self.pending)))  # NOTE: ends a put in progress, not a no-op
        writer = self.pending.pop(key, None)
        if writer is None:
            return
        try:
            self.state.put_end(writer, key)
        except ObjectNotFound:
            return  # reclaimed or lost with a segment
        self.complete.add(key)
        group = self.groups.setdefault(key, self.state.objects[key].config.group)
        assert self.state.objects[key].config.group == group, "an upsert moved a key to another group"
        if self.state.objects[key].config.hard_pin:
            self.hard.add(key)
        else:
            self.hard.discard(key)

    @rule(key=KEYS)
    def put_revoke(self, key: str) -> None:
        writer = self.pending.pop(key, None)
        if writer is not None:
            with contextlib.suppress(ObjectNotFound):
                self.state.put_revoke(writer, key)

    @rule(key=KEYS)
    def get(self, key: str) -> None:
        replicas, size = self.state.get_replicas(key)
        assert bool(replicas) == (key in self.state.objects)
        if replicas:
            assert key in self.complete and size == self.state.objects[key].size

    @rule(key=KEYS, force=st.booleans())
    def remove(self, key: str, force: bool) -> None:
        try:
            self.state.remove(key, force)
        except (ObjectNotFound, LeaseHeld) as exc:
            assert not force or isinstance(exc, ObjectNotFound)
            return
        self.complete.discard(key)
        self.hard.discard(key)

    @rule(force=st.booleans())
    def remove_all(self, force: bool) -> None:
        removed = self.state.remove_all(force)
        assert removed <= len(self.complete)
        if force:
            assert not self.state.objects
        self.complete &= set(self.state.objects)
        self.hard &= set(self.state.objects)

    @rule(key=KEYS, holder=st.sampled_from(["", "te0", "te1"]))
    def clear_replicas(self, key: str, holder: str) -> None:
        record = self.state.objects.get(key)
        leased = record is not None and record.lease_until > self.clock.now()
        cleared = admin.clear_replicas(self.state, [key], holder)
        assert not (leased and cleared), "a leased object was cleared"
        if key not in self.state.objects:
            self.complete.discard(key)
            self.hard.discard(key)

    @rule(prefix=st.sampled_from(["k", "k1", "^k[0-3]$", "x"]), force=st.booleans())
    def remove_matching(self, prefix: str, force: bool) -> None:
        before = set(self.state.objects)
        removed = admin.remove_matching(self.state, prefix, force)
        assert removed == len(before - set(self.state.objects))
        self.complete &= set(self.state.objects)
        self.hard &= set(self.state.objects)

    @rule(data=st.data(), dest=HOLDERS, source=st.sampled_from(["", "te0", "te1"]))
    def create_task(self, data: st.DataObject, dest: str, source: str) -> None:
        key = data.draw(st.sampled_from(sorted(self.state.objects) or ["k0"]))  # NOTE: mostly an object there is
        try:
            if source:
                task_id = admin.create_move(self.state, key, source, dest)
            else:
                task_id = admin.create_copy(self.state, key, [dest])
        except (InvalidArgument, ObjectNotFound, OutOfSpace, TaskInFlight):
            return
        self.tasks.add(task_id)

    @rule(client=st.sampled_from(["client0", "client1"]))
    def take_tasks(self, client: str) -> None:
        for assignment in admin.take_tasks(self.state, client):
            assert assignment.task_id in self.tasks and assignment.sources and assignment.targets

    @rule(data=st.data(), ok=st.booleans())
    def finish_task(self, data: st.DataObject, ok: bool) -> None:
        processing = sorted(t for t in self.tasks if self.state.tasks.get(t).status == "processing")
        if not processing:
            return
        task_id = data.draw(st.sampled_from(processing))
        task = self.state.tasks.get(task_id)
        holders_before = len(self.state.objects[task.key].replicas) if task.key in self.state.objects else 0
        admin.finish_task(self.state, task.executor, task_id, "" if ok else "failed by the model")
        self.tasks.discard(task_id)
        if task.status == "succeeded":
            record = self.state.objects[task.key]
            assert len(record.replicas) == holders_before + (len(task.targets) if task.kind == "copy" else 0)

    @rule(i=SEGMENTS)
    def unmount(self, i: int) -> None:
        try:
            self.state.unmount(f"client{i % 2}", f"seg{i}")
        except ObjectNotFound:
            return
        self.segments_lost = True

    @rule(seconds=st.sampled_from([0.1, 0.5, 1.2, 3.5]), heartbeat=st.booleans())
    def time_passes(self, seconds: float, heartbeat: bool) -> None:
        self.clock.advance(seconds)
        if heartbeat:
            for client_id in list(self.state.registry.clients):
                self.state.registry.heartbeat(client_id, self.clock.now())
        before = set(self.state.registry.segments)
        self.state.tick()
        if set(self.state.registry.segments) != before:
            self.segments_lost = True

    @invariant()
    def groups_hold_existing_members(self) -> None:
        """Every group member exists and names that group; every grouped object is a member."""
        objects = self.state.objects
        for group, members in objects.groups.items():
            assert members and all(objects[key].config.group == group for key in members)
        assert {k for k, r in objects.items() if r.config.group} == set().union(*objects.groups.values())

    @invariant()
    def consistent(self) -> None:
        self.state.check_invariants()
        visible = set(self.state.objects)
        assert visible <= self.complete, "an object appeared that was never completed"
        gone = self.complete - visible
        if not self.segments_lost:
            assert not (gone & self.hard), f"hard-pinned {gone & self.hard} evicted"
        self.complete -= gone
        self.hard -= gone
        self.groups = {k: g for k, g in self.groups.items() if k in self.complete}
        self.segments_lost = False


MasterModel.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestMasterModel = MasterModel.TestCase
