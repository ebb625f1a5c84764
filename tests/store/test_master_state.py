"""The master state machine under a virtual clock: exact outcomes of each operation."""

from __future__ import annotations

import pytest

from tsukimi.clock import VirtualClock
from tsukimi.config import MasterConfig
from tsukimi.errors import InvalidArgument, LeaseHeld, ObjectExists, ObjectNotFound, OutOfSpace
from tsukimi.store.master.state import MasterState
from tsukimi.store.protocol import MountSegment, ReplicaConfig

KIB = 1024
SEG = 64 * KIB


def make_state(num_segments: int = 2, size: int = SEG, **cfg: object) -> tuple[MasterState, VirtualClock]:
    clock = VirtualClock()
    state = MasterState(MasterConfig(**cfg), clock)  # type: ignore[arg-type]
    for i in range(num_segments):
        state.registry.mount(MountSegment(f"c{i}", f"seg{i}", f"te{i}", 0x10000 * (i + 1) * 1000, size), clock.now())
    return state, clock


def advance(state: MasterState, clock: VirtualClock, seconds: float) -> None:
    """Let time pass while every client keeps heartbeating."""
    clock.advance(seconds)
    for client_id in list(state.registry.clients):
        state.registry.heartbeat(client_id, clock.now())


def put(state: MasterState, key: str, size: int = KIB, client: str = "c0", **config: object) -> None:
    state.put_start(client, key, size, ReplicaConfig(**config), upsert=False)  # type: ignore[arg-type]
    state.put_end(client, key)


def test_put_get_round_trip_and_addresses() -> None:
    state, _ = make_state()
    locations = state.put_start("c0", "k", 1000, ReplicaConfig(replicas=2), upsert=False)
    assert len(locations) == 2 and len({loc.te_segment for loc in locations}) == 2
    for loc in locations:
        seg = next(s for s in state.registry.segments.values() if s.te_segment == loc.te_segment)
        assert seg.base <= loc.address < seg.base + SEG and loc.size == 1000
    assert state.get_replicas("k") == ([], 0)  # pending: invisible
    assert not state.exists("k")
    state.put_end("c0", "k")
    replicas, size = state.get_replicas("k")
    assert replicas == locations and size == 1000
    state.check_invariants()


def test_replicas_are_capped_by_the_segments() -> None:
    state, _ = make_state(num_segments=2)
    assert len(state.put_start("c0", "k", KIB, ReplicaConfig(replicas=3), upsert=False)) == 2


def test_reput_fails_and_upsert_replaces_after_the_readers_lease() -> None:
    state, clock = make_state(lease_ttl_s=5.0)
    put(state, "k")
    with pytest.raises(ObjectExists, match="upsert"):
        state.put_start("c0", "k", KIB, ReplicaConfig(), upsert=False)
    old, _ = state.get_replicas("k")  # a reader holds a lease on the old version
    new = state.put_start("c0", "k", 2 * KIB, ReplicaConfig(), upsert=True)
    assert state.get_replicas("k")[0] == old  # readers see the old version while the new one is written
    with pytest.raises(ObjectExists, match="being written"):
        state.put_start("c1", "k", KIB, ReplicaConfig(), upsert=True)
    state.put_end("c0", "k")
    assert state.get_replicas("k") == (new, 2 * KIB)
    assert len(state.retired) == 1  # the old block waits for the old lease
    advance(state, clock, 5.1)
    state.tick()
    assert state.retired == []
    state.check_invariants()


def test_remove_is_refused_under_lease_unless_forced() -> None:
    state, clock = make_state(lease_ttl_s=2.0)
    put(state, "a")
    put(state, "b")
    state.get_replicas("a")
    state.get_replicas("b")
    with pytest.raises(LeaseHeld):
        state.remove("a", force=False)
    state.remove("b", force=True)
    assert not state.exists("b")
    advance(state, clock, 2.01)
    state.remove("a", force=False)
    with pytest.raises(ObjectNotFound):
        state.remove("a", force=False)
    state.check_invariants()


