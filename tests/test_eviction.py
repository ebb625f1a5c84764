"""Tests of `tsukimi.eviction`: exact victim order of each policy on hand-built sequences, and a
Hypothesis state machine per policy against a brute-force reference model."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tsukimi.errors import ConfigError
from tsukimi.eviction import EvictionPolicy, LengthAwarePolicy, LfuPolicy, LruPolicy, make_policy

# ----------------------------------------------------------------------------- LRU


def test_lru_evicts_least_recently_used_first() -> None:
    policy: LruPolicy[str] = LruPolicy()
    for key in "abc":
        policy.insert(key)
    policy.touch("a")
    assert list(policy.victims()) == ["b", "c", "a"]
    policy.insert("b")  # re-inserting touches
    assert list(policy.victims()) == ["c", "a", "b"]
    assert policy.pop_victim() == "c"
    assert policy.pop_victim(keep={"a"}) == "b"
    assert list(policy.victims()) == ["a"]
    assert policy.pop_victim(keep={"a"}) is None
    assert len(policy) == 1 and "a" in policy and "b" not in policy


def test_lru_ignores_position() -> None:
    policy: LruPolicy[int] = LruPolicy()
    policy.insert(1, position=9)
    policy.insert(2, position=0)
    assert list(policy.victims()) == [1, 2]


# ----------------------------------------------------------------------------- LFU


def test_lfu_evicts_least_frequent_then_least_recent() -> None:
    policy: LfuPolicy[str] = LfuPolicy()
    for key in "abcde":
        policy.insert(key)
    policy.touch("a")
    policy.touch("a")  # a: 3
    policy.touch("c")  # c: 2
    policy.insert("e")  # e: 2, re-inserting counts as an access
    assert [policy.frequency(k) for k in "abcde"] == [3, 1, 2, 1, 2]
    assert list(policy.victims()) == ["b", "d", "c", "e", "a"]
    assert policy.pop_victim(keep={"b"}) == "d"
    assert policy.pop_victim() == "b"
    assert policy.pop_victim() == "c"
    assert list(policy.victims()) == ["e", "a"]


def test_lfu_frequency_restarts_after_eviction() -> None:
    policy: LfuPolicy[str] = LfuPolicy()
    policy.insert("a")
    policy.touch("a")
    policy.insert("b")
    assert policy.pop_victim(keep={"b"}) == "a"
    policy.insert("a")  # back with frequency 1, more recent than b
    assert policy.frequency("a") == 1
    assert list(policy.victims()) == ["b", "a"]
    policy.remove("b")
    assert policy.frequency("b") == 0


def test_lfu_order_survives_heap_rebuilds() -> None:
    policy: LfuPolicy[int] = LfuPolicy()
    for key in range(3):
        policy.insert(key)
    for i in range(500):  # far more stale heap entries than keys: forces rebuilds
        policy.touch(i % 2)
    assert list(policy.victims()) == [2, 0, 1]
    assert [policy.pop_victim() for _ in range(4)] == [2, 0, 1, None]


# ----------------------------------------------------------------------------- length-aware


def test_length_aware_evicts_least_frequent_then_earliest_position_then_least_recent() -> None:
    policy: LengthAwarePolicy[str] = LengthAwarePolicy()
    policy.insert("a", position=2)
    policy.insert("b", position=0)
    policy.insert("c", position=1)
    assert list(policy.victims()) == ["b", "c", "a"]
    policy.touch("b", position=0)  # b: frequency 2
    policy.insert("d", position=1)  # same frequency and position as c, more recent
    assert list(policy.victims()) == ["c", "d", "a", "b"]
    policy.touch("a", position=0)  # a: frequency 2 at position 0 now, like b but more recent
    assert list(policy.victims()) == ["c", "d", "b", "a"]
    policy.touch("b", position=5)  # b: frequency 3
    assert list(policy.victims()) == ["c", "d", "a", "b"]
    assert policy.pop_victim(keep={"c", "d"}) == "a"
    assert policy.pop_victim() == "c"


# ----------------------------------------------------------------------------- all policies

FACTORIES: list[Callable[[], EvictionPolicy[str]]] = [LruPolicy, LfuPolicy, LengthAwarePolicy]


@pytest.mark.parametrize("factory", FACTORIES)
def test_unknown_keys_are_ignored(factory: Callable[[], EvictionPolicy[str]]) -> None:
    policy = factory()
    assert policy.pop_victim() is None
    policy.touch("x")
    policy.remove("x")
    assert len(policy) == 0 and "x" not in policy
    policy.insert("a")
    policy.insert("b")
    policy.touch("x", position=3)
    policy.remove("x")
    assert list(policy.victims()) == ["a", "b"]


@pytest.mark.parametrize("factory", FACTORIES)
def test_pop_victim_with_everything_kept_changes_nothing(factory: Callable[[], EvictionPolicy[str]]) -> None:
    policy = factory()
    policy.insert("a")
    policy.insert("b")
    assert policy.pop_victim(keep={"a", "b", "z"}) is None
    assert list(policy.victims()) == ["a", "b"]
    assert policy.pop_victim(keep={"a"}) == "b"
    assert policy.pop_victim() == "a"
    assert len(policy) == 0


@pytest.mark.parametrize("factory", FACTORIES)
def test_victims_is_a_snapshot(factory: Callable[[], EvictionPolicy[str]]) -> None:
    policy = factory()
    for key in "abc":
        policy.insert(key)
    for key in policy.victims():
        policy.remove(key)
    assert len(policy) == 0


@pytest.mark.parametrize(
    ("name", "cls"),
    [("lru", LruPolicy), ("lfu", LfuPolicy), ("length_aware", LengthAwarePolicy), ("length-aware", LengthAwarePolicy)],
)
def test_make_policy_by_name(name: str, cls: type) -> None:
    policy: EvictionPolicy[int] = make_policy(name)
    assert type(policy) is cls
    assert len(policy) == 0


@pytest.mark.parametrize("name", ["fifo", "", "LRU", "length aware"])
def test_make_policy_rejects_unknown_names(name: str) -> None:
    with pytest.raises(ConfigError, match="lru, lfu, length_aware"):
        make_policy(name)


# ----------------------------------------------------------------------------- stateful

KEYS = st.integers(min_value=0, max_value=7)
POSITIONS = st.integers(min_value=0, max_value=4)


class ReferenceModel:
    """Brute force: every key's (frequency, position, tick); the victim is the minimum rank."""

    def __init__(self, rank: Callable[[tuple[int, int, int]], tuple[int, ...]]) -> None:
        self.entries: dict[int, tuple[int, int, int]] = {}
        self.rank = rank
        self.tick = 0

    def access(self, key: int, position: int, insert: bool) -> None:
        old = self.entries.get(key)
        if old is None and not insert:
            return
        self.entries[key] = ((old[0] + 1) if old else 1, position, self.tick)
        self.tick += 1

    def order(self) -> list[int]:
        return sorted(self.entries, key=lambda k: self.rank(self.entries[k]))

    def pop_victim(self, keep: frozenset[int]) -> int | None:
        for key in self.order():
            if key not in keep:
                del self.entries[key]
                return key
        return None


