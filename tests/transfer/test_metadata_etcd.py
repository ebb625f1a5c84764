"""The etcd metadata backend beyond the semantics suite (tests/transfer/test_metadata.py):
endpoint failover, keys other clients can read, etcd's own limits, leases per ephemeral key,
URL parsing."""

from __future__ import annotations

import base64
import time
import uuid
from pathlib import Path

import httpx
import pytest
from etcd3gw.exceptions import ConnectionFailedError

from tests.etcd_server import EtcdProcess, run_etcd
from tsukimi.errors import ConfigError, MetadataError
from tsukimi.netio import free_port
from tsukimi.transfer.metadata.base import SEGMENT_PREFIX
from tsukimi.transfer.metadata.etcd import EtcdMetadata, lease_ttl_s
from tsukimi.transfer.metadata.etcd_kv import EtcdKV, parse_etcd_url

pytestmark = pytest.mark.timeout(60)


def unique_key(suffix: str = "desc") -> str:
    return f"{SEGMENT_PREFIX}{uuid.uuid4().hex}/{suffix}"


def test_etcd_fails_over_from_dead_first_endpoint(etcd_proc: EtcdProcess) -> None:
    url = f"etcd://127.0.0.1:{free_port()},127.0.0.1:{etcd_proc.client_port}"
    with EtcdMetadata.from_url(url, timeout_s=2.0) as store:
        key = unique_key()
        started = time.monotonic()
        store.put(key, b"via the second endpoint")
        assert store.get(key) == b"via the second endpoint"
        assert time.monotonic() - started < 2.0


def test_etcd_all_endpoints_dead_is_metadata_error() -> None:
    url = f"etcd://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    with (
        EtcdMetadata.from_url(url, timeout_s=1.0) as store,
        pytest.raises(MetadataError, match="no etcd endpoint answered") as info,
    ):
        store.get("k")
    assert isinstance(info.value.__cause__, ConnectionFailedError)


def test_etcd_killed_server_is_metadata_error(tmp_path: Path) -> None:
    with run_etcd(tmp_path) as proc, EtcdMetadata.from_url(proc.url, timeout_s=1.0) as store:
        store.put("k", b"v")
        proc.kill()
        with pytest.raises(MetadataError):
            store.get("k")


def test_etcd_stores_utf8_keys_readable_by_other_clients(etcd_proc: EtcdProcess) -> None:
    key = unique_key("日本語")
    with EtcdMetadata.from_url(etcd_proc.url) as store:
        store.put(key, b"\x00\xff")
    body = {"key": base64.b64encode(key.encode()).decode()}
    response = httpx.post(f"{etcd_proc.http_url}/v3/kv/range", json=body, trust_env=False)
    assert base64.b64decode(response.json()["kvs"][0]["value"]) == b"\x00\xff"


def test_etcd_value_over_its_request_limit_is_metadata_error(etcd_proc: EtcdProcess) -> None:
    # etcd's default --max-request-bytes is 1.5 MiB, far below MAX_VALUE_BYTES.
    with EtcdMetadata.from_url(etcd_proc.url) as store, pytest.raises(MetadataError, match="etcd refused put"):
        store.put(unique_key(), bytes(2 << 20))


@pytest.mark.parametrize(("ttl_s", "lease_s"), [(0.1, 1), (1.0, 1), (1.01, 2), (10.0, 10), (3600.0, 3600)])
def test_etcd_lease_ttl_is_whole_seconds_rounded_up(ttl_s: float, lease_s: int) -> None:
    assert lease_ttl_s(ttl_s) == lease_s


def _lease_of(etcd_proc: EtcdProcess, key: str) -> int:
    """The lease `key` is attached to (0: none), as etcd's own JSON API tells."""
    body = {"key": base64.b64encode(key.encode()).decode()}
    kvs = httpx.post(f"{etcd_proc.http_url}/v3/kv/range", json=body, trust_env=False).json()["kvs"]
    return int(kvs[0].get("lease", 0))


def test_etcd_ephemeral_keys_ride_on_a_lease_per_key(etcd_proc: EtcdProcess) -> None:
    key, other = unique_key("a"), unique_key("b")
    with EtcdMetadata.from_url(etcd_proc.url) as store:
        store.put_ephemeral(key, b"v", 5.0)
        store.put_ephemeral(other, b"v", 5.0)
        lease = _lease_of(etcd_proc, key)
        assert lease and _lease_of(etcd_proc, other) not in (0, lease)
        before = store.get_versioned(key)
        store.put_ephemeral(key, b"v", 5.0)  # a refresh with the same value: keepalive only
        assert store.get_versioned(key) == before and _lease_of(etcd_proc, key) == lease
        store.put_ephemeral(key, b"v", 7.0)  # another TTL: a new lease, the old one revoked
        assert _lease_of(etcd_proc, key) not in (0, lease) and store.get(key) == b"v"
        EtcdKV(etcd_proc.url).revoke(_lease_of(etcd_proc, key))  # as if it had expired
        assert store.get(key) is None
        store.put_ephemeral(key, b"back", 7.0)  # the refresh finds the lease gone: a new one
        assert store.get(key) == b"back" and _lease_of(etcd_proc, key) != 0
        store.put(other, b"plain")
        assert _lease_of(etcd_proc, other) == 0


@pytest.mark.parametrize(
    ("url", "endpoints"),
    [
        ("etcd://h:1", [("h", 1)]),
        ("etcd://a:1,b:2", [("a", 1), ("b", 2)]),
        ("etcd://a", [("a", 2379)]),
        ("etcd://[::1]:2380,a:3/", [("::1", 2380), ("a", 3)]),
    ],
)
def test_parse_etcd_url(url: str, endpoints: list[tuple[str, int]]) -> None:
    assert parse_etcd_url(url) == endpoints


@pytest.mark.parametrize("url", ["etcd://", "etcd://a:0", "etcd://a:x", "etcd://[::1", "http://a:1"])
def test_parse_etcd_url_rejects(url: str) -> None:
    with pytest.raises(ConfigError):
        parse_etcd_url(url)