def test_exists_grants_no_lease() -> None:
    state, _ = make_state()
    put(state, "k")
    assert state.exists("k")
    state.remove("k", force=False)  # no LeaseHeld: exists did not lease it


def test_eviction_order_is_exact() -> None:
    """One 8 KiB segment holds 8 objects of 1 KiB. LRU first; leased and hard-pinned never;
    soft-pinned last."""
    state, clock = make_state(num_segments=1, size=8 * KIB, lease_ttl_s=1.0, evict_ratio=0.01)
    put(state, "hard", hard_pin=True)
    put(state, "soft", soft_pin=True)
    for key in "abcde":
        put(state, key)
    put(state, "leased")
    state.get_replicas("a")  # a is now most recently used and leased
    advance(state, clock, 1.5)  # a's lease ends
    state.get_replicas("leased")  # leased is leased
    put(state, "x")  # full: evicts the least recently used evictable object: b
    assert sorted(state.objects) == sorted(["hard", "soft", "a", "c", "d", "e", "leased", "x"])
    for key, victim in [("y", "c"), ("z", "d"), ("w", "e"), ("v", "a"), ("u", "x"), ("t", "y")]:
        put(state, key)
        assert victim not in state.objects, f"{key} should have evicted {victim}"
    assert {"hard", "soft", "leased"} <= set(state.objects)
    advance(state, clock, 1.5)
    for key in ["s1", "s2", "s3", "s4", "s5", "s6"]:  # everything unpinned goes; soft last
        put(state, key)
    assert "soft" in state.objects
    for key in ["s1", "s2", "s3", "s4", "s5", "s6"]:
        state.get_replicas(key)  # leased: not evictable
    put(state, "s7")  # now only the soft-pinned object may go
    assert "soft" not in state.objects and "hard" in state.objects
    assert state.counters["evictions"] == 14
    state.check_invariants()


