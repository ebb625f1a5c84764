"""Hypothesis stateful test of the master state machine: random operations, invariants
after every step, and a model of which objects may exist."""

from __future__ import annotations

import contextlib

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tsukimi.clock import VirtualClock
from tsukimi.config import MasterConfig
from tsukimi.errors import LeaseHeld, ObjectExists, ObjectNotFound, OutOfSpace
from tsukimi.store.master.state import MasterState
from tsukimi.store.protocol import MountSegment, ReplicaConfig

KEYS = st.sampled_from([f"k{i}" for i in range(8)])
SEGMENTS = st.integers(0, 3)


class MasterModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = VirtualClock()
        cfg = MasterConfig(client_ttl_s=3.0, heartbeat_interval_s=1.0, lease_ttl_s=1.0, put_timeout_s=5.0)
        self.state = MasterState(cfg, self.clock)
        self.complete: set[str] = set()  # keys put_end'ed and not removed by us
        self.hard: set[str] = set()
        self.pending: dict[str, str] = {}  # key -> writer
        self.segments_lost = False  # a step that unmounted or dropped segments may lose objects

    @rule(i=SEGMENTS, kib=st.sampled_from([4, 8, 16]))
    def mount(self, i: int, kib: int) -> None:
        if f"seg{i}" not in self.state.registry.segments:
            # segments 0 and 2 belong to one client (one engine), 1 and 3 to another
            op = MountSegment(f"client{i % 2}", f"seg{i}", f"te{i % 2}", (i + 1) << 32, kib * 1024)
            self.state.registry.mount(op, self.clock.now())

    @rule(key=KEYS, kib=st.integers(1, 3), replicas=st.integers(1, 3), pin=st.sampled_from(["", "soft", "hard"]),
          upsert=st.booleans(), writer=SEGMENTS)  # fmt: skip
    def put_start(self, key: str, kib: int, replicas: int, pin: str, upsert: bool, writer: int) -> None:
        config = ReplicaConfig(replicas=replicas, soft_pin=pin == "soft", hard_pin=pin == "hard")
        try:
            locations = self.state.put_start(f"client{writer % 2}", key, kib * 1024, config, upsert)
        except (ObjectExists, OutOfSpace):
            return
        assert 1 <= len(locations) <= replicas and len({loc.te_segment for loc in locations}) == len(locations)
        self.pending[key] = f"client{writer % 2}"

    @rule(key=KEYS)
    def put_end(self, key: str) -> None:
        writer = self.pending.pop(key, None)
        if writer is None:
            return
        try:
            self.state.put_end(writer, key)
        except ObjectNotFound:
            return  # reclaimed or lost with a segment
        self.complete.add(key)
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
    def consistent(self) -> None:
        self.state.check_invariants()
        visible = set(self.state.objects)
        assert visible <= self.complete, "an object appeared that was never completed"
        gone = self.complete - visible
        if not self.segments_lost:
            assert not (gone & self.hard), f"hard-pinned {gone & self.hard} evicted"
        self.complete -= gone
        self.hard -= gone
        self.segments_lost = False


MasterModel.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestMasterModel = MasterModel.TestCase
