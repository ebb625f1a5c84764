"""The master's operations on many keys and replica sets (admin.py, tasks.py, pins.py) under a
virtual clock: exact outcomes of clearing replicas, removing by pattern, describing keys,
soft pins with a TTL, and copy / move tasks through their whole life."""

from __future__ import annotations

import pytest

from tsukimi.errors import InvalidArgument, LeaseHeld, ObjectNotFound, OutOfSpace, TaskInFlight, TaskNotFound
from tsukimi.store.master import admin
from tsukimi.store.master.service import MasterService
from tsukimi.store.master.state import MasterState
from tsukimi.store.protocol import Heartbeat, HeartbeatResult, ReplicaConfig

from .test_master_state import KIB, advance, make_state, put


def holder_of(state: MasterState, key: str) -> list[str]:
    """The TE segments holding `key`'s replicas, in order."""
    segments = state.registry.segments
    return [segments[p.segment_id].te_segment for p in state.objects[key].replicas]


def test_clear_replicas_whole_objects_and_one_holders_replica() -> None:
    state, clock = make_state(num_segments=3, lease_ttl_s=1.0)
    put(state, "one")
    put(state, "two", replicas=2)
    put(state, "leased")
    state.put_start("c0", "pending", KIB, ReplicaConfig(), upsert=False)
    state.get_replicas("leased")
    used = state.registry.used
    assert admin.clear_replicas(state, ["one", "one", "leased", "pending", "missing"]) == ["one"]
    assert "one" not in state.objects and "leased" in state.objects and state.registry.used == used - KIB
    first, second = holder_of(state, "two")
    assert admin.clear_replicas(state, ["two"], "te-nobody") == []
    assert admin.clear_replicas(state, ["two"], first) == ["two"]
    assert holder_of(state, "two") == [second] and state.registry.used == used - 2 * KIB
    assert admin.clear_replicas(state, ["two"], second) == ["two"]  # its last replica: the object goes
    assert "two" not in state.objects
    advance(state, clock, 1.1)
    assert admin.clear_replicas(state, ["leased"]) == ["leased"]
    state.check_invariants()


def test_clear_replicas_refuses_a_bad_key_and_clears_nothing() -> None:
    state, _ = make_state()
    put(state, "a")
    with pytest.raises(InvalidArgument):
        admin.clear_replicas(state, ["a", ""])
    assert "a" in state.objects


def test_remove_matching_skips_leased_objects_unless_forced() -> None:
    state, _ = make_state()
    for key in ["s/1", "s/2", "s/3", "t/1"]:
        put(state, key)
    state.get_replicas("s/2")
    assert admin.remove_matching(state, r"^s/", force=False) == 2
    assert sorted(state.objects) == ["s/2", "t/1"]
    assert admin.remove_matching(state, r"^s/", force=True) == 1
    assert admin.remove_matching(state, "nothing", force=True) == 0
    with pytest.raises(InvalidArgument, match="regular expression"):
        admin.remove_matching(state, "([", force=False)
    state.check_invariants()


def test_describe_keys_complete_pending_and_missing() -> None:
    state, _ = make_state()
    put(state, "done", replicas=2)
    state.put_start("c0", "writing", KIB, ReplicaConfig(), upsert=False)
    done, writing, missing = admin.describe_keys(state, ["done", "writing", "nope"])
    assert done is not None and done.complete and len(done.replicas) == 2 and done.lease_remaining_s == 0
    assert writing is not None and not writing.complete and missing is None
    assert state.objects["done"].lease_until == 0  # no lease granted


def test_a_soft_pin_lasts_its_ttl_then_the_object_is_evicted_like_any_other() -> None:
    """One 4 KiB segment: a soft pin of 10 s keeps "pinned" while "a" goes; after 10 s the LRU order rules."""
    state, clock = make_state(num_segments=1, size=4 * KIB, evict_ratio=0.01, soft_pin_ttl_s=100.0)
    put(state, "pinned", soft_pin=True, soft_pin_ttl_s=10.0)
    put(state, "default", soft_pin=True)  # the master's TTL: 100 s
    put(state, "a")
    put(state, "b")
    put(state, "c")  # full: evicts a, not the older pinned objects
    assert sorted(state.objects) == ["b", "c", "default", "pinned"]
    advance(state, clock, 10.0)
    put(state, "d")  # the 10 s pin has ended: "pinned" is the least recently used
    assert sorted(state.objects) == ["b", "c", "d", "default"]
    state.check_invariants()


