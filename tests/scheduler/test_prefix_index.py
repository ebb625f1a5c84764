"""PrefixIndex: exact prefix matches, drops, bit recycling, events, and a stateful model test."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tsukimi.errors import InvalidArgument
from tsukimi.scheduler.prefix_index import IndexEvent, PrefixIndex, location


def bh(*blocks: int) -> list[int]:
    return list(blocks)


A, B, C, POOL = "prefill-0/hbm", "prefill-1/hbm", "prefill-1/dram", "pool/ssd"
REQUEST = bh(10, 11, 12, 13, 14)


def test_location_names_an_instance_tier() -> None:
    assert location("prefill-0", "hbm") == "prefill-0/hbm"
    assert location("pool", "ssd") == "pool/ssd"
    with pytest.raises(InvalidArgument):
        location("pool", "nvme")  # type: ignore[arg-type]
    for bad in ("", "a/b"):
        with pytest.raises(InvalidArgument):
            location(bad, "dram")


def test_a_hole_ends_the_prefix_and_a_missing_first_block_means_no_match() -> None:
    index = PrefixIndex()
    index.stored(A, bh(10, 11, 13, 14))  # hole at 12
    index.stored(B, bh(11, 12, 13, 14))  # lacks the first block
    index.stored(C, bh(10))
    index.stored(POOL, bh(10, 11, 12, 13, 14, 99))
    assert index.match(REQUEST) == {POOL: 5, A: 2, C: 1}
    assert list(index.match(REQUEST)) == sorted([POOL, A, C])
    assert [index.match_at(loc, REQUEST) for loc in (A, B, C, POOL, "nowhere/hbm")] == [2, 0, 1, 5, 0]
    assert index.best(REQUEST) == (POOL, 5)
    assert index.best(REQUEST, among=[A, B, C]) == (A, 2)
    assert index.best(REQUEST, among=[B]) == (None, 0)
    assert index.best(REQUEST, among=[]) == (None, 0)
    assert index.best(REQUEST, among=["nowhere/hbm"]) == (None, 0)
    index.check_invariants()


def test_match_of_a_request_longer_than_every_prefix_and_of_nothing() -> None:
    index = PrefixIndex()
    index.stored(A, bh(10, 11))
    assert index.match(REQUEST) == {A: 2}
    assert index.match(REQUEST[:2]) == {A: 2}
    assert index.match(bh(12, 10)) == {}
    assert index.match(bh(11, 10)) == {A: 2}  # order within the request is all that counts
    assert index.match([]) == {}
    assert index.match_at(A, []) == 0
    assert index.best([]) == (None, 0)


def test_ties_go_to_the_smallest_name() -> None:
    index = PrefixIndex()
    for name in ("z/hbm", "m/dram", "b/ssd"):
        index.stored(name, bh(10, 11, 12))
    index.stored("a/hbm", bh(10, 11))
    assert index.best(REQUEST) == ("b/ssd", 3)
    assert index.best(REQUEST, among=["z/hbm", "m/dram", "a/hbm"]) == ("m/dram", 3)
    assert index.best(REQUEST, among=["z/hbm", "z/hbm"]) == ("z/hbm", 3)


def test_among_that_all_hold_the_first_block_still_counts_it() -> None:
    # regression guard: the running mask starts as the `among` mask and may not change at block 0
    index = PrefixIndex()
    index.stored(A, bh(10, 11, 12))
    index.stored(B, bh(10))
    assert index.best(REQUEST, among=[A, B]) == (A, 3)
    assert index.best(REQUEST, among=[B]) == (B, 1)


def test_stored_and_evicted_return_what_changed_and_ignore_the_unknown() -> None:
    index = PrefixIndex()
    assert index.stored(A, bh(1, 2, 2, 3)) == 3
    assert index.stored(A, bh(3, 4)) == 1
    assert index.stored(B, bh(2)) == 1
    assert index.evicted(A, bh(2, 2, 9)) == 1
    assert index.evicted("nowhere/hbm", bh(1)) == 0
    assert index.num_blocks(A) == 3
    assert index.num_blocks(B) == 1
    assert index.num_blocks("nowhere/hbm") == 0
    assert index.num_blocks() == 4  # distinct blocks: 1, 2 (at B), 3, 4
    assert index.evicted(A, bh(1, 3, 4)) == 3
    assert index.locations() == [A, B]  # emptied, but still registered
    assert index.num_blocks() == 1
    index.check_invariants()
    with pytest.raises(InvalidArgument):
        index.stored("", bh(1))


def test_drop_location_removes_its_blocks_only() -> None:
    index = PrefixIndex()
    index.stored(A, bh(10, 11, 12))
    index.stored(B, bh(10, 11))
    assert index.drop_location(A) == 3
    assert index.drop_location(A) == 0
    assert index.locations() == [B]
    assert index.match(REQUEST) == {B: 2}
    assert index.num_blocks() == 2
    assert index.match_at(A, REQUEST) == 0
    index.check_invariants()


def test_bits_of_dropped_locations_are_recycled_lowest_first() -> None:
    index = PrefixIndex()
    names = [f"prefill-{i}/hbm" for i in range(5)]
    for name in names:
        index.stored(name, bh(10))
    index.drop_location(names[3])
    index.drop_location(names[1])
    index.stored("new-0/hbm", bh(10, 11))
    index.stored("new-1/hbm", bh(10, 11, 12))
    assert index._bits["new-0/hbm"] == 1 << 1
    assert index._bits["new-1/hbm"] == 1 << 3
    assert index.match(REQUEST) == {"new-0/hbm": 2, "new-1/hbm": 3, names[0]: 1, names[2]: 1, names[4]: 1}
    index.check_invariants()
    for i in range(100):  # churn: masks never grow past the number of live locations
        index.drop_location(f"churn-{i - 1}/hbm")
        index.stored(f"churn-{i}/hbm", bh(10))
    assert max(index._bits.values()).bit_length() == 6
    index.check_invariants()


def test_events_round_trip_through_msgpack_and_apply() -> None:
    index = PrefixIndex()
    events = [
        IndexEvent("stored", A, [10, 11, 12]),
        IndexEvent("stored", B, [10, 11]),
        IndexEvent("evicted", A, [12]),
        IndexEvent("dropped", B),
    ]
    decoder = msgspec.msgpack.Decoder(IndexEvent)
    results = [index.apply(decoder.decode(msgspec.msgpack.encode(event))) for event in events]
    assert results == [3, 2, 1, 2]
    assert index.match(REQUEST) == {A: 2}
    with pytest.raises(msgspec.ValidationError):
        decoder.decode(msgspec.msgpack.encode({"kind": "moved", "location": A, "blocks": []}))
    index.check_invariants()


# ---- stateful test against a naive model ------------------------------------------------

LOCATIONS = ["a/hbm", "b/dram", "c/ssd", "pool/dram", "pool/ssd"]
blocks_st = st.lists(st.integers(0, 7), max_size=6)


class PrefixIndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex()
        self.model: dict[str, set[int]] = {}

    def expected_match(self, blocks: list[int]) -> dict[str, int]:
        out = {}
        for name, have in self.model.items():
            n = 0
            while n < len(blocks) and blocks[n] in have:
                n += 1
            if n:
                out[name] = n
        return out

    @rule(where=st.sampled_from(LOCATIONS), blocks=blocks_st)
    def stored(self, where: str, blocks: list[int]) -> None:
        have = self.model.setdefault(where, set())
        assert self.index.stored(where, blocks) == len(set(blocks) - have)
        have.update(blocks)

    @rule(where=st.sampled_from(LOCATIONS), blocks=blocks_st)
    def evicted(self, where: str, blocks: list[int]) -> None:
        have = self.model.get(where, set())
        assert self.index.evicted(where, blocks) == len(set(blocks) & have)
        have.difference_update(blocks)

    @rule(where=st.sampled_from(LOCATIONS))
    def drop_location(self, where: str) -> None:
        assert self.index.drop_location(where) == len(self.model.pop(where, set()))

    @rule(kind=st.sampled_from(["stored", "evicted", "dropped"]), where=st.sampled_from(LOCATIONS), blocks=blocks_st)
    def apply(self, kind: str, where: str, blocks: list[int]) -> None:
        event = msgspec.convert({"kind": kind, "location": where, "blocks": blocks}, IndexEvent)
        self.index.apply(event)
        if kind == "stored":
            self.model.setdefault(where, set()).update(blocks)
        elif kind == "evicted":
            self.model.get(where, set()).difference_update(blocks)
        else:
            self.model.pop(where, None)

    @rule(blocks=blocks_st, among=st.none() | st.lists(st.sampled_from([*LOCATIONS, "unknown/hbm"]), max_size=4))
    def query(self, blocks: list[int], among: list[str] | None) -> None:
        expected = self.expected_match(blocks)
        assert self.index.match(blocks) == expected
        assert list(self.index.match(blocks)) == sorted(expected)
        for name in [*LOCATIONS, "unknown/hbm"]:
            assert self.index.match_at(name, blocks) == expected.get(name, 0)
        candidates = {name: n for name, n in expected.items() if among is None or name in among}
        if candidates:
            top = max(candidates.values())
            assert self.index.best(blocks, among) == (min(n for n, v in candidates.items() if v == top), top)
        else:
            assert self.index.best(blocks, among) == (None, 0)

    @invariant()
    def consistent(self) -> None:
        self.index.check_invariants()
        assert self.index.locations() == sorted(self.model)
        for name in LOCATIONS:
            assert self.index.num_blocks(name) == len(self.model.get(name, ()))
        assert self.index.num_blocks() == len(set().union(*self.model.values()))


PrefixIndexMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_prefix_index_matches_the_model = PrefixIndexMachine.TestCase
