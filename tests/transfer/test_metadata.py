"""One semantics suite for every metadata backend (memory, HTTP, etcd), then each one's specifics."""

from __future__ import annotations

import base64
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from etcd3gw.exceptions import ConnectionFailedError

from tests.etcd_server import EtcdProcess, run_etcd
from tsukimi.config import MetadataConfig
from tsukimi.errors import ClosedError, ConfigError, MetadataError
from tsukimi.testing.processes import free_port
from tsukimi.transfer.metadata import (
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    SEGMENT_PREFIX,
    MetadataBackend,
    connect_metadata,
)
from tsukimi.transfer.metadata.etcd import EtcdMetadata, parse_etcd_url
from tsukimi.transfer.metadata.http import HttpMetadata, ServerHandle, _listen, start_in_thread
from tsukimi.transfer.metadata.memory import MemoryMetadata

pytestmark = pytest.mark.timeout(60)

Factory = Callable[[], MetadataBackend]


def unique_key(suffix: str = "desc") -> str:
    return f"{SEGMENT_PREFIX}{uuid.uuid4().hex}/{suffix}"


@pytest.fixture(scope="module")
def etcd_proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    with run_etcd(tmp_path_factory.mktemp("etcd")) as proc:
        yield proc


@pytest.fixture(scope="module")
def http_server() -> Iterator[ServerHandle]:
    handle, _ = start_in_thread()
    yield handle
    handle.stop()


@pytest.fixture(params=["memory", "http", "etcd"])
def open_backend(request: pytest.FixtureRequest) -> Iterator[Factory]:
    """Opens handles onto one shared store per test; closes them all afterwards."""
    handles: list[MetadataBackend] = []
    name = f"test-{uuid.uuid4().hex}"

    def factory() -> MetadataBackend:
        handle: MetadataBackend
        if request.param == "memory":
            handle = MemoryMetadata.named(name)
        elif request.param == "http":
            handle = HttpMetadata(request.getfixturevalue("http_server").url, timeout_s=5.0)
        else:
            handle = EtcdMetadata.from_url(request.getfixturevalue("etcd_proc").url, timeout_s=5.0)
        handles.append(handle)
        return handle

    yield factory
    for handle in handles:
        handle.close()


@pytest.fixture
def backend(open_backend: Factory) -> MetadataBackend:
    return open_backend()


# --- the semantics suite ---------------------------------------------------------------


def test_get_missing_returns_none(backend: MetadataBackend) -> None:
    assert backend.get(unique_key()) is None


@pytest.mark.parametrize(
    "value",
    [b"", b"\x00\xff", bytes(range(256)), b"\x00" * 17, os.urandom(1 << 20)],
    ids=["empty", "nul-ff", "all-bytes", "nuls", "1MiB-random"],
)
def test_round_trip_arbitrary_bytes(backend: MetadataBackend, value: bytes) -> None:
    key = unique_key()
    backend.put(key, value)
    assert backend.get(key) == value


def test_overwrite_replaces_value(backend: MetadataBackend) -> None:
    key = unique_key()
    backend.put(key, b"first, and longer")
    backend.put(key, b"second")
    assert backend.get(key) == b"second"


def test_delete_removes_only_that_key(backend: MetadataBackend) -> None:
    key, other = unique_key("a"), unique_key("b")
    backend.put(key, b"v")
    backend.put(other, b"w")
    backend.delete(key)
    assert backend.get(key) is None
    assert backend.get(other) == b"w"


def test_delete_missing_is_fine(backend: MetadataBackend) -> None:
    key = unique_key()
    backend.delete(key)
    backend.put(key, b"v")
    backend.delete(key)
    backend.delete(key)
    assert backend.get(key) is None


@pytest.mark.parametrize(
    "suffix",
    ["a/b/c", "/leading//double/", "日本語/キー", "emoji-\U0001f319", "query?&=#%20+ chars", "x" * 200],
)
def test_keys_with_slashes_unicode_and_url_syntax(backend: MetadataBackend, suffix: str) -> None:
    key = unique_key(suffix)
    backend.put(key, suffix.encode())
    assert backend.get(key) == suffix.encode()
    assert backend.get(key + "/") is None
    backend.delete(key)
    assert backend.get(key) is None