def test_an_upsert_keeping_the_soft_pin_takes_the_old_versions_pin_and_its_end() -> None:
    state, clock = make_state()
    put(state, "k", soft_pin=True, soft_pin_ttl_s=10.0)
    advance(state, clock, 4.0)
    state.put_start("c0", "k", KIB, ReplicaConfig(keep_soft_pin=True), upsert=True)
    state.put_end("c0", "k")
    record = state.objects["k"]
    assert record.config.soft_pin and record.config.soft_pin_ttl_s == 10.0 and record.soft_pin_until == 10.0
    state.put_start("c0", "k", KIB, ReplicaConfig(), upsert=True)  # no pin asked: none kept
    state.put_end("c0", "k")
    assert not state.objects["k"].config.soft_pin
    put(state, "new", keep_soft_pin=True)  # a new key has no pin to keep
    assert not state.objects["new"].config.soft_pin and not state.objects["new"].config.keep_soft_pin


@pytest.mark.parametrize(
    "fields",
    [{"soft_pin_ttl_s": 1.0}, {"soft_pin": True, "soft_pin_ttl_s": -1.0}, {"soft_pin": True, "keep_soft_pin": True}],
)
def test_soft_pin_settings_that_contradict_each_other_are_refused(fields: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument):
        ReplicaConfig(**fields)  # type: ignore[arg-type]


# -- copy and move tasks -----------------------------------------------------------------


def test_a_copy_runs_pending_processing_succeeded_and_adds_the_replica() -> None:
    state, clock = make_state(num_segments=3, lease_ttl_s=1.0, put_timeout_s=30.0)
    service = MasterService(state)
    put(state, "k", preferred_segments=("te1",))
    source, target = "te1", "te2"
    task_id = admin.create_copy(state, "k", [target])
    assert admin.query_task(state, task_id).status == "pending"
    with pytest.raises(LeaseHeld):
        state.remove("k", force=False)  # the task leases the object: its source stays in place
    executor = state.tasks.get(task_id).executor
    beat = service.handle(Heartbeat(executor))
    assert isinstance(beat, HeartbeatResult) and [a.task_id for a in beat.tasks] == [task_id]
    [assignment] = beat.tasks
    assert [s.te_segment for s in assignment.sources] == [source]
    assert [t.te_segment for t in assignment.targets] == [target] and assignment.size == KIB
    assert admin.query_task(state, task_id).status == "processing"
    assert service.handle(Heartbeat(executor)) == HeartbeatResult(True, [])  # handed out once
    clock.advance(0.5)
    admin.finish_task(state, executor, task_id, "")
    info = admin.query_task(state, task_id)
    assert info.status == "succeeded" and info.kind == "copy" and info.updated_s == 0 and info.age_s == 0.5
    assert holder_of(state, "k") == [source, target]
    assert state.objects["k"].lease_until == clock.now() + 1.0  # back to a reader's lease
    admin.finish_task(state, executor, task_id, "")  # a retried report changes nothing
    assert len(state.objects["k"].replicas) == 2
    state.check_invariants()


def test_a_move_retires_the_source_replica_until_the_readers_lease_ends() -> None:
    state, clock = make_state(num_segments=2, lease_ttl_s=1.0, write_grace_s=0.0)
    put(state, "k", preferred_segments=("te0",))
    source, target = "te0", "te1"
    task_id = admin.create_move(state, "k", source, target)
    executor = state.tasks.get(task_id).executor
    admin.take_tasks(state, executor)
    admin.finish_task(state, executor, task_id, "")
    assert holder_of(state, "k") == [target] and state.registry.used == 2 * KIB  # the source waits
    advance(state, clock, 1.1)
    state.tick()
    assert state.registry.used == KIB
    state.check_invariants()


def test_a_failed_copy_frees_its_blocks_after_the_write_grace() -> None:
    state, clock = make_state(num_segments=2, write_grace_s=0.5, lease_ttl_s=0.5)
    put(state, "k", preferred_segments=("te0",))
    task_id = admin.create_copy(state, "k", ["te1"])
    executor = state.tasks.get(task_id).executor
    admin.take_tasks(state, executor)
    admin.finish_task(state, executor, task_id, "TransferError: peer gone")
    assert admin.query_task(state, task_id).message == "TransferError: peer gone"
    assert len(state.objects["k"].replicas) == 1 and state.registry.used == 2 * KIB
    with pytest.raises(LeaseHeld):  # a reader's lease from the task's end: readers may have come meanwhile
        state.remove("k", force=False)
    advance(state, clock, 0.6)
    state.tick()
    assert state.registry.used == KIB
    state.remove("k", force=False)
    state.check_invariants()


