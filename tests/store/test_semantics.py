"""One store semantics suite, run against every deployment shape: in-process, and master +
holders as real processes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.store.deployment import HOLDER_BYTES, Deployment, start
from tsukimi.errors import InvalidArgument, InvalidBufferError, LeaseHeld, ObjectExists, ObjectNotFound
from tsukimi.rpc import RpcClient
from tsukimi.store import protocol as p
from tsukimi.store.master.server import CODEC
from tsukimi.testing.processes import wait_until

pytestmark = pytest.mark.timeout(120)
MIB = 1 << 20


@pytest.fixture(params=["inprocess", "multiprocess"], scope="module")
def deployment(request: pytest.FixtureRequest) -> Iterator[Deployment]:
    dep = start(request.param)
    yield dep
    dep.close()


@pytest.fixture
def client(deployment: Deployment) -> Iterator[object]:
    c = deployment.client()
    yield c
    c.remove_all(force=True)


def test_byte_exact_round_trips_and_misses(client) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(1)
    for i, size in enumerate([1, 4096, 65536 + 7, 3 * MIB]):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        client.put(f"rt{i}", data, replicas=2)
        assert client.get(f"rt{i}") == data
        buf = bytearray(size + 10)
        assert client.get_into(f"rt{i}", buf) == size and bytes(buf[:size]) == data
    assert client.get("missing") is None and client.get_into("missing", bytearray(4)) == 0
    registered = client.engine.allocate(4096)  # zero-copy on registered memory, passed as is
    registered.view[:] = bytes(range(256)) * 16
    client.put_from("registered", registered)
    registered.view[:] = bytes(4096)
    assert client.get_into("registered", registered) == 4096 and bytes(registered.view) == bytes(range(256)) * 16
    assert client.batch_exists(["rt0", "missing"]) == [True, False]
    with pytest.raises(InvalidBufferError):
        client.get_into("rt3", bytearray(10))
    with pytest.raises(InvalidArgument):
        client.put("", b"x")


def test_reput_fails_upsert_replaces(client) -> None:  # type: ignore[no-untyped-def]
    client.put("k", b"one")
    with pytest.raises(ObjectExists):
        client.put("k", b"two")
    client.upsert("k", b"three!")
    assert client.get("k") == b"three!"
    results = client.batch_put([("new", b"n"), ("k", b"dup")])
    assert results[0] is None and isinstance(results[1], ObjectExists)


def test_remove_under_lease(client) -> None:  # type: ignore[no-untyped-def]
    client.put("leased", b"x")
    client.get("leased")  # lease for 1 s
    with pytest.raises(LeaseHeld):
        client.remove("leased")
    time.sleep(1.1)
    assert client.remove("leased") is True
    client.put("forced", b"x")
    client.get("forced")
    assert client.remove("forced", force=True) is True
    assert client.remove("forced") is False


def test_replicas_on_distinct_segments(deployment: Deployment, client) -> None:  # type: ignore[no-untyped-def]
    client.put("two", b"x" * 1000, replicas=2)
    info = httpx.get(deployment.http_url + "/query_key", params={"key": "two"}, timeout=5).json()
    assert len({r["te_segment"] for r in info["replicas"]}) == 2 and info["complete"]
    assert httpx.get(deployment.http_url + "/query_key", params={"key": "nope"}, timeout=5).status_code == 404


def test_filling_ten_times_the_capacity_never_fails(client) -> None:  # type: ignore[no-untyped-def]
    value = bytes(256 << 10)
    total = 0
    i = 0
    while total < 10 * 2 * HOLDER_BYTES:
        client.put(f"fill{i}", value)
        total += len(value)
        i += 1
    assert client.get(f"fill{i - 1}") == value  # the newest survives


def _used(deployment: Deployment) -> int:
    return sum(int(str(s["used"])) for s in deployment.segments())


def test_abandoned_puts_are_reclaimed(deployment: Deployment) -> None:
    # blocks of objects removed while leased are freed when their lease ends: wait for quiet
    wait_until(lambda: _used(deployment) == 0)
    with RpcClient(CODEC, deployment.endpoint) as rpc:
        rpc.call(p.PutStart("a-writer-that-dies", "abandoned", MIB, p.ReplicaConfig(replicas=2)))
        assert _used(deployment) >= 2 * MIB
        wait_until(lambda: _used(deployment) == 0)  # put_timeout_s = 1.0
        with pytest.raises(ObjectNotFound, match="reclaimed"):
            rpc.call(p.PutEnd("a-writer-that-dies", "abandoned"))


def test_regression_closing_a_client_on_a_shared_engine_returns_its_segment(deployment: Deployment) -> None:
    """The segment buffer of a client built on a caller's engine was never unregistered."""
    from dataclasses import replace

    from tsukimi.config import ClientConfig, Config
    from tsukimi.store.client import StoreClient
    from tsukimi.transfer import TransferEngine

    with TransferEngine() as engine:
        cfg = replace(Config(), client=ClientConfig(master=deployment.endpoint, segment_bytes=MIB))
        StoreClient(cfg, engine=engine).close()
        assert engine.describe().buffers == []


def test_ssd_tier_offload_hit_promote_restart(deployment: Deployment, tmp_path: Path) -> None:
    ssd = tmp_path / "ssd"
    writer = deployment.client(ssd_dir=str(ssd), ssd_bytes=64 * MIB)
    writer.put("cold", b"c" * 1000)
    for i in range(40):  # push "cold" out of memory
        writer.put(f"hot{i}", bytes(256 << 10))
    assert deployment.client().get("cold") is None  # gone from the memory pool
    assert writer.get("cold") == b"c" * 1000  # served from the SSD tier, and promoted
    assert deployment.client().get("cold") == b"c" * 1000  # back in memory for everyone
    writer.remove("cold", force=True)
    writer.put("kept", b"k" * 500)
    writer.close()
    again = deployment.client(ssd_dir=str(ssd), ssd_bytes=64 * MIB)  # a restarted client
    for i in range(40):  # push "kept" out of memory: only the restarted client's SSD has it
        again.put(f"hot-again{i}", bytes(256 << 10))
    assert deployment.client().get("kept") is None
    assert again.get("kept") == b"k" * 500  # found again on the SSD after the restart
    assert again.remove_all(force=True) >= 1
    assert again.get("kept") is None  # regression: remove_all used to leave the SSD copy behind


def test_batch_get_into_needs_a_buffer_per_key(client) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidArgument, match="2 keys but 1 buffers"):
        client.batch_get_into(["a", "b"], [bytearray(10)])
