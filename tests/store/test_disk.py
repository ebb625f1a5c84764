"""Tests of the SSD tier (`tsukimi.store.disk.DiskTier`): round trips, exact LRU eviction,
restart recovery (objects and LRU order), corrupt and leftover files, and a stateful model."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tsukimi.clock import VirtualClock
from tsukimi.errors import ConfigError, InvalidBufferError
from tsukimi.store.disk import DiskTier


def file_of(directory: Path, key: str) -> Path:
    return directory / (hashlib.sha256(key.encode("utf-8")).hexdigest() + ".obj")


def make(directory: Path, capacity_bytes: int = 1000, clock: VirtualClock | None = None) -> DiskTier:
    return DiskTier(directory, capacity_bytes, clock or VirtualClock(), durable=False)


def test_round_trip_of_odd_keys_and_values(tmp_path: Path) -> None:
    tier = make(tmp_path / "a" / "b")  # the directory is created
    cases = {"a/b/../c": b"\x00\xff" * 10, "ключ ✓ 🔑": bytes(range(256)), "empty": b"", "x" * 4096: b"v"}
    for key, value in cases.items():
        assert tier.put(key, value)
    for key, value in cases.items():
        assert tier.get(key) == value
        assert tier.size_of(key) == len(value)
    assert tier.used_bytes == sum(map(len, cases.values()))
    assert tier.num_objects == 4
    assert tier.get("missing") is None and tier.size_of("missing") is None
    tier.check_invariants()


def test_put_replaces_and_accepts_memoryview(tmp_path: Path) -> None:
    tier = make(tmp_path)
    assert tier.put("k", b"old value")
    assert tier.put("k", memoryview(bytearray(b"new")))
    assert tier.get("k") == b"new"
    assert tier.used_bytes == 3 and tier.num_objects == 1
    tier.check_invariants()


def test_invalid_arguments(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        make(tmp_path, capacity_bytes=0)
    tier = make(tmp_path)
    for bad in ["", "x" * 4097, "é" * 2049]:
        with pytest.raises(ConfigError):
            tier.put(bad, b"v")
    with pytest.raises(ConfigError):
        tier.get("")


def test_lru_eviction_is_exact(tmp_path: Path) -> None:
    clock = VirtualClock()
    tier = make(tmp_path, capacity_bytes=30, clock=clock)
    for key in "abc":
        assert tier.put(key, key.encode() * 10)
        clock.advance(1)
    assert tier.get("a") == b"a" * 10  # now b is the least recently used
    clock.advance(1)
    assert tier.put("d", b"d" * 10)
    assert tier.keys() == ["c", "a", "d"]
    assert not tier.contains("b") and not file_of(tmp_path, "b").exists()
    assert tier.put("e", b"e" * 20)  # needs two victims: c then a
    assert tier.keys() == ["d", "e"]
    tier.check_invariants()


def test_contains_and_size_of_do_not_refresh_lru(tmp_path: Path) -> None:
    tier = make(tmp_path, capacity_bytes=20)
    tier.put("a", b"a" * 10)
    tier.put("b", b"b" * 10)
    assert tier.contains("a") and tier.size_of("a") == 10
    tier.put("c", b"c" * 10)
    assert tier.keys() == ["b", "c"]


def test_oversized_object_is_refused_and_drops_older_copy(tmp_path: Path) -> None:
    tier = make(tmp_path, capacity_bytes=10)
    assert tier.put("other", b"o" * 5)
    assert tier.put("k", b"k" * 5)
    assert not tier.put("k", b"x" * 11)
    assert tier.keys() == ["other"]  # nothing stored, nothing else evicted, no stale copy of k
    assert tier.put("exact", b"e" * 10)
    assert tier.keys() == ["exact"]
    tier.check_invariants()


def test_pop_and_remove(tmp_path: Path) -> None:
    tier = make(tmp_path)
    tier.put("k", b"value")
    assert tier.pop("k") == b"value"
    assert tier.pop("k") is None
    assert not tier.remove("k")
    tier.put("k", b"value")
    assert tier.remove("k")
    assert tier.num_objects == 0 and tier.used_bytes == 0 and list(tmp_path.iterdir()) == []


def test_get_into(tmp_path: Path) -> None:
    tier = make(tmp_path)
    tier.put("k", b"0123456789")
    buffer = bytearray(16)
    assert tier.get_into("k", buffer) == 10
    assert bytes(buffer[:10]) == b"0123456789" and bytes(buffer[10:]) == bytes(6)
    assert tier.get_into("missing", buffer) is None
    with pytest.raises(InvalidBufferError):
        tier.get_into("k", bytearray(9))
    with pytest.raises(InvalidBufferError):
        tier.get_into("k", memoryview(bytes(16)))
    assert tier.contains("k")


def test_restart_recovers_objects_and_lru_order(tmp_path: Path) -> None:
    clock = VirtualClock(start=100.0)
    tier = make(tmp_path, capacity_bytes=40, clock=clock)
    for key in ["k/1", "k/2", "ключ", "k/4"]:
        tier.put(key, key.encode() * 2)
        clock.advance(1)
    tier.get("k/2")
    tier.get("k/1")
    order = tier.keys()
    assert order == ["ключ", "k/4", "k/2", "k/1"]

    again = make(tmp_path, capacity_bytes=40, clock=clock)
    assert again.keys() == order
    assert all(again.get(k) == k.encode() * 2 for k in ["ключ", "k/4"])  # touch after restart
    again.check_invariants()
    assert make(tmp_path, capacity_bytes=40, clock=clock).keys() == ["k/2", "k/1", "ключ", "k/4"]


def test_restart_with_a_clock_behind_the_stamps_keeps_order(tmp_path: Path) -> None:
    tier = make(tmp_path, clock=VirtualClock(start=1000.0))
    tier.put("old", b"o")
    again = make(tmp_path, clock=VirtualClock(start=0.0))  # e.g. a monotonic clock after a reboot
    again.put("new", b"n")
    assert make(tmp_path).keys() == ["old", "new"]


def test_restart_with_smaller_capacity_evicts_lru(tmp_path: Path) -> None:
    clock = VirtualClock()
    tier = make(tmp_path, capacity_bytes=30, clock=clock)
    for key in "abc":
        tier.put(key, b"v" * 10)
        clock.advance(1)
    again = make(tmp_path, capacity_bytes=15, clock=clock)
    assert again.keys() == ["c"]
    again.check_invariants()


def test_corrupt_value_is_dropped_on_get(tmp_path: Path) -> None:
    tier = make(tmp_path)
    tier.put("k", b"0123456789")
    tier.put("j", b"0123456789")
    path = file_of(tmp_path, "k")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(data)
    assert tier.get("k") is None
    assert not tier.contains("k") and not path.exists() and tier.used_bytes == 10
    file_of(tmp_path, "j").unlink()  # removed behind the tier's back: a miss, not an error
    assert tier.get_into("j", bytearray(10)) is None
    tier.check_invariants()


def test_truncated_and_invalid_files_are_dropped_on_restart(tmp_path: Path) -> None:
    tier = make(tmp_path)
    for key in ["truncated", "bad magic", "renamed", "good"]:
        tier.put(key, b"0123456789")
    path = file_of(tmp_path, "truncated")
    path.write_bytes(path.read_bytes()[:-1])
    path = file_of(tmp_path, "bad magic")
    path.write_bytes(b"XXXX" + path.read_bytes()[4:])
    os.replace(file_of(tmp_path, "renamed"), file_of(tmp_path, "elsewhere"))
    (tmp_path / "notes.txt").write_text("not ours: left alone")
    again = make(tmp_path)
    assert again.keys() == ["good"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([file_of(tmp_path, "good").name, "notes.txt"])
    again.check_invariants()


def test_leftover_temp_file_is_cleaned_on_restart(tmp_path: Path) -> None:
    tier = make(tmp_path)
    tier.put("k", b"v")
    fd, tmp = tempfile.mkstemp(dir=tmp_path, prefix=".", suffix=".tmp")
    os.write(fd, b"half a write")
    os.close(fd)
    again = make(tmp_path)
    assert not Path(tmp).exists()
    assert again.keys() == ["k"]
    again.check_invariants()


def test_concurrent_puts_and_gets_keep_invariants(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=2000, durable=False)  # the wall clock

    def work(worker: int) -> None:
        for i in range(50):
            key = f"{worker}/{i % 7}"
            tier.put(key, bytes([worker]) * (i + 1))
            value = tier.get(f"{worker}/{(i * 3) % 7}")
            assert value is None or set(value) == {worker}

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tier.check_invariants()
    assert make(tmp_path, capacity_bytes=2000).keys() == tier.keys()


@given(value=st.binary(max_size=2000))
@settings(max_examples=30, deadline=None)
def test_arbitrary_bytes_round_trip(value: bytes) -> None:
    directory = tempfile.mkdtemp()
    try:
        tier = make(Path(directory), capacity_bytes=4096)
        assert tier.put("k", value)
        assert tier.get("k") == value
        assert make(Path(directory), capacity_bytes=4096).pop("k") == value
    finally:
        shutil.rmtree(directory)


KEYS = st.sampled_from(["a", "b/c", "ключ", "d" * 50, "e"])
CAPACITY = 64
SIZES = st.one_of(st.sampled_from([0, 20, 30, CAPACITY, CAPACITY + 1]), st.integers(0, CAPACITY + 8))
VALUES = SIZES.flatmap(lambda n: st.binary(min_size=n, max_size=n))  # sizes that make evictions common


class DiskTierMachine(RuleBasedStateMachine):
    """Drive a DiskTier against a dict + LRU model, restarting it now and then."""

    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp())
        self.clock = VirtualClock()
        self.tier = make(self.directory, CAPACITY, self.clock)
        self.model: OrderedDict[str, bytes] = OrderedDict()  # LRU first

    def teardown(self) -> None:
        shutil.rmtree(self.directory)

    @rule(key=KEYS, value=VALUES)
    def put(self, key: str, value: bytes) -> None:
        stored = self.tier.put(key, value)
        self.model.pop(key, None)
        assert stored == (len(value) <= CAPACITY)
        if stored:
            while sum(map(len, self.model.values())) + len(value) > CAPACITY:
                self.model.popitem(last=False)
            self.model[key] = value

    @rule(key=KEYS)
    def get(self, key: str) -> None:
        assert self.tier.get(key) == self.model.get(key)
        if key in self.model:
            self.model.move_to_end(key)

    @rule(key=KEYS)
    def get_into(self, key: str) -> None:
        buffer = bytearray(CAPACITY)
        size = self.tier.get_into(key, buffer)
        expected = self.model.get(key)
        assert size == (None if expected is None else len(expected))
        if expected is not None:
            assert bytes(buffer[: len(expected)]) == expected
            self.model.move_to_end(key)

    @rule(key=KEYS)
    def pop(self, key: str) -> None:
        assert self.tier.pop(key) == self.model.pop(key, None)

    @rule(key=KEYS)
    def remove(self, key: str) -> None:
        assert self.tier.remove(key) == (self.model.pop(key, None) is not None)

    @rule(key=KEYS)
    def contains(self, key: str) -> None:
        assert self.tier.contains(key) == (key in self.model)
        assert self.tier.size_of(key) == (len(self.model[key]) if key in self.model else None)

    @rule(seconds=st.sampled_from([0.0, 1e-9, 0.5, 3.0]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def restart(self) -> None:
        self.tier = make(self.directory, CAPACITY, self.clock)

    @invariant()
    def agrees_with_model(self) -> None:
        self.tier.check_invariants()
        assert self.tier.keys() == list(self.model)
        assert self.tier.used_bytes == sum(map(len, self.model.values()))


DiskTierMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
test_disk_tier_state_machine = DiskTierMachine.TestCase