def test_tasks_fail_at_their_deadline_and_when_a_target_segment_goes() -> None:
    state, clock = make_state(num_segments=3, put_timeout_s=5.0, write_grace_s=0.0)
    put(state, "slow", preferred_segments=("te0",))
    put(state, "lost", preferred_segments=("te0",))
    slow = admin.create_copy(state, "slow", ["te1"])
    lost = admin.create_copy(state, "lost", ["te2", "te1"])
    state.unmount("c2", "seg2")
    assert admin.query_task(state, lost).message == "a target segment was unmounted"
    assert state.registry.used == 3 * KIB  # slow, lost, slow's copy: lost's block in te1 is freed
    advance(state, clock, 4.9)
    state.tick()
    assert admin.query_task(state, slow).status == "pending"
    advance(state, clock, 0.1)
    state.tick()
    assert admin.query_task(state, slow).message == "timed out before its executor reported"
    assert state.registry.used == 2 * KIB
    state.check_invariants()


def test_an_object_replaced_while_it_is_copied_fails_the_task() -> None:
    state, _ = make_state(num_segments=2)
    put(state, "k", preferred_segments=("te0",))
    task_id = admin.create_copy(state, "k", ["te1"])
    executor = state.tasks.get(task_id).executor
    admin.take_tasks(state, executor)
    state.put_start("c0", "k", KIB, ReplicaConfig(), upsert=True)
    state.put_end("c0", "k")
    admin.finish_task(state, executor, task_id, "")
    assert admin.query_task(state, task_id).status == "failed" and len(state.objects["k"].replicas) == 1
    state.check_invariants()


def test_task_requests_that_cannot_be_carried_out_are_refused() -> None:
    state, _ = make_state(num_segments=2, size=4 * KIB)
    put(state, "k", preferred_segments=("te0",))
    put(state, "big", size=2 * KIB, preferred_segments=("te0",))
    put(state, "filler", size=2 * KIB, preferred_segments=("te1",))
    source, other = "te0", "te1"
    done = admin.create_copy(state, "k", [source])
    assert admin.query_task(state, done).status == "succeeded"  # nothing to copy
    for bad in ([], ["te9"], [other, other]):
        with pytest.raises(InvalidArgument):
            admin.create_copy(state, "k", bad)
    with pytest.raises(ObjectNotFound):
        admin.create_copy(state, "missing", [other])
    with pytest.raises(InvalidArgument):
        admin.create_move(state, "k", other, source)  # other holds no replica
    with pytest.raises(InvalidArgument):
        admin.create_move(state, "k", source, source)
    task_id = admin.create_copy(state, "k", [other])
    with pytest.raises(TaskInFlight):
        admin.create_move(state, "k", source, other)
    with pytest.raises(InvalidArgument):
        admin.finish_task(state, state.tasks.get(task_id).executor, task_id, "")  # not taken yet
    with pytest.raises(TaskNotFound):
        admin.query_task(state, 12345)
    with pytest.raises(OutOfSpace):
        admin.create_copy(state, "big", [other])  # 2 KiB do not fit beside filler and k's copy
    state.check_invariants()


def test_a_create_retried_with_its_task_id_is_the_same_task() -> None:
    """A client retrying CreateCopyTask after a lost reply (an HA failover) must not get
    TaskInFlight for its own task, nor start a second one."""
    state, _ = make_state(num_segments=2)
    put(state, "k", preferred_segments=("te0",))
    assert admin.create_copy(state, "k", ["te1"], task_id=77) == 77
    assert admin.create_copy(state, "k", ["te1"], task_id=77) == 77 and len(state.tasks.in_flight()) == 1
    with pytest.raises(InvalidArgument, match="taken"):
        admin.create_move(state, "k", "te0", "te1", task_id=77)
    with pytest.raises(InvalidArgument):
        admin.create_copy(state, "k", ["te1"], task_id=-1)
    state.check_invariants()
