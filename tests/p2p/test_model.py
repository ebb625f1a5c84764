"""A Hypothesis state machine over several P2P stores on one metadata service: any sequence
of register / get_replica / delete_replica / unregister / close keeps the records true."""

from __future__ import annotations

import os
import uuid

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.p2p.conftest import store_config
from tsukimi.errors import PayloadExists, PayloadNotFound, PayloadNotOpen
from tsukimi.p2p import P2PStore
from tsukimi.p2p.holders import live_holders
from tsukimi.p2p.records import PAYLOAD_PREFIX, decode_record

pytestmark = pytest.mark.timeout(300)
NAMES = ("a", "b", "c")
STORES = 3


class P2PModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.url = f"memory://model-{uuid.uuid4().hex}"
        self.stores = [P2PStore(store_config(self.url, shard_bytes=4096)) for _ in range(STORES)]
        self.origin: dict[str, tuple[int, bytes]] = {}  # name -> (store index, bytes)
        self.copies: dict[tuple[int, str], bytearray] = {}  # (store, name) -> its copy
        self.generation: dict[tuple[int, str], int] = {}  # (store, name) -> registration it copied
        self.registrations = 0

    @rule(store=st.integers(0, STORES - 1), name=st.sampled_from(NAMES), size=st.integers(1, 20_000))
    def register(self, store: int, name: str, size: int) -> None:
        data = bytearray(os.urandom(size))
        try:
            self.stores[store].register(name, [data])
        except PayloadExists:
            assert name in self.origin or (store, name) in self.copies
            return
        assert name not in self.origin
        self.registrations += 1
        self.origin[name] = (store, bytes(data))
        self.copies[(store, name)] = data
        self.generation[(store, name)] = self.registrations

    @rule(store=st.integers(0, STORES - 1), name=st.sampled_from(NAMES), cut=st.floats(0.0, 1.0))
    def get_replica(self, store: int, name: str, cut: float) -> None:
        if name not in self.origin:
            with pytest.raises(PayloadNotFound):
                self.stores[store].get_replica(name, [bytearray(8)])
            return
        size = len(self.origin[name][1])
        split = max(1, min(size - 1, int(size * cut))) if size > 1 else 1
        parts = [bytearray(split), bytearray(size - split)] if size > split else [bytearray(size)]
        if (store, name) in self.copies:
            with pytest.raises(PayloadExists):
                self.stores[store].get_replica(name, parts)
            return
        self.stores[store].get_replica(name, parts)
        copy = bytearray(b"".join(parts))
        assert copy == self.origin[name][1]
        self.copies[(store, name)] = copy
        self.generation[(store, name)] = self.generation[(self.origin[name][0], name)]

    @rule(store=st.integers(0, STORES - 1), name=st.sampled_from(NAMES))
    def delete_replica(self, store: int, name: str) -> None:
        is_replica = (store, name) in self.copies and self.origin.get(name, (-1,))[0] != store
        if not is_replica:
            with pytest.raises(PayloadNotOpen):
                self.stores[store].delete_replica(name)
            return
        self.stores[store].delete_replica(name)
        del self.copies[(store, name)]

    @rule(store=st.integers(0, STORES - 1), name=st.sampled_from(NAMES))
    def unregister(self, store: int, name: str) -> None:
        if self.origin.get(name, (-1,))[0] != store:
            with pytest.raises(PayloadNotOpen):
                self.stores[store].unregister(name)
            return
        self.stores[store].unregister(name)
        del self.origin[name]
        del self.copies[(store, name)]
        # NOTE: readers keep their now-orphaned copies open until they delete them

    @precondition(lambda self: len(self.stores) > 0)
    @rule(store=st.integers(0, STORES - 1))
    def reopen(self, store: int) -> None:
        """Close a store (it withdraws everything) and put a fresh one in its place."""
        self.stores[store].close()
        for name, (owner, _) in list(self.origin.items()):
            if owner == store:
                del self.origin[name]
        self.copies = {key: value for key, value in self.copies.items() if key[0] != store}
        self.stores[store] = P2PStore(store_config(self.url, shard_bytes=4096))

    @invariant()
    def records_match_the_stores(self) -> None:
        metadata = self.stores[0]._metadata
        records = {
            key.removeprefix(PAYLOAD_PREFIX): decode_record(e.value)
            for key, e in metadata.list_prefix(PAYLOAD_PREFIX).items()
        }
        assert set(records) == set(self.origin)
        live = set(live_holders(metadata))
        segment_of = {s.engine.name: i for i, s in enumerate(self.stores)}
        for name, record in records.items():
            owner, data = self.origin[name]
            assert record.origin == self.stores[owner].engine.name and record.total_bytes == len(data)
            for shard in record.shards:
                holders = {r.segment for r in shard.replicas if r.segment in live}
                current = self.generation[(owner, name)]
                expected = {
                    self.stores[i].engine.name
                    for (i, n) in self.copies
                    if n == name and i != owner and self.generation[(i, n)] == current
                }
                assert holders == expected
                assert all(segment_of.get(h) is not None for h in holders)

    def teardown(self) -> None:
        for store in self.stores:
            store.close()


TestP2PModel = P2PModel.TestCase
TestP2PModel.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