def test_key_at_the_byte_limit_works(backend: MetadataBackend) -> None:
    key = unique_key()
    key += "é" * ((MAX_KEY_BYTES - len(key.encode())) // 2)
    key += "k" * (MAX_KEY_BYTES - len(key.encode()))
    assert len(key.encode()) == MAX_KEY_BYTES
    backend.put(key, b"v")
    assert backend.get(key) == b"v"


def test_invalid_keys_and_values_are_config_errors(backend: MetadataBackend) -> None:
    with pytest.raises(ConfigError, match="non-empty"):
        backend.get("")
    with pytest.raises(ConfigError, match="limit is 1024"):
        backend.put("k" * (MAX_KEY_BYTES + 1), b"v")
    with pytest.raises(ConfigError, match="limit is"):
        backend.put(unique_key(), bytes(MAX_VALUE_BYTES + 1))


def test_handles_on_the_same_store_see_each_other(open_backend: Factory) -> None:
    first, second = open_backend(), open_backend()
    key = unique_key()
    first.put(key, b"published")
    assert second.get(key) == b"published"
    second.delete(key)
    assert first.get(key) is None


def test_closed_handle_raises_closed_error(open_backend: Factory) -> None:
    closed, other = open_backend(), open_backend()
    key = unique_key()
    closed.put(key, b"v")
    closed.close()
    closed.close()  # idempotent
    calls: list[Callable[[], object]] = [
        lambda: closed.get(key),
        lambda: closed.put(key, b"w"),
        lambda: closed.delete(key),
    ]
    for call in calls:
        with pytest.raises(ClosedError):
            call()
    assert other.get(key) == b"v", "closing one handle must not affect the store"


# --- memory ----------------------------------------------------------------------------


def test_memory_private_and_named_stores() -> None:
    name = f"test-{uuid.uuid4().hex}"
    private, named = MemoryMetadata(), MemoryMetadata.named(name)
    private.put("k", b"private")
    assert named.get("k") is None
    named.put("k", b"shared")
    assert MemoryMetadata.named(name).keys() == ["k"]
    MemoryMetadata.discard_named(name)
    assert MemoryMetadata.named(name).get("k") is None
    assert named.get("k") == b"shared", "a discarded store lives on for its open handles"


def test_memory_put_copies_mutable_buffers() -> None:
    store, buf = MemoryMetadata(), bytearray(b"abc")
    store.put("k", bytes(buf))
    store.put("j", buf)  # type: ignore[arg-type]  # bytearray is accepted at runtime
    buf[0] = ord("X")
    assert store.get("j") == b"abc"


# --- HTTP ------------------------------------------------------------------------------


def test_http_protocol_on_the_wire(http_server: ServerHandle) -> None:
    key = unique_key("wire ?&")
    with httpx.Client(trust_env=False, timeout=5.0) as raw:
        assert raw.get(http_server.url, params={"key": key}).status_code == 404
        assert raw.put(http_server.url, params={"key": key}, content=b"\x00\xff").status_code == 200
        response = raw.get(http_server.url, params={"key": key})
        assert (response.status_code, response.content) == (200, b"\x00\xff")
        assert raw.delete(http_server.url, params={"key": key}).status_code == 200
        assert raw.delete(http_server.url, params={"key": key}).status_code == 404
        health = raw.get(f"http://127.0.0.1:{http_server.port}/health")
        assert (health.status_code, health.json()) == (200, {"status": "ok"})


@pytest.mark.parametrize("params", [{}, {"key": ""}, {"key": "k" * (MAX_KEY_BYTES + 1)}])
def test_http_server_rejects_bad_keys(http_server: ServerHandle, params: dict[str, str]) -> None:
    with httpx.Client(trust_env=False, timeout=5.0) as raw:
        for method in ("GET", "PUT", "DELETE"):
            response = raw.request(method, http_server.url, params=params, content=b"v")
            assert response.status_code == 400, (method, response.text)
            assert "key" in response.json()["detail"]


def test_http_oversized_value_is_rejected_with_clear_error() -> None:
    handle, _ = start_in_thread(max_value_bytes=1024)
    with handle, HttpMetadata(handle.url, timeout_s=5.0) as client:
        client.put("fits", bytes(1024))
        with pytest.raises(ConfigError, match=r"413 .*limit is 1024"):
            client.put("too-big", bytes(1025))
        assert client.get("too-big") is None

        def chunks() -> Iterator[bytes]:
            yield from (bytes(512) for _ in range(4))

        with httpx.Client(trust_env=False, timeout=5.0) as raw:  # chunked: no Content-Length
            response = raw.put(handle.url, params={"key": "chunked"}, content=chunks())
        assert response.status_code == 413
        assert client.get("chunked") is None


def test_http_server_trusts_content_length_before_reading(http_server: ServerHandle) -> None:
    request = f"PUT /metadata?key=huge HTTP/1.1\r\nHost: x\r\nContent-Length: {MAX_VALUE_BYTES + 1}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", http_server.port), timeout=5.0) as sock:
        sock.sendall(request.encode())  # and no body at all: the answer must not wait for it
        status_line = sock.recv(4096).split(b"\r\n", 1)[0]
    assert status_line == b"HTTP/1.1 413 Request Entity Too Large"