class PolicyMachine(RuleBasedStateMachine):
    factory: Callable[[], EvictionPolicy[int]]
    rank: Callable[[tuple[int, int, int]], tuple[int, ...]]

    def __init__(self) -> None:
        super().__init__()
        self.policy = type(self).factory()
        self.model = ReferenceModel(type(self).rank)

    @rule(key=KEYS, position=POSITIONS)
    def insert(self, key: int, position: int) -> None:
        self.policy.insert(key, position)
        self.model.access(key, position, insert=True)

    @rule(key=KEYS, position=POSITIONS)
    def touch(self, key: int, position: int) -> None:
        self.policy.touch(key, position)
        self.model.access(key, position, insert=False)

    @rule(key=KEYS)
    def remove(self, key: int) -> None:
        self.policy.remove(key)
        self.model.entries.pop(key, None)

    @rule(keep=st.frozensets(KEYS, max_size=4))
    def pop_victim(self, keep: frozenset[int]) -> None:
        assert self.policy.pop_victim(keep) == self.model.pop_victim(keep)

    @invariant()
    def same_state(self) -> None:
        assert list(self.policy.victims()) == self.model.order()
        assert len(self.policy) == len(self.model.entries)
        for key in range(8):
            assert (key in self.policy) == (key in self.model.entries)


STATEFUL = settings(max_examples=60, stateful_step_count=40, deadline=None)


class LruMachine(PolicyMachine):
    factory = LruPolicy
    rank = staticmethod(lambda e: (e[2],))


class LfuMachine(PolicyMachine):
    factory = LfuPolicy
    rank = staticmethod(lambda e: (e[0], e[2]))


class LengthAwareMachine(PolicyMachine):
    factory = LengthAwarePolicy
    rank = staticmethod(lambda e: (e[0], e[1], e[2]))


TestLruStateful = LruMachine.TestCase
TestLruStateful.settings = STATEFUL
TestLfuStateful = LfuMachine.TestCase
TestLfuStateful.settings = STATEFUL
TestLengthAwareStateful = LengthAwareMachine.TestCase
TestLengthAwareStateful.settings = STATEFUL
