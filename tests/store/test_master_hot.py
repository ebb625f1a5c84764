"""Hot-key replication in the master (tsukimi/store/master/hot.py): placement of the extra
replicas through copy tasks, the cool-down with hysteresis, eviction pressure taking the
extras of cooled objects first; and a Hypothesis stateful test of its invariants."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tsukimi.clock import VirtualClock
from tsukimi.config import MasterConfig
from tsukimi.errors import ConfigError, InvalidArgument, ObjectExists, ObjectNotFound, OutOfSpace
from tsukimi.store.master import admin
from tsukimi.store.master.state import MasterState
from tsukimi.store.protocol import MountSegment, ReplicaConfig

KIB = 1024
HOT = {
    "heartbeat_interval_s": 100.0,
    "client_ttl_s": 1000.0,
    "hot_threshold": 2.0,
    "hot_window_s": 1.0,
    "hot_cool_down_s": 2.0,
    "hot_max_replicas": 3,
}


def _master(holders: int = 4, segment_kib: int = 64, **overrides: object) -> tuple[MasterState, VirtualClock]:
    clock = VirtualClock()
    config = MasterConfig(**{"write_grace_s": 0.0, "lease_ttl_s": 0.5, **HOT, **overrides})  # type: ignore[arg-type]
    state = MasterState(config, clock)
    for i in range(holders):
        state.mount(MountSegment(f"client{i}", f"seg{i}", f"te{i}", (i + 1) << 32, segment_kib * KIB))
    return state, clock


def _put(state: MasterState, key: str, kib: int = 4, replicas: int = 1) -> None:
    state.put_start("client0", key, kib * KIB, ReplicaConfig(replicas, preferred_segments=["te0"]), False)
    state.put_end("client0", key)


def _heartbeat_all(state: MasterState) -> None:
    """Every holder heartbeats and carries out its tasks at once (as a TaskRunner would)."""
    for client_id in list(state.registry.clients):
        state.registry.heartbeat(client_id, state.clock.now())
        for task in admin.take_tasks(state, client_id):
            admin.finish_task(state, client_id, task.task_id, "")


def _holders(state: MasterState, key: str) -> list[str]:
    segments = state.registry.segments
    return sorted(segments[p.segment_id].te_segment for p in state.objects[key].replicas)


def _read(state: MasterState, clock: VirtualClock, key: str, times: int, every_s: float) -> None:
    for _ in range(times):
        state.get_replicas(key)
        clock.advance(every_s)


def test_hot_key_is_replicated_to_distinct_holders_up_to_the_cap() -> None:
    state, clock = _master()
    _put(state, "hot")
    _put(state, "cold")
    _read(state, clock, "hot", 5, 0.1)  # 5 reads in 0.5 s: above 2 per second
    state.get_replicas("cold")
    state.tick()
    _heartbeat_all(state)
    state.tick()
    assert _holders(state, "hot") == ["te0", "te1", "te2"]  # the emptiest holders lacking it; cap 3
    assert _holders(state, "cold") == ["te0"]
    assert state.counters["hot_replications"] == 2
    assert len(state.hot.extras_of("hot")) == 2
    state.check_invariants()


def test_failed_copy_adds_no_extra() -> None:
    state, clock = _master()
    _put(state, "hot")
    _read(state, clock, "hot", 5, 0.1)
    state.tick()
    for client_id in list(state.registry.clients):
        for task in admin.take_tasks(state, client_id):
            admin.finish_task(state, client_id, task.task_id, "READ failed")
    state.tick()
    assert _holders(state, "hot") == ["te0"] and state.hot.extras_of("hot") == []
    state.check_invariants()


def test_extras_dropped_only_after_cool_down_hysteresis() -> None:
    state, clock = _master()
    _put(state, "hot", replicas=1)
    _read(state, clock, "hot", 5, 0.1)
    state.tick()
    _heartbeat_all(state)
    state.tick()
    assert len(_holders(state, "hot")) == 3
    # between the cool threshold (1/s) and the hot one (2/s): stays replicated
    for _ in range(8):
        _read(state, clock, "hot", 3, 0.5)
        state.tick()
    assert len(_holders(state, "hot")) == 3
    clock.advance(3.0)  # silence: the rate decays below 1/s ...
    state.tick()
    assert len(_holders(state, "hot")) == 3  # ... and the cool-down starts now
    clock.advance(2.5)
    state.tick()
    assert _holders(state, "hot") == ["te0"]  # the requested replica stays
    assert state.counters["hot_drops"] == 2
    state.check_invariants()


def test_eviction_takes_extras_of_cooled_objects_before_objects() -> None:
    state, clock = _master(holders=3, segment_kib=16, hot_cool_down_s=1000.0)
    _put(state, "a")
    _read(state, clock, "a", 6, 0.1)
    state.tick()
    _heartbeat_all(state)
    state.tick()
    assert len(_holders(state, "a")) == 3
    clock.advance(10.0)  # "a" cooled down, its cool-down has not run out
    state.tick()
    for i in range(3):
        _put(state, f"fill{i}", kib=4, replicas=3)  # every segment full
    _put(state, "new", kib=4)  # eviction: the extras of "a" are enough
    assert "a" in state.objects and _holders(state, "a") == ["te0"]
    assert state.counters["hot_sheds"] == 2 and state.counters["evictions"] == 0
    state.check_invariants()


def test_off_by_default() -> None:
    state, clock = _master(hot_threshold=0.0)
    _put(state, "k")
    _read(state, clock, "k", 50, 0.01)
    state.tick()
    assert state.hot.heat == {} and not state.tasks.in_flight()


def test_config_validation() -> None:
    with pytest.raises(ConfigError):
        MasterConfig(hot_cool_ratio=1.0)
    with pytest.raises(ConfigError):
        MasterConfig(hot_max_replicas=1)


class HotModel(RuleBasedStateMachine):
    """Puts, reads, time, holders heartbeating and copying (or failing), a segment going
    away: after every step the master's invariants and hot replication's bounds hold."""

    def __init__(self) -> None:
        super().__init__()
        self.state, self.clock = _master(holders=0, segment_kib=32)
        self.replicas_asked: dict[str, int] = {}
        self.silent_since: dict[str, float] = {}

    @initialize()
    def mount_all(self) -> None:
        for i in range(4):
            self.mount(i)

    @rule(i=st.integers(0, 3))
    def mount(self, i: int) -> None:
        with contextlib.suppress(ObjectExists):
            self.state.mount(MountSegment(f"client{i}", f"seg{i}", f"te{i}", (i + 1) << 32, 32 * KIB))

    @rule(i=st.integers(1, 3))
    def unmount(self, i: int) -> None:
        with contextlib.suppress(ObjectNotFound):
            self.state.unmount(f"client{i}", f"seg{i}")

    @rule(key=st.sampled_from("abc"), kib=st.integers(1, 6), replicas=st.integers(1, 2))
    def put(self, key: str, kib: int, replicas: int) -> None:
        before = self._counts()
        try:
            self.state.put_start("client0", key, kib * KIB, ReplicaConfig(replicas), True)
        except (ObjectExists, OutOfSpace):
            return
        self.state.put_end("client0", key)
        self._never_below_asked(before, changed=key)

    @rule(key=st.sampled_from("abc"), times=st.integers(1, 8))
    def read(self, key: str, times: int) -> None:
        for _ in range(times):
            self.state.get_replicas(key)
            self.clock.advance(0.05)

    @rule(seconds=st.sampled_from([0.1, 0.5, 2.0, 5.0, 20.0]), fail=st.booleans())
    def time_passes(self, seconds: float, fail: bool) -> None:
        before = self._counts()
        self.clock.advance(seconds)
        for client_id in list(self.state.registry.clients):
            self.state.registry.heartbeat(client_id, self.clock.now())
            for task in admin.take_tasks(self.state, client_id):
                with contextlib.suppress(InvalidArgument):
                    admin.finish_task(self.state, client_id, task.task_id, "boom" if fail else "")
        self.state.tick()
        self._never_below_asked(before)
        cool_down_s = self.state.config.hot_cool_down_s
        for key, heat in self.state.hot.heat.items():  # a tick drops the extras of cooled keys
            assert not self.state.hot.extras_of(key) or heat.cool_since + cool_down_s > self.clock.now()

    def _counts(self) -> dict[str, tuple[int, int]]:
        return {k: (r.put_id, len(r.replicas)) for k, r in self.state.objects.items()}

    def _never_below_asked(self, before: dict[str, tuple[int, int]], changed: str = "") -> None:
        """No holder went away: an object still there lost no replica it was asked for."""
        for key, (put_id, count) in before.items():
            record = self.state.objects.get(key)
            if key != changed and record is not None and record.put_id == put_id:
                assert len(record.replicas) >= min(count, record.config.replicas), f"{key} lost a replica"

    @invariant()
    def bounds(self) -> None:
        state = self.state
        state.check_invariants()
        cap = state.config.hot_max_replicas
        for key, record in state.objects.items():
            extras = state.hot.extras_of(key)
            segments = [p.segment_id for p in record.replicas]
            assert len(set(segments)) == len(segments), "two replicas on one segment"
            assert len(record.replicas) <= max(cap, record.config.replicas), "more replicas than the cap"
            assert all(p in record.replicas for p in extras)


TestHotModel = HotModel.TestCase
TestHotModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_extras_go_exactly_at_the_end_of_the_cool_down() -> None:
    """Found by the model: cool_since + cool_down landed on `now` exactly, and the tick's
    `now - cool_since >= cool_down` rounded the other way, so the extras outlived their time."""
    model = HotModel()
    try:
        model.mount_all()
        model.time_passes(fail=False, seconds=5.0)
        model.time_passes(fail=False, seconds=5.0)
        model.put(key="a", kib=1, replicas=1)
        model.read(key="a", times=3)
        model.time_passes(fail=False, seconds=0.1)
        model.time_passes(fail=False, seconds=5.0)
        model.time_passes(fail=False, seconds=2.0)  # asserts the extras are gone
    finally:
        model.teardown()
