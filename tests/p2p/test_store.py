"""The P2P store's semantics, one suite over every metadata backend (memory, HTTP, etcd)."""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest

from tests.p2p.conftest import MakeStore, store_config
from tsukimi.config import Config, MetadataConfig
from tsukimi.errors import (
    ConfigError,
    InvalidArgument,
    OverlappingBuffers,
    PayloadExists,
    PayloadNotFound,
    PayloadNotOpen,
)
from tsukimi.p2p import P2PStore

pytestmark = pytest.mark.timeout(90)
KIB = 1024


def unique(prefix: str = "ckpt") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def test_a_reader_gets_the_origins_bytes_through_differently_cut_buffers(make_store: MakeStore) -> None:
    origin, reader = make_store(), make_store()
    data = [bytearray(os.urandom(200 * KIB)), bytearray(os.urandom(77 * KIB + 3))]
    name = unique()
    info = origin.register(name, data)
    assert info.total_bytes == sum(map(len, data))
    assert info.shard_sizes == [64 * KIB] * 3 + [8 * KIB, 64 * KIB, 13 * KIB + 3]  # never across buffers
    assert info.replica_counts == [1] * 6
    into = [bytearray(1000), bytearray(info.total_bytes - 1000)]
    got = reader.get_replica(name, into)
    assert bytes(into[0] + into[1]) == bytes(data[0] + data[1])
    assert got.replica_counts == [2] * 6
    assert reader.stats.bytes_from_gold == info.total_bytes and reader.stats.bytes_from_replicas == 0


def test_later_readers_pull_from_earlier_readers_not_the_origin(make_store: MakeStore) -> None:
    origin, first, second = make_store(), make_store(), make_store()
    data = bytearray(os.urandom(300 * KIB))
    name = unique()
    origin.register(name, [data])
    first.get_replica(name, [bytearray(len(data))])
    into = bytearray(len(data))
    second.get_replica(name, [into])
    assert into == data
    assert second.stats.bytes_from_replicas == len(data) and second.stats.bytes_from_gold == 0
    assert origin.describe(name).replica_counts == [3] * 5


