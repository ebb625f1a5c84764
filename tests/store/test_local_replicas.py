"""Replicas in the client's own segment move with a memcpy, never through its Transfer
Engine (tsukimi/store/local_replicas.py); replicas elsewhere still go through it, and a bad
local copy fails over to another replica as any replica does."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import replace

import pytest

from tsukimi.config import Config
from tsukimi.store.client import StoreClient
from tsukimi.store.local_replicas import gather, local_view, scatter
from tsukimi.store.master.server import MasterServer
from tsukimi.transfer import RequestStatus, TransferEngine, TransferRequest

SEGMENT = 8 << 20


class CountingEngine:
    """Counts the requests a client's engine was asked to move (wraps `transfer`)."""

    def __init__(self, engine: TransferEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.requests = 0
        real = engine.transfer

        def transfer(requests: Sequence[TransferRequest], timeout_s: float | None = None) -> list[RequestStatus]:
            self.requests += len(requests)
            return real(requests, timeout_s)

        monkeypatch.setattr(engine, "transfer", transfer)


def _client(master: MasterServer, segment_bytes: int = SEGMENT, checksum: bool = False) -> StoreClient:
    base = Config()
    config = replace(base, client=replace(base.client, checksum=checksum))
    return StoreClient.connect(master.endpoint, segment_bytes=segment_bytes, config=config)


@pytest.fixture
def holder(master: MasterServer) -> Iterator[StoreClient]:
    with _client(master) as client:
        yield client


def test_a_lone_holder_puts_and_gets_without_its_transfer_engine(
    holder: StoreClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    moved = CountingEngine(holder.engine, monkeypatch)
    payload = bytes(range(256)) * 300
    holder.put("whole", payload)
    assert holder.get("whole") == payload
    into = bytearray(len(payload) + 10)
    assert holder.get_into("whole", into) == len(payload) and into[: len(payload)] == payload

    parts = [bytearray(b"a" * 1000), memoryview(bytearray(b"b" * 24)), bytearray(b"c" * 3)]
    assert holder.batch_put_parts([("parts", parts)]) == [None]
    split = [bytearray(7), bytearray(1000), bytearray(20)]  # another split of the same bytes
    (result,) = holder.batch_get_parts(["parts"], [split])
    assert result.found and result.size == 1027
    assert b"".join(split) == b"".join(bytes(x) for x in parts)
    assert moved.requests == 0


def test_a_replica_on_another_holder_still_goes_through_the_engine(
    master: MasterServer, holder: StoreClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _client(master, segment_bytes=0) as reader:
        moved = CountingEngine(reader.engine, monkeypatch)
        holder.put("remote", b"x" * 5000)
        assert reader.get("remote") == b"x" * 5000
        assert moved.requests == 1


def test_a_corrupt_local_copy_fails_over_to_the_other_replica(
    master: MasterServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with _client(master, checksum=True) as first, _client(master, checksum=True) as second:
        payload = b"kv" * 4096
        first.put("twice", payload, replicas=2)
        (info,) = first.describe(["twice"])
        assert info is not None
        mine = next(r for r in info.replicas if r.te_segment == first.engine.name)
        first.engine.local_view(mine.address, 4)[:] = b"XXXX"  # the local copy rots
        moved = CountingEngine(first.engine, monkeypatch)
        with caplog.at_level(logging.WARNING, "tsukimi.store.replica_io"):
            assert first.get("twice") == payload  # its own copy first, then `second`'s
        assert f"crc32c mismatch in {first.engine.name}" in caplog.text
        assert moved.requests == 1
        assert second.get("twice") == payload


def test_local_view_is_only_this_engines_registered_host_memory(holder: StoreClient) -> None:
    engine = holder.engine
    holder.put("k", b"v" * 64)
    (info,) = holder.describe(["k"])
    assert info is not None
    here = info.replicas[0]
    view = local_view(engine, here.te_segment, here.address, 64)
    assert view is not None and bytes(view) == b"v" * 64
    assert local_view(engine, "elsewhere:1", here.address, 64) is None
    assert local_view(engine, engine.name, 1 << 60, 64) is None  # not registered


def test_scatter_and_gather_copy_every_part_in_order() -> None:
    source = memoryview(bytearray(range(200)) * 2000)  # 400,000 bytes: the numpy path too
    parts = [bytearray(10), memoryview(bytearray(300_000)), bytearray(99_990)]
    scatter(source, parts)
    assert b"".join(bytes(x) for x in parts) == bytes(source)
    target = memoryview(bytearray(len(source)))
    gather(parts, target)
    assert bytes(target) == bytes(source)