def test_http_server_error_is_metadata_error() -> None:
    class BrokenStore(MemoryMetadata):
        def get(self, key: str) -> bytes | None:
            raise RuntimeError("disk on fire")

    handle, _ = start_in_thread(store=BrokenStore())
    with handle, HttpMetadata(handle.url, timeout_s=5.0) as client, pytest.raises(MetadataError, match="answered 500"):
        client.get("k")


def test_http_client_nothing_listening_fails_fast() -> None:
    client = HttpMetadata(f"http://127.0.0.1:{free_port()}/metadata", timeout_s=2.0)
    started = time.monotonic()
    with pytest.raises(MetadataError) as info:
        client.get("k")
    assert time.monotonic() - started < 1.0
    assert isinstance(info.value.__cause__, httpx.ConnectError)


def test_http_client_times_out_on_silent_server() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts in the kernel, never answers
        client = HttpMetadata(f"http://127.0.0.1:{silent.getsockname()[1]}/metadata", timeout_s=0.3)
        started = time.monotonic()
        with pytest.raises(MetadataError, match="timed out"):
            client.put("k", b"v")
        assert time.monotonic() - started < 2.0


def test_regression_http_listener_lets_asyncio_disable_nagle() -> None:
    # A listener made with proto=0 (socket.create_server, or uvicorn.run(host=, port=)) hands
    # out sockets that asyncio does not set TCP_NODELAY on, and every request waited ~40 ms
    # for a delayed ACK. Both start_in_thread() and serve() bind through _listen().
    sock = _listen("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()


def test_http_stopped_server_releases_port() -> None:
    handle, port = start_in_thread()
    handle.stop()
    handle.stop()
    with pytest.raises(MetadataError), HttpMetadata(handle.url, timeout_s=1.0) as client:
        client.get("k")
    assert port == handle.port


@pytest.mark.parametrize("url", ["http://", "ftp://h:1/metadata", "http://h:notaport/metadata"])
def test_http_client_rejects_bad_urls(url: str) -> None:
    with pytest.raises(ConfigError):
        HttpMetadata(url)


# --- etcd ------------------------------------------------------------------------------


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


# --- connect_metadata ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "cls"),
    [
        ("memory://engines", MemoryMetadata),
        ("http://127.0.0.1:1/metadata", HttpMetadata),
        ("etcd://127.0.0.1:1,127.0.0.1:2", EtcdMetadata),
    ],
)
def test_connect_metadata_picks_backend_by_scheme(url: str, cls: type) -> None:
    backend = connect_metadata(MetadataConfig(url=url, timeout_s=1.0))
    assert type(backend) is cls
    assert backend is not None
    backend.close()


def test_connect_metadata_p2p_has_no_backend() -> None:
    assert connect_metadata(MetadataConfig(url="p2p")) is None