def test_concurrent_readers_all_complete_and_all_get_recorded(make_store: MakeStore) -> None:
    """Every reader's compare-and-sets race on one record; none may be lost."""
    origin = make_store()
    readers = [make_store() for _ in range(4)]
    data = bytearray(os.urandom(512 * KIB))
    name = unique()
    origin.register(name, [data])
    buffers = [bytearray(len(data)) for _ in readers]
    errors: list[BaseException] = []

    def fetch(store: P2PStore, into: bytearray) -> None:
        try:
            store.get_replica(name, [into])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=fetch, args=pair) for pair in zip(readers, buffers, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors
    assert all(buf == data for buf in buffers)
    assert origin.describe(name).replica_counts == [5] * 8


def test_names_and_sizes_are_checked(make_store: MakeStore) -> None:
    origin, reader = make_store(), make_store()
    for bad in ("", "a\nb", "x" * 600):
        with pytest.raises(InvalidArgument):
            origin.register(bad, [bytearray(10)])
    with pytest.raises(InvalidArgument):
        origin.register(unique(), [bytearray(10)], max_shard_bytes=100)
    with pytest.raises(InvalidArgument):
        origin.register(unique(), [])
    name = unique()
    origin.register(name, [bytearray(os.urandom(10 * KIB))])
    with pytest.raises(InvalidArgument, match="10240 bytes"):
        reader.get_replica(name, [bytearray(10 * KIB + 1)])
    assert reader.open_payloads() == {}
    assert origin.describe(name).replica_counts == [1]
    with pytest.raises(PayloadNotFound):
        reader.get_replica(unique(), [bytearray(10)])


def test_overlapping_buffers_are_refused_and_nothing_is_registered(make_store: MakeStore) -> None:
    store = make_store()
    block = bytearray(4 * KIB)
    view = memoryview(block)
    with pytest.raises(OverlappingBuffers):
        store.register(unique(), [view[:3000], view[2000:]])
    first = unique()
    store.register(first, [view[:2048]])
    with pytest.raises(OverlappingBuffers, match="another payload"):
        store.register(unique(), [view[1024:]])
    assert list(store.open_payloads()) == [first]


def test_a_name_has_one_origin(make_store: MakeStore) -> None:
    one, two = make_store(), make_store()
    name = unique()
    one.register(name, [bytearray(os.urandom(KIB))])
    with pytest.raises(PayloadExists):
        one.register(name, [bytearray(KIB)])
    with pytest.raises(PayloadExists, match="another origin"):
        two.register(name, [bytearray(KIB)])
    assert two.open_payloads() == {}
    with pytest.raises(PayloadExists):
        one.get_replica(name, [bytearray(KIB)])


def test_withdrawing_needs_the_right_role(make_store: MakeStore) -> None:
    origin, reader = make_store(), make_store()
    name = unique()
    origin.register(name, [bytearray(os.urandom(KIB))])
    reader.get_replica(name, [bytearray(KIB)])
    with pytest.raises(PayloadNotOpen):
        reader.unregister(name)
    with pytest.raises(PayloadNotOpen):
        origin.delete_replica(name)
    with pytest.raises(PayloadNotOpen):
        reader.delete_replica(unique())
    reader.delete_replica(name)
    assert origin.describe(name).replica_counts == [1]
    origin.unregister(name)
    with pytest.raises(PayloadNotFound):
        origin.describe(name)
    with pytest.raises(PayloadNotFound):
        reader.get_replica(name, [bytearray(KIB)])


def test_list_reports_sizes_and_live_copies_by_prefix(make_store: MakeStore) -> None:
    origin, reader = make_store(), make_store()
    prefix = unique("list")
    origin.register(f"{prefix}/a", [bytearray(os.urandom(100 * KIB))])
    origin.register(f"{prefix}/b", [bytearray(os.urandom(KIB))], meta=b"hello")
    reader.get_replica(f"{prefix}/b", [bytearray(KIB)])
    infos = reader.list(prefix)
    assert [i.name for i in infos] == [f"{prefix}/a", f"{prefix}/b"]
    assert infos[0].shard_sizes == [64 * KIB, 36 * KIB] and infos[0].replica_counts == [1, 1]
    assert infos[1].replica_counts == [2] and infos[1].meta == b"hello"
    origin.close()
    assert reader.list(prefix) == []


def test_a_holder_that_stops_refreshing_drops_out_after_its_ttl(make_store: MakeStore) -> None:
    origin, reader, late = make_store(), make_store(ttl_s=1.0), make_store()
    name = unique()
    data = bytearray(os.urandom(128 * KIB))
    origin.register(name, [data])
    reader.get_replica(name, [bytearray(len(data))])
    assert origin.describe(name).replica_counts == [2, 2]
    reader._beacon._stop.set()  # as if the process froze: no refresh, no withdrawal
    deadline = time.monotonic() + 10
    while origin.describe(name).replica_counts != [1, 1]:
        assert time.monotonic() < deadline, "the silent holder's copies are still counted"
        time.sleep(0.1)
    into = bytearray(len(data))
    late.get_replica(name, [into])
    assert into == data and late.stats.bytes_from_gold == len(data)


def test_the_store_needs_a_metadata_service() -> None:
    with pytest.raises(ConfigError, match="metadata service"):
        P2PStore(Config(metadata=MetadataConfig(url="p2p")))


def test_state_survives_a_reopened_store_on_the_same_service(metadata_url: str) -> None:
    """Records live in the metadata service, not in the store object."""
    with P2PStore(store_config(metadata_url)) as origin:
        name = unique()
        data = bytearray(os.urandom(3 * KIB))
        origin.register(name, [data])
        with P2PStore(store_config(metadata_url)) as other:
            assert other.describe(name).total_bytes == 3 * KIB
            into = bytearray(3 * KIB)
            other.get_replica(name, [into])
            assert into == data