def test_filling_ten_times_the_capacity_never_fails_a_put() -> None:
    state, _ = make_state(num_segments=2, size=SEG)
    for i in range(10 * 2 * SEG // (4 * KIB)):
        put(state, f"k{i}", size=4 * KIB, replicas=1 + i % 2)
    assert state.counters["evictions"] > 0
    state.check_invariants()


def test_out_of_space_when_everything_is_pinned() -> None:
    state, _ = make_state(num_segments=1, size=4 * KIB)
    for i in range(4):
        put(state, f"p{i}", hard_pin=True)
    with pytest.raises(OutOfSpace):
        state.put_start("c0", "one-more", KIB, ReplicaConfig(), upsert=False)
    state.check_invariants()


def test_abandoned_puts_are_reclaimed() -> None:
    state, clock = make_state(put_timeout_s=10.0)
    state.put_start("c0", "abandoned", KIB, ReplicaConfig(replicas=2), upsert=False)
    assert state.registry.used == 2 * KIB
    advance(state, clock, 10.0)
    state.tick()
    assert "abandoned" not in state.pending
    assert state.registry.used == 2 * KIB  # quarantined: the writer may still have bytes in flight
    advance(state, clock, state.config.write_grace_s)
    state.tick()
    assert state.registry.used == 0
    with pytest.raises(ObjectNotFound, match="reclaimed"):
        state.put_end("c0", "abandoned")
    assert state.counters["puts_reclaimed"] == 1


def test_revoke_frees_and_only_the_writer_may_end_or_revoke() -> None:
    state, clock = make_state()
    state.put_start("c0", "k", KIB, ReplicaConfig(), upsert=False)
    with pytest.raises(ObjectNotFound):
        state.put_end("c1", "k")
    state.put_revoke("c0", "k")
    assert state.registry.used == KIB and not state.exists("k")  # quarantined for write_grace_s
    state.check_invariants()
    advance(state, clock, state.config.write_grace_s)
    state.tick()
    assert state.registry.used == 0
    state.check_invariants()


def test_silent_clients_get_no_new_replicas_and_are_dropped_after_the_ttl() -> None:
    state, clock = make_state(num_segments=3, client_ttl_s=3.0, heartbeat_interval_s=1.0)
    put(state, "two", replicas=2)
    put(state, "one", replicas=1)
    holders = {p.segment_id for p in state.objects["two"].replicas} | {
        p.segment_id for p in state.objects["one"].replicas
    }
    silent = next(iter(holders))
    clock.advance(2.6)  # past 2.5 heartbeat intervals
    for client in ("c0", "c1", "c2"):
        if f"seg{client[1]}" != silent:
            state.registry.heartbeat(client, clock.now())
    locations = state.put_start("c0", "new", KIB, ReplicaConfig(replicas=3), upsert=False)
    assert f"te{silent[3]}" not in {loc.te_segment for loc in locations} and len(locations) == 2
    clock.advance(0.5)  # the silent client passes client_ttl
    state.tick()
    assert silent not in state.registry.segments
    assert all(p.segment_id != silent for r in state.objects.values() for p in r.replicas)
    assert "two" in state.objects  # one replica survived
    state.check_invariants()


def test_remount_is_idempotent_and_conflicts_are_refused() -> None:
    state, clock = make_state(num_segments=1)
    state.registry.mount(MountSegment("c0", "seg0", "te0", 0x10000 * 1000, SEG), clock.now())
    with pytest.raises(ObjectExists):
        state.registry.mount(MountSegment("intruder", "seg0", "te9", 0x99999000, SEG), clock.now())
    assert state.registry.heartbeat("nobody", clock.now()) is False


@pytest.mark.parametrize("key", ["", "x" * 5000])
def test_bad_keys(key: str) -> None:
    state, _ = make_state()
    with pytest.raises(InvalidArgument):
        state.put_start("c0", key, KIB, ReplicaConfig(), upsert=False)
    with pytest.raises(InvalidArgument):
        state.get_replicas(key)


def test_regression_a_stale_put_end_cannot_complete_a_newer_put() -> None:
    """A put reclaimed at put_timeout, then a new put of the key by the same client (another
    thread): the first put's late PutEnd used to make the second visible before it was written."""
    from tsukimi.store.master.service import MasterService
    from tsukimi.store.protocol import PutEnd, PutStart, PutStartResult

    state, clock = make_state(put_timeout_s=1.0)
    service = MasterService(state)
    first = service.handle(PutStart("c0", "k", KIB))
    assert isinstance(first, PutStartResult) and first.put_id
    advance(state, clock, 1.0)
    state.tick()  # reclaimed
    second = service.handle(PutStart("c0", "k", KIB))
    assert isinstance(second, PutStartResult) and second.put_id != first.put_id
    with pytest.raises(ObjectNotFound):
        service.handle(PutEnd("c0", "k", first.put_id))  # the stale one
    assert not state.exists("k")
    service.handle(PutEnd("c0", "k", second.put_id))
    assert state.exists("k")
    other_run = MasterState(MasterConfig(), clock, epoch=7)
    assert other_run._put_ids.__next__() >> 32 == 7  # ids of another master run never collide


def test_a_retried_put_start_and_put_end_with_the_same_put_id_are_the_same_put() -> None:
    state, _ = make_state()
    first = state.put_start("c0", "k", KIB, ReplicaConfig(), upsert=False, put_id=77)
    assert state.put_start("c0", "k", KIB, ReplicaConfig(), upsert=False, put_id=77) == first
    with pytest.raises(ObjectExists):  # another put id (or writer) is another put
        state.put_start("c0", "k", KIB, ReplicaConfig(), upsert=False, put_id=78)
    state.put_end("c0", "k", 77)
    state.put_end("c0", "k", 77)  # the reply was lost and the client retried: a no-op
    with pytest.raises(ObjectNotFound):
        state.put_end("c0", "k", 78)
    assert state.pending == {} and state.objects["k"].put_id == 77
    state.check_invariants()


def test_put_start_rejects_out_of_range_numbers() -> None:
    state, _ = make_state()
    for size, put_id, checksum in (
        (0, 0, None),
        (1 << 41, 0, None),
        (KIB, -1, None),
        (KIB, 1 << 63, None),
        (KIB, 0, 1 << 32),
        (KIB, 0, -5),
    ):
        with pytest.raises(InvalidArgument):
            state.put_start("c0", "k", size, ReplicaConfig(), upsert=False, put_id=put_id, checksum=checksum)
    assert state.pending == {}


def test_a_dead_writers_put_is_reclaimed_when_it_misses_its_heartbeats() -> None:
    state, clock = make_state(client_ttl_s=3.0, heartbeat_interval_s=1.0, put_timeout_s=60.0, write_grace_s=0.5)
    state.put_start("writer", "k", KIB, ReplicaConfig(), upsert=False)
    used = state.registry.used
    assert used > 0 and "writer" in state.registry.clients
    advance(state, clock, 2.0)  # every known client heartbeats, the writer too
    clock.advance(3.5)  # then the writer dies (a pure client: no segment) and stays silent past client_ttl
    for client_id in ("c0", "c1"):
        state.registry.heartbeat(client_id, clock.now())
    state.tick()
    assert "k" not in state.pending and "writer" not in state.registry.clients
    assert state.registry.used == used  # quarantined for write_grace_s: the writer's bytes may be in flight
    clock.advance(0.5)
    state.tick()
    assert state.registry.used == 0 and state.counters["puts_reclaimed"] == 1
    state.check_invariants()


def test_a_holder_restarted_under_the_same_name_drops_the_old_incarnations_replicas() -> None:
    clock = VirtualClock()
    state = MasterState(MasterConfig(), clock)
    for i, te in enumerate(("te0", "te1")):
        state.mount(MountSegment(f"old{i}", f"{te}/1000", te, 0x1000000, SEG, incarnation=f"inc{i}"))
    state.put_start("old0", "both", KIB, ReplicaConfig(replicas=2), upsert=False)
    state.put_end("old0", "both")
    state.put_start("old0", "only0", KIB, ReplicaConfig(preferred_segments=("te0",)), upsert=False)
    state.put_end("old0", "only0")
    state.put_start("old1", "writing", KIB, ReplicaConfig(preferred_segments=("te0",)), upsert=False)
    # te0's process restarts empty: same name, same address even, a new incarnation
    state.mount(MountSegment("new0", "te0/1000", "te0", 0x1000000, SEG, incarnation="inc9"))
    assert state.describe("both").replicas[0].te_segment == "te1" and len(state.describe("both").replicas) == 1
    assert not state.exists("only0") and "writing" not in state.pending
    assert state.registry.segments["te0/1000"].client_id == "new0" and "old0" not in state.registry.clients
    assert state.registry.segments["te0/1000"].allocator.used_bytes == 0
    state.check_invariants()


def test_gets_list_replicas_on_silent_holders_last() -> None:
    state, clock = make_state(num_segments=2, client_ttl_s=3.0, heartbeat_interval_s=1.0)
    put(state, "k", replicas=2, preferred_segments=("te0", "te1"))
    assert [loc.te_segment for loc in state.get_replicas("k")[0]] == ["te0", "te1"]
    clock.advance(2.6)  # past 2.5 heartbeat intervals
    state.registry.heartbeat("c1", clock.now())  # c0 (te0) is stopped or cut off
    assert [loc.te_segment for loc in state.get_replicas("k")[0]] == ["te1", "te0"]


def test_exists_many_answers_each_key_in_order_and_refuses_a_bad_key_or_too_many() -> None:
    from tsukimi.store.master.service import MasterService
    from tsukimi.store.protocol import MAX_BATCH, ExistsMany, ExistsManyResult

    state, _ = make_state()
    service = MasterService(state)
    put(state, "a")
    put(state, "c")
    leases = {key: state.objects[key].lease_until for key in ("a", "c")}
    assert service.handle(ExistsMany(["c", "b", "a", "a"])) == ExistsManyResult([True, False, True, True])
    assert service.handle(ExistsMany([])) == ExistsManyResult([])
    assert {key: state.objects[key].lease_until for key in ("a", "c")} == leases  # no lease granted
    with pytest.raises(InvalidArgument):
        service.handle(ExistsMany(["a", ""]))
    with pytest.raises(InvalidArgument, match="at most"):
        service.handle(ExistsMany(["a"] * (MAX_BATCH + 1)))
