"""Hypothesis stateful test of copy / move tasks, clearing and soft pins against two holders
that stay up: objects are put, read, replaced, removed, cleared, copied and moved while
executors take tasks and report them done or failed, time passes and a segment may come and
go. After every step: the master's invariants (every block owned once, by an object, a
retired list or a task in flight) and the model's (replica counts, task outcomes)."""

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

KEYS = st.sampled_from(["a", "b", "c", "d"])
HOLDERS = ("te0", "te1")
KIB = 1024


class TaskModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = VirtualClock()
        cfg = MasterConfig(lease_ttl_s=1.0, put_timeout_s=3.0, write_grace_s=0.5, soft_pin_ttl_s=2.0)
        self.state = MasterState(cfg, self.clock)
        self.tasks: dict[int, int] = {}  # task id -> the object's replica count when it started

    @initialize()
    def mount_both(self) -> None:
        for i in (0, 1):
            self.mount(i)

    def mount(self, i: int) -> None:
        op = MountSegment(f"client{i}", f"seg{i}", HOLDERS[i], (i + 1) << 32, 16 * KIB)
        self.state.mount(op)

    def _existing(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(sorted(self.state.objects) or ["a"]))

    @rule(
        key=KEYS,
        kib=st.integers(1, 3),
        replicas=st.integers(1, 2),
        upsert=st.booleans(),
        pin=st.sampled_from(["", "soft", "keep", "hard"]),
    )
    def put(self, key: str, kib: int, replicas: int, upsert: bool, pin: str) -> None:
        config = ReplicaConfig(replicas, soft_pin=pin == "soft", hard_pin=pin == "hard", keep_soft_pin=pin == "keep")
        try:
            self.state.put_start("client0", key, kib * KIB, config, upsert)
        except (ObjectExists, OutOfSpace):
            return
        self.state.put_end("client0", key)

    @rule(data=st.data())
    def get(self, data: st.DataObject) -> None:
        self.state.get_replicas(self._existing(data))

    @rule(data=st.data(), force=st.booleans())
    def remove(self, data: st.DataObject, force: bool) -> None:
        with contextlib.suppress(ObjectNotFound, LeaseHeld):
            self.state.remove(self._existing(data), force)

    @rule(data=st.data(), holder=st.sampled_from(["", *HOLDERS]))
    def clear(self, data: st.DataObject, holder: str) -> None:
        admin.clear_replicas(self.state, [self._existing(data)], holder)

    @rule(data=st.data(), dest=st.sampled_from(HOLDERS), move=st.booleans())
    def create(self, data: st.DataObject, dest: str, move: bool) -> None:
        source = HOLDERS[1 - HOLDERS.index(dest)]
        if not self.state.objects:  # NOTE: keeps the model busy with tasks rather than misses
            self.put("a", 1, 1, False, "")
        key = self._existing(data)
        try:
            if move:
                task_id = admin.create_move(self.state, key, source, dest)
            else:
                task_id = admin.create_copy(self.state, key, [dest])
        except (InvalidArgument, ObjectNotFound, OutOfSpace, TaskInFlight):
            return
        self.tasks[task_id] = len(self.state.objects[key].replicas)

    @rule()
    def heartbeats(self) -> None:
        """Both executors heartbeat and take their pending tasks."""
        for i in (0, 1):
            for assignment in admin.take_tasks(self.state, f"client{i}"):
                assert assignment.sources and len(assignment.targets) == 1

    @rule(data=st.data(), ok=st.booleans())
    def finish(self, data: st.DataObject, ok: bool) -> None:
        self.heartbeats()  # NOTE: the executors take what is pending first: more tasks reach a report
        processing = sorted(t for t in self.tasks if self.state.tasks.get(t).status == "processing")
        if not processing:
            return
        task = self.state.tasks.get(data.draw(st.sampled_from(processing)))
        record = self.state.objects.get(task.key)
        unchanged = record is not None and record.put_id == task.put_id
        admin.finish_task(self.state, task.executor, task.task_id, "" if ok else "the model says no")
        assert task.status == ("succeeded" if ok and unchanged else "failed")
        if task.status == "succeeded":
            assert record is not None
            holders = {self.state.registry.segments[p.segment_id].te_segment for p in record.replicas}
            assert holders >= {self.state.registry.segments[p.segment_id].te_segment for p in task.targets}

    @rule(seconds=st.sampled_from([0.2, 0.6, 1.5, 3.5]))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)
        for client_id in list(self.state.registry.clients):
            self.state.registry.heartbeat(client_id, self.clock.now())
        self.state.tick()

    @rule(i=st.sampled_from([0, 1]))
    def remount(self, i: int) -> None:
        """A holder's segment goes and comes back (empty)."""
        with contextlib.suppress(ObjectNotFound):
            self.state.unmount(f"client{i}", f"seg{i}")
        self.mount(i)

    @invariant()
    def consistent(self) -> None:
        self.state.check_invariants()
        segments = self.state.registry.segments
        for record in self.state.objects.values():
            holders = [segments[p.segment_id].te_segment for p in record.replicas]
            assert len(set(holders)) == len(holders) >= 1
        for task in self.state.tasks.in_flight():
            record = self.state.objects.get(task.key)
            if record is not None and record.put_id == task.put_id:
                assert record.lease_until >= task.deadline, "a task in flight lost its lease on the object"


TaskModel.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestTaskModel = TaskModel.TestCase
