"""P2P faults with real processes: a holder SIGKILLed mid-fetch, the origin withdrawing during
a fetch, a corrupted copy, and the cluster secret."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.p2p.conftest import store_config
from tsukimi.errors import AuthError, PayloadNotFound, TooManyRetries
from tsukimi.p2p import P2PStore
from tsukimi.testing.p2p_peer import digest, payload_bytes
from tsukimi.testing.processes import JsonWorker, WorkerError
from tsukimi.transfer.metadata.http import ServerHandle, start_in_thread

pytestmark = pytest.mark.timeout(120)
MIB = 1 << 20
CHECKOUT = Path(__file__).resolve().parents[2]  # NOTE: first on the peers' path: they run the code under test


@pytest.fixture
def server() -> Iterator[ServerHandle]:
    handle, _ = start_in_thread()
    yield handle
    handle.stop()


@pytest.fixture
def peers(server: ServerHandle) -> Iterator[list[JsonWorker]]:
    """Start peers with `spawn(**args)`; all stopped afterwards."""
    started: list[JsonWorker] = []
    yield started
    for worker in started:
        worker.stop()


def spawn(peers: list[JsonWorker], url: str, label: str, *extra: str) -> JsonWorker:
    worker = JsonWorker(label, ["tsukimi.testing.p2p_peer", url, "--transport", "tcp", *extra], pythonpath=[CHECKOUT])
    peers.append(worker)
    return worker


class Fetch(threading.Thread):
    """A reader in this process pulling in the background (its error, if any, in `error`)."""

    def __init__(self, store: P2PStore, name: str, size: int) -> None:
        super().__init__(daemon=True)
        self.store, self.name_, self.into = store, name, bytearray(size)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.store.get_replica(self.name_, [self.into])
        except BaseException as exc:
            self.error = exc


def wait_for_progress(store: P2PStore, minimum: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while store.stats.bytes_fetched < minimum:
        assert time.monotonic() < deadline, "the reader made no progress"
        time.sleep(0.001)


def test_a_replica_holder_killed_mid_fetch_costs_retries_not_the_payload(
    server: ServerHandle, peers: list[JsonWorker]
) -> None:
    size, name = 96 * MIB, f"kill-{uuid.uuid4().hex[:8]}"
    origin = spawn(peers, server.url, "origin")
    holder = spawn(peers, server.url, "holder")
    origin.call(60, cmd="register", name=name, size=size, seed=7)
    holder.call(60, cmd="fetch", name=name, size=size)
    config = store_config(server.url, shard_bytes=MIB, max_inflight=1)
    with P2PStore(config) as reader:
        fetch = Fetch(reader, name, size)
        fetch.start()
        wait_for_progress(reader, 4 * MIB)  # replicas first: it is reading from the holder now
        holder.kill()
        fetch.join(90)
        assert not fetch.is_alive() and fetch.error is None
        assert digest(fetch.into) == digest(payload_bytes(size, 7))
        assert reader.stats.bytes_from_replicas > 0 and reader.stats.bytes_from_gold > 0
        assert reader.stats.retries >= 1


def test_the_origin_unregistering_mid_fetch_ends_it_cleanly(server: ServerHandle, peers: list[JsonWorker]) -> None:
    size, name = 96 * MIB, f"gone-{uuid.uuid4().hex[:8]}"
    origin = spawn(peers, server.url, "origin")
    origin.call(60, cmd="register", name=name, size=size, seed=3)
    config = store_config(server.url, shard_bytes=MIB, max_inflight=1)
    with P2PStore(config) as reader:
        fetch = Fetch(reader, name, size)
        fetch.start()
        wait_for_progress(reader, 2 * MIB)
        origin.call(30, cmd="unregister", name=name)
        fetch.join(60)
        assert not fetch.is_alive()
        assert isinstance(fetch.error, (PayloadNotFound, TooManyRetries)), repr(fetch.error)
        assert reader.open_payloads() == {}
        assert reader.list(name) == []


def test_a_corrupted_copy_is_detected_and_refetched_from_another_holder(
    server: ServerHandle, peers: list[JsonWorker]
) -> None:
    size, name = 8 * MIB, f"crc-{uuid.uuid4().hex[:8]}"
    origin = spawn(peers, server.url, "origin")
    holder = spawn(peers, server.url, "holder")
    origin.call(60, cmd="register", name=name, size=size, seed=11)
    holder.call(60, cmd="fetch", name=name, size=size)
    holder.call(10, cmd="corrupt", name=name, offset=5 * MIB + 123)
    with P2PStore(store_config(server.url, shard_bytes=MIB)) as reader:
        into = bytearray(size)
        reader.get_replica(name, [into])
        assert digest(into) == digest(payload_bytes(size, 11))
        assert reader.stats.crc_failures == 1 and reader.stats.retries == 1
        assert reader.stats.bytes_from_gold == MIB  # the one bad shard, from the origin


def test_p2p_traffic_needs_the_cluster_secret(secret_file: str) -> None:
    """Signed metadata requests and authenticated TE connections, as everywhere else."""
    handle, _ = start_in_thread(secret=Path(secret_file).read_bytes().strip())
    try:
        with P2PStore(store_config(handle.url, secret_file=secret_file)) as origin:
            name = f"secret-{uuid.uuid4().hex[:8]}"
            data = payload_bytes(MIB, 5)
            origin.register(name, [data])
            with pytest.raises(AuthError):
                P2PStore(store_config(handle.url)).list()
            with P2PStore(store_config(handle.url, secret_file=secret_file)) as reader:
                into = bytearray(MIB)
                reader.get_replica(name, [into])
                assert into == data
    finally:
        handle.stop()


def test_a_reader_with_another_secret_cannot_read_the_origins_memory(tmp_path: Path) -> None:
    """Shared (memory) metadata, engines with different secrets: the TE handshake refuses (over
    TCP; same-host transports rest on the OS's permissions instead, docs/security.md)."""
    base = tmp_path
    (base / "a").write_text("secret-a-0123456789abcdef")
    (base / "b").write_text("secret-b-0123456789abcdef")
    url = f"memory://p2p-{uuid.uuid4().hex}"
    with P2PStore(store_config(url, secret_file=str(base / "a"))) as origin:
        name = "guarded"
        origin.register(name, [payload_bytes(64 * 1024, 1)])
        with P2PStore(store_config(url, secret_file=str(base / "b"), transport="tcp", shard_timeout_s=5.0)) as reader:
            with pytest.raises(TooManyRetries) as caught:
                reader.get_replica(name, [bytearray(64 * 1024)])
            assert any("auth" in reason.lower() or "secret" in reason.lower() for reason in caught.value.reasons)
            assert reader.open_payloads() == {}


def test_a_killed_origin_with_no_other_holder_fails_the_reader_in_bounded_time(
    server: ServerHandle, peers: list[JsonWorker]
) -> None:
    size, name = 32 * MIB, f"dead-{uuid.uuid4().hex[:8]}"
    origin = spawn(peers, server.url, "origin")
    origin.call(60, cmd="register", name=name, size=size, seed=9)
    origin.kill()
    with P2PStore(store_config(server.url, shard_bytes=MIB, shard_timeout_s=5.0)) as reader:
        started = time.monotonic()
        with pytest.raises((TooManyRetries, WorkerError)):
            reader.get_replica(name, [bytearray(size)])
        assert time.monotonic() - started < 30
