"""The HTTP metadata server and client beyond the semantics suite (tests/transfer/test_metadata.py):
Mooncake's wire protocol unchanged, tsukimi's ETag / If-Match / ttl_s / list additions on the
wire, bad requests, the client's error mapping, timeouts and the listener."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator

import httpx
import msgspec
import pytest

from tsukimi.errors import ConfigError, MetadataError, RevisionConflict
from tsukimi.netio import free_port
from tsukimi.transfer.metadata.base import MAX_KEY_BYTES, MAX_VALUE_BYTES, SEGMENT_PREFIX
from tsukimi.transfer.metadata.http import ServerHandle, _listen, parse_etag, start_in_thread
from tsukimi.transfer.metadata.http_client import HttpMetadata
from tsukimi.transfer.metadata.memory import MemoryMetadata

pytestmark = pytest.mark.timeout(60)


def unique_key(suffix: str = "desc") -> str:
    return f"{SEGMENT_PREFIX}{uuid.uuid4().hex}/{suffix}"


@pytest.fixture
def raw() -> Iterator[httpx.Client]:
    with httpx.Client(trust_env=False, timeout=5.0) as client:
        yield client


def test_http_protocol_on_the_wire(http_server: ServerHandle, raw: httpx.Client) -> None:
    """Mooncake's GET/PUT/DELETE /metadata?key=K, as its own clients use it."""
    key = unique_key("wire ?&")
    missing = raw.get(http_server.url, params={"key": key})
    assert (missing.status_code, missing.content) == (404, b"metadata not found")
    put = raw.put(http_server.url, params={"key": key}, content=b"\x00\xff")
    assert (put.status_code, put.content) == (200, b"metadata updated")
    response = raw.get(http_server.url, params={"key": key})
    assert (response.status_code, response.content) == (200, b"\x00\xff")
    assert response.headers["content-type"] == "application/octet-stream"
    deleted = raw.delete(http_server.url, params={"key": key})
    assert (deleted.status_code, deleted.content) == (200, b"metadata deleted")
    assert raw.delete(http_server.url, params={"key": key}).status_code == 404
    health = raw.get(f"http://127.0.0.1:{http_server.port}/health")
    assert (health.status_code, health.json()) == (200, {"status": "ok"})


def test_etags_and_conditional_requests_on_the_wire(http_server: ServerHandle, raw: httpx.Client) -> None:
    url, params = http_server.url, {"key": unique_key()}
    created = raw.put(url, params=params, content=b"v1", headers={"If-None-Match": "*"})
    assert created.status_code == 200
    first = created.headers["etag"]
    assert parse_etag(first) is not None and raw.get(url, params=params).headers["etag"] == first
    again = raw.put(url, params=params, content=b"v2", headers={"If-None-Match": "*"})
    assert again.status_code == 412 and "revision" in again.json()["detail"]
    updated = raw.put(url, params=params, content=b"v2", headers={"If-Match": first})
    assert updated.status_code == 200 and updated.headers["etag"] != first
    stale = raw.put(url, params=params, content=b"lost", headers={"If-Match": first})
    assert stale.status_code == 412 and stale.headers["content-type"] == "application/json"
    assert raw.delete(url, params=params, headers={"If-Match": first}).status_code == 412
    assert raw.get(url, params=params).content == b"v2"
    plain = raw.put(url, params=params, content=b"v3")  # a plain PUT has an ETag too
    assert raw.get(url, params=params).headers["etag"] == plain.headers["etag"]
    assert raw.delete(url, params=params, headers={"If-Match": plain.headers["etag"]}).status_code == 200
    assert raw.delete(url, params=params, headers={"If-Match": plain.headers["etag"]}).status_code == 412


def test_ephemeral_put_and_listing_on_the_wire(http_server: ServerHandle, raw: httpx.Client) -> None:
    base = unique_key("list")
    put = raw.put(http_server.url, params={"key": base + "/e", "ttl_s": "0.3"}, content=b"\x00e")
    assert put.status_code == 200 and parse_etag(put.headers["etag"]) is not None
    raw.put(http_server.url, params={"key": base + "/p"}, content=b"\xffp")
    listing = raw.get(http_server.url + "/list", params={"prefix": base + "/"})
    assert listing.headers["content-type"] == "application/msgpack"
    entries = msgspec.msgpack.decode(listing.content)
    assert {key: value for key, (value, _) in entries.items()} == {base + "/e": b"\x00e", base + "/p": b"\xffp"}
    assert f'"{entries[base + "/e"][1]}"' == put.headers["etag"]
    time.sleep(0.4)
    assert msgspec.msgpack.decode(raw.get(http_server.url + "/list", params={"prefix": base + "/"}).content).keys() == {
        base + "/p"
    }


