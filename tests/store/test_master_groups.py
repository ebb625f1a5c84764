"""Replica groups and writer sessions in the master state machine, under a virtual clock:
which members eviction takes along, lease renewal through any member, membership across
removes and upserts, HA replay, and where a writer's session is visible."""

from __future__ import annotations

import pytest

from tsukimi.clock import VirtualClock
from tsukimi.config import MasterConfig
from tsukimi.errors import InvalidArgument
from tsukimi.store.ha import journal
from tsukimi.store.master import groups, reports
from tsukimi.store.master.state import MasterState
from tsukimi.store.protocol import MountSegment, ReplicaConfig

KIB = 1024


def make_state(num_blocks: int = 4) -> tuple[MasterState, VirtualClock]:
    """One holder with room for `num_blocks` objects of 1 KiB; leases of 5 s."""
    clock = VirtualClock()
    state = MasterState(MasterConfig(lease_ttl_s=5.0), clock)
    state.registry.mount(MountSegment("c0", "seg0", "te0", 1 << 32, num_blocks * KIB), clock.now())
    return state, clock


def put(state: MasterState, key: str, upsert: bool = False, **config: object) -> None:
    state.put_start("c0", key, KIB, ReplicaConfig(**config), upsert=upsert)  # type: ignore[arg-type]
    state.put_end("c0", key)


def test_eviction_of_a_member_takes_the_group_along() -> None:
    state, _ = make_state()
    for key in ("a", "b", "c"):
        put(state, key, group="g")
    put(state, "x")
    put(state, "new")  # full: "a" is the LRU victim, "b" and "c" go with it
    assert sorted(state.objects) == ["new", "x"]
    assert state.objects.groups == {} and state.counters["evictions"] == 3
    state.check_invariants()


def test_a_leased_or_pinned_member_stays_when_its_group_is_evicted() -> None:
    state, _ = make_state()
    put(state, "pinned", group="g", soft_pin=True)
    put(state, "hard", group="g", hard_pin=True)
    put(state, "b", group="g")
    put(state, "c", group="g")
    put(state, "new")  # "b" is the first evictable victim; "c" goes with it, the pinned ones stay
    assert sorted(state.objects) == ["hard", "new", "pinned"]
    assert state.objects.groups == {"g": {"hard", "pinned"}}

    state, _ = make_state()
    put(state, "a", group="g")
    put(state, "b", group="g")
    state.get_replicas("a")  # leases "a" and "b"
    put(state, "c", group="g")  # joins later: unleased
    put(state, "x")
    put(state, "new")  # "c" is the only evictable object; its leased members stay
    assert sorted(state.objects) == ["a", "b", "new", "x"]
    assert state.objects.groups == {"g": {"a", "b"}}
    state.check_invariants()


def test_a_read_of_one_member_renews_every_members_lease() -> None:
    state, clock = make_state()
    for key in ("a", "b", "c"):
        put(state, key, group="g")
    put(state, "x")
    clock.advance(1.0)
    state.get_replicas("b")
    leases = {key: state.objects[key].lease_until for key in ("a", "b", "c", "x")}
    assert leases == {"a": 6.0, "b": 6.0, "c": 6.0, "x": 0.0}
    assert state.describe("c").lease_remaining_s == 5.0
    assert state.exists("a") and state.objects["a"].lease_until == 6.0  # exists grants no lease


def test_remove_leaves_the_other_members_and_an_emptied_group_disappears() -> None:
    state, _ = make_state()
    put(state, "a", group="g")
    put(state, "b", group="g")
    put(state, "x", group="")  # "" is no group
    state.remove("a", force=False)
    assert state.objects.groups == {"g": {"b"}} and "b" in state.objects
    state.remove("b", force=False)
    assert state.objects.groups == {}
    state.check_invariants()


def test_an_upsert_keeps_the_key_in_its_group() -> None:
    state, _ = make_state()
    put(state, "k", group="g")
    put(state, "k", upsert=True, group="other")
    put(state, "u")
    put(state, "u", upsert=True, group="late")  # an ungrouped key stays ungrouped
    assert state.objects["k"].config.group == "g" and state.objects["u"].config.group == ""
    assert state.objects.groups == {"g": {"k"}}


def test_ha_replay_rebuilds_groups_and_sessions() -> None:
    state, clock = make_state()
    state.take_changes()
    tables = journal.Tables()
    tables.apply(journal.snapshot_of(state))  # the holder's segment
    for key in ("a", "b", "c"):
        put(state, key, group="g", session="s1")
        tables.apply(journal.decode(journal.encode(journal.records_of(state, state.take_changes()))))
    state.remove("b", force=False)
    tables.apply(journal.decode(journal.encode(journal.records_of(state, state.take_changes()))))
    replayed = journal.restore(tables, state.config, clock, epoch=2)
    snapshot = journal.Tables()
    snapshot.apply(journal.decode(journal.encode(journal.snapshot_of(state))))
    restored = journal.restore(snapshot, state.config, clock, epoch=3)
    for other in (replayed, restored):
        other.check_invariants()
        assert other.objects.groups == {"g": {"a", "c"}} and other.describe("c").session == "s1"


def test_the_writers_session_is_in_the_objects_metadata() -> None:
    state, _ = make_state()
    put(state, "k", group="g", session="writer-1")
    put(state, "plain")
    info = state.describe("k")
    assert (info.group, info.session) == ("g", "writer-1")
    query = reports.batch_query(state, ["k", "plain"])
    assert (query["k"]["group_id"], query["k"]["session_id"]) == ("g", "writer-1")
    assert "group_id" not in query["plain"] and "session_id" not in query["plain"]
    put(state, "k", upsert=True, session="writer-2")  # a new version: its own writer
    assert state.describe("k").session == "writer-2"


def test_a_group_takes_at_most_max_members(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(groups, "MAX_MEMBERS", 2)
    state, _ = make_state()
    put(state, "a", group="g")
    put(state, "b", group="g")
    with pytest.raises(InvalidArgument, match="has 2 members"):
        put(state, "c", group="g")
    put(state, "a", upsert=True, group="g")  # a member's new version is no new member
    assert state.objects.groups == {"g": {"a", "b"}}
    state.check_invariants()
