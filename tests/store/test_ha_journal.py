"""The HA log's records: replaying what each operation changed rebuilds the state exactly.

A Hypothesis state machine drives one `MasterState` through random operations under a virtual
clock; after every step the records of that step's changes are encoded, decoded and replayed
into `Tables`, which must equal the tables of a fresh snapshot, and a state restored from them
must pass `check_invariants` and serve the same objects from the same blocks.
"""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tsukimi.clock import VirtualClock
from tsukimi.config import MasterConfig
from tsukimi.errors import ProtocolError, TsukimiError
from tsukimi.store.ha import journal
from tsukimi.store.master.state import MasterState
from tsukimi.store.protocol import MountSegment, ReplicaConfig

KEYS = st.sampled_from([f"k{i}" for i in range(12)])
CLIENTS = st.sampled_from(["c0", "c1", "c2"])
SEG = 64 << 10


class JournalMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = VirtualClock()
        self.state = MasterState(MasterConfig(write_grace_s=0.5, lease_ttl_s=1.0, put_timeout_s=2.0), self.clock)
        self.state.take_changes()
        self.tables = journal.Tables()
        self.incarnations = 0
        for i in range(3):
            self.mount(f"c{i}", i)

    def mount(self, client: str, index: int) -> None:
        self.incarnations += 1
        op = MountSegment(client, f"s{index}", f"te{index}", (index + 1) << 24, SEG, f"i{self.incarnations}")
        self._apply(lambda: self.state.mount(op))

    def _apply(self, operation: object) -> None:
        with contextlib.suppress(TsukimiError):
            operation()  # type: ignore[operator]
        records = journal.records_of(self.state, self.state.take_changes())
        self.tables.apply(journal.decode(journal.encode(records)))

    @rule(
        client=CLIENTS,
        key=KEYS,
        size=st.integers(1, 20_000),
        replicas=st.integers(1, 3),
        upsert=st.booleans(),
        end=st.sampled_from(["end", "revoke", "leave"]),
        group=st.sampled_from(["", "g0", "g1"]),
    )
    def put(self, client: str, key: str, size: int, replicas: int, upsert: bool, end: str, group: str) -> None:
        config = ReplicaConfig(replicas=replicas, group=group)
        self._apply(lambda: self.state.put_start(client, key, size, config, upsert))
        if end == "end":
            self._apply(lambda: self.state.put_end(client, key))
        elif end == "revoke":
            self._apply(lambda: self.state.put_revoke(client, key))

    @rule(key=KEYS, force=st.booleans())
    def remove(self, key: str, force: bool) -> None:
        self._apply(lambda: self.state.remove(key, force))

    @rule(key=KEYS)
    def get(self, key: str) -> None:
        self._apply(lambda: self.state.get_replicas(key))

    @rule(index=st.integers(0, 2))
    def restart_holder(self, index: int) -> None:
        self.mount(f"new{self.incarnations}", index)

    @rule(seconds=st.floats(0.05, 1.5), silent=st.sampled_from(["", "c0", "c1", "c2"]))
    def time_passes(self, seconds: float, silent: str) -> None:
        self.clock.advance(seconds)
        for client in list(self.state.registry.clients):
            if client != silent:
                self.state.registry.heartbeat(client, self.clock.now())
        self._apply(self.state.tick)

    @invariant()
    def replay_equals_snapshot(self) -> None:
        fresh = journal.Tables()
        fresh.apply(journal.snapshot_of(self.state))
        assert fresh.segments == self.tables.segments
        assert fresh.blocks == self.tables.blocks
        assert dict(fresh.objects) == dict(self.tables.objects)
        restored = journal.restore(self.tables, self.state.config, self.clock, epoch=7)
        restored.check_invariants()
        assert {k: [(p.segment_id, p.offset) for p in r.replicas] for k, r in restored.objects.items()} == {
            k: [(p.segment_id, p.offset) for p in r.replicas] for k, r in self.state.objects.items()
        }
        assert set(restored.pending) == set(self.state.pending)
        assert restored.objects.groups == self.state.objects.groups
        for sid, seg in self.state.registry.segments.items():
            assert restored.registry.segments[sid].allocator.blocks() == seg.allocator.blocks()


TestJournal = JournalMachine.TestCase
TestJournal.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_a_restored_state_protects_every_block_no_object_owns() -> None:
    """Blocks an old reader or failed writer may still touch stay retired after a takeover."""
    clock = VirtualClock()
    config = MasterConfig(lease_ttl_s=1.0, write_grace_s=3.0)
    state = MasterState(config, clock)
    state.take_changes()
    state.mount(MountSegment("c0", "s0", "te0", 1 << 24, SEG))
    state.put_start("c0", "gone", 1000, ReplicaConfig(), upsert=False)
    state.put_revoke("c0", "gone")  # quarantined for write_grace_s
    state.put_start("c0", "kept", 1000, ReplicaConfig(), upsert=False)
    state.put_end("c0", "kept")
    tables = journal.Tables()
    tables.apply(journal.snapshot_of(state))
    restored = journal.restore(tables, config, clock, epoch=3)
    assert [p.offset for _, p in restored.retired] == [state.retired[0][1].offset]
    assert restored.retired[0][0] == clock.now() + 3.0
    assert restored.objects["kept"].lease_until == clock.now() + 1.0  # leases restart
    restored.check_invariants()


def test_corrupt_log_entries_are_protocol_errors() -> None:
    with pytest.raises(ProtocolError):
        journal.decode(b"\x93\x01\x02")
    tables = journal.Tables()
    tables.apply([journal.SegmentUp("s0", "te0", "c0", 1 << 24, 4096, ""), journal.BlockUp("s0", 0, 8192)])
    with pytest.raises(ProtocolError, match="consistent"):
        journal.restore(tables, MasterConfig(), VirtualClock(), epoch=1)