@pytest.mark.parametrize(
    ("method", "params", "headers", "message"),
    [
        ("PUT", {}, {"If-Match": "17"}, "If-Match"),
        ("PUT", {}, {"If-Match": 'W/"17"'}, "If-Match"),
        ("PUT", {}, {"If-Match": '"0"'}, "If-Match"),
        ("PUT", {}, {"If-Match": '"-1"'}, "If-Match"),
        ("PUT", {}, {"If-Match": '"1", "2"'}, "If-Match"),
        ("PUT", {}, {"If-Match": "*"}, "If-Match"),
        ("PUT", {}, {"If-Match": '"99999999999999999999"'}, "If-Match"),
        ("PUT", {}, {"If-None-Match": '"3"'}, "If-None-Match"),
        ("PUT", {}, {"If-Match": '"3"', "If-None-Match": "*"}, "at most one"),
        ("PUT", {"ttl_s": "5"}, {"If-None-Match": "*"}, "ephemeral"),
        ("DELETE", {}, {"If-None-Match": "*"}, "DELETE"),
        ("DELETE", {}, {"If-Match": "x"}, "If-Match"),
        *(("PUT", {"ttl_s": ttl}, {}, "ttl_s") for ttl in ["0", "-1", "abc", "nan", "inf", "1e9", "", "0.01"]),
    ],
)
def test_bad_conditions_and_ttls_get_400(
    http_server: ServerHandle,
    raw: httpx.Client,
    method: str,
    params: dict[str, str],
    headers: dict[str, str],
    message: str,
) -> None:
    key = unique_key()
    raw.put(http_server.url, params={"key": key}, content=b"original")
    response = raw.request(method, http_server.url, params={"key": key, **params}, headers=headers, content=b"new")
    assert response.status_code == 400, response.text
    assert message in response.json()["detail"]
    assert raw.get(http_server.url, params={"key": key}).content == b"original"


@pytest.mark.parametrize(
    ("params", "message"),
    [({}, "'prefix' is required"), ({"prefix": ""}, "non-empty"), ({"prefix": "p" * (MAX_KEY_BYTES + 1)}, "limit is")],
)
def test_bad_list_prefixes_get_400(
    http_server: ServerHandle, raw: httpx.Client, params: dict[str, str], message: str
) -> None:
    response = raw.get(http_server.url + "/list", params=params)
    assert response.status_code == 400 and message in response.json()["detail"]


@pytest.mark.parametrize("params", [{}, {"key": ""}, {"key": "k" * (MAX_KEY_BYTES + 1)}])
def test_http_server_rejects_bad_keys(http_server: ServerHandle, params: dict[str, str]) -> None:
    with httpx.Client(trust_env=False, timeout=5.0) as raw:
        for method in ("GET", "PUT", "DELETE"):
            response = raw.request(method, http_server.url, params=params, content=b"v")
            assert response.status_code == 400, (method, response.text)
            assert "key" in response.json()["detail"]


def test_client_maps_statuses_to_errors() -> None:
    answers = {"/metadata": (412, b'{"detail": "lost"}'), "/metadata/list": (500, b"boom")}

    def answer(request: httpx.Request) -> httpx.Response:
        status, body = answers[request.url.path]
        return httpx.Response(status, content=body)

    with HttpMetadata("http://127.0.0.1:9/metadata", timeout_s=1.0) as client:
        client._client = httpx.Client(transport=httpx.MockTransport(answer))
        with pytest.raises(RevisionConflict, match=r"412 .*lost"):
            client.compare_and_set("k", b"v", 3)
        with pytest.raises(MetadataError, match="answered 500"):
            client.list_prefix("k")
        answers["/metadata"] = (200, b"a Mooncake server: no ETag")
        with pytest.raises(MetadataError, match="no revision"):
            client.get_versioned("k")
        answers["/metadata/list"] = (200, b"\xc1 not msgpack")
        with pytest.raises(MetadataError, match="malformed listing"):
            client.list_prefix("k")


def test_a_failing_backend_is_metadata_error() -> None:
    class BrokenStore(MemoryMetadata):
        def list_prefix(self, prefix: str) -> dict[str, object]:  # type: ignore[override]
            raise MetadataError("too many keys")

    handle, _ = start_in_thread(store=BrokenStore())
    with handle, HttpMetadata(handle.url, timeout_s=5.0) as client:
        with pytest.raises(MetadataError, match=r"answered 500 .*too many keys"):
            client.list_prefix("k")
        client.put("k", b"still serving")
        assert client.get("k") == b"still serving"


def test_http_server_error_is_metadata_error() -> None:
    class BrokenStore(MemoryMetadata):
        def get_versioned(self, key: str) -> None:
            raise RuntimeError("disk on fire")

    handle, _ = start_in_thread(store=BrokenStore())
    with handle, HttpMetadata(handle.url, timeout_s=5.0) as client, pytest.raises(MetadataError, match="answered 500"):
        client.get("k")


def test_http_oversized_value_is_rejected_with_clear_error() -> None:
    handle, _ = start_in_thread(max_value_bytes=1024)
    with handle, HttpMetadata(handle.url, timeout_s=5.0) as client:
        client.put("fits", bytes(1024))
        with pytest.raises(ConfigError, match=r"413 .*limit is 1024"):
            client.put("too-big", bytes(1025))
        with pytest.raises(ConfigError, match=r"413 .*limit is 1024"):
            client.compare_and_set("too-big", bytes(1025), 0)
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
        for call in (lambda: client.put("k", b"v"), lambda: client.list_prefix("k")):
            started = time.monotonic()
            with pytest.raises(MetadataError, match="timed out"):
                call()
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
