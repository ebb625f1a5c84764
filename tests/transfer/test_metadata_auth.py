"""The HTTP metadata server with the cluster secret: the client signs every request; unsigned,
badly signed, stale and replayed requests get 401 with the reason and touch nothing."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tsukimi import auth, httpd
from tsukimi.config import Config, MetadataConfig
from tsukimi.errors import AuthError
from tsukimi.testing.engine_pairs import secret_file
from tsukimi.transfer import TransferEngine
from tsukimi.transfer.metadata.base import Versioned
from tsukimi.transfer.metadata.http import ServerHandle, start_in_thread
from tsukimi.transfer.metadata.http_client import HttpMetadata
from tsukimi.transfer.metadata.memory import MemoryMetadata

SECRET = b"metadata-cluster-secret-0123456789"
OTHER = b"some-other-secret-0123456789abcdef"


@pytest.fixture
def store() -> MemoryMetadata:
    return MemoryMetadata()


@pytest.fixture
def server(store: MemoryMetadata) -> Iterator[ServerHandle]:
    handle, _ = start_in_thread(store=store, secret=SECRET)
    try:
        yield handle
    finally:
        handle.stop()


def test_a_signing_client_works(server: ServerHandle, store: MemoryMetadata) -> None:
    with HttpMetadata(server.url, secret=SECRET) as client:
        client.put("a/b c", b"value")
        assert client.get("a/b c") == b"value"
        assert store.get("a/b c") == b"value"
        client.delete("a/b c")
        assert client.get("a/b c") is None
        revision = client.compare_and_set("a/b c", b"v1", 0)
        revision = client.compare_and_set("a/b c", b"v2", revision)
        assert client.get_versioned("a/b c") == store.get_versioned("a/b c") == Versioned(b"v2", revision)
        client.put_ephemeral("a/e", b"e", 30.0)
        assert client.list_prefix("a/") == store.list_prefix("a/")
        client.compare_and_delete("a/b c", revision)
    assert store.keys() == [], "close() withdrew the ephemeral key"


@pytest.mark.parametrize("secret", [None, OTHER], ids=["unsigned", "wrong"])
def test_a_client_without_the_secret_gets_auth_error_and_touches_nothing(
    server: ServerHandle, store: MemoryMetadata, secret: bytes | None
) -> None:
    store.put("k", b"original")
    revision = store.get_versioned("k").revision  # type: ignore[union-attr]
    with HttpMetadata(server.url, secret=secret) as client:
        calls: list[Callable[[], object]] = [
            lambda: client.put("k", b"forged"),
            lambda: client.get("k"),
            lambda: client.delete("k"),
            lambda: client.get_versioned("k"),
            lambda: client.compare_and_set("k", b"forged", revision),
            lambda: client.compare_and_set("new", b"forged", 0),
            lambda: client.compare_and_delete("k", revision),
            lambda: client.list_prefix("k"),
            lambda: client.put_ephemeral("k", b"forged", 5.0),
        ]
        for call in calls:
            with pytest.raises(AuthError, match="401"):
                call()
    assert store.get_versioned("k") == Versioned(b"original", revision)
    assert store.keys() == ["k"]


def _send(server: ServerHandle, headers: dict[str, str], body: bytes = b"v") -> httpx.Response:
    url = f"{server.url}?key=k"
    return httpx.put(url, content=body, headers=headers, trust_env=False)


def _signed(body: bytes = b"v", now: float | None = None, secret: bytes = SECRET) -> dict[str, str]:
    return auth.sign_headers(secret, "PUT", "/metadata?key=k", body, now=now)


def test_unsigned_replayed_stale_and_altered_requests_get_401(server: ServerHandle, store: MemoryMetadata) -> None:
    unsigned = _send(server, {})
    assert unsigned.status_code == 401 and "cluster secret is required" in unsigned.json()["detail"]
    headers = _signed()
    assert _send(server, headers).status_code == 200
    replayed = _send(server, headers)
    assert replayed.status_code == 401 and "replayed" in replayed.json()["detail"]
    stale = _send(server, _signed(now=time.time() - 60))
    assert stale.status_code == 401 and "clock" in stale.json()["detail"]
    altered = _send(server, _signed(b"v"), body=b"forged")
    assert altered.status_code == 401 and "signature" in altered.json()["detail"]
    wrong = _send(server, _signed(secret=OTHER), body=b"v")
    assert wrong.status_code == 401
    assert store.get("k") == b"v"  # only the one good request landed


def _send_signed(
    server: ServerHandle, signed: tuple[str, dict[str, str]], sent: tuple[str, dict[str, str]]
) -> httpx.Response:
    """PUT `b"v"`, signed as if to `signed` (query, condition headers), sent to `sent`."""
    (signed_query, signed_conditions), (sent_query, sent_conditions) = signed, sent
    target = httpd.signed_target(
        f"/metadata?{signed_query}",
        lambda name: [signed_conditions[name]] if name in signed_conditions else [],
    )
    headers = {**auth.sign_headers(SECRET, "PUT", target, b"v"), **sent_conditions}
    return httpx.put(f"{server.url}?{sent_query}", content=b"v", headers=headers, trust_env=False)


@pytest.mark.parametrize(
    ("signed", "sent"),
    [
        (("key=k", {"if-match": '"1"'}), ("key=k", {})),  # stripped: the CAS would become a blind write
        (("key=k", {"if-match": '"1"'}), ("key=k", {"if-match": '"2"'})),
        (("key=k", {"if-none-match": "*"}), ("key=k", {"if-match": '"1"'})),
        (("key=k", {}), ("key=k", {"if-match": '"1"'})),
        (("key=k&ttl_s=5", {}), ("key=k&ttl_s=3600", {})),
        (("key=k&ttl_s=5", {}), ("key=k", {})),
    ],
)
def test_conditions_and_ttls_cannot_be_altered(
    server: ServerHandle, store: MemoryMetadata, signed: tuple[str, dict[str, str]], sent: tuple[str, dict[str, str]]
) -> None:
    store.put("k", b"original")
    assert _send_signed(server, signed, signed).status_code in (200, 412)  # the signature itself is good
    store.put("k", b"original")
    response = _send_signed(server, signed, sent)
    assert response.status_code == 401 and "signature" in response.json()["detail"]
    assert store.get("k") == b"original"


def test_health_stays_open(server: ServerHandle) -> None:
    assert httpx.get(f"{server.base_url}/health", trust_env=False).status_code == 200


def test_engines_publish_and_find_each_other_through_a_signed_server(server: ServerHandle, tmp_path: Path) -> None:
    security = secret_file(tmp_path, SECRET)
    config = Config(metadata=MetadataConfig(url=server.url), security=security)
    with TransferEngine(f"a-{uuid.uuid4().hex}", config) as first, TransferEngine("b-" + uuid.uuid4().hex, config) as b:
        buf = first.allocate(4096)
        b.write(b.open_segment(first.name), buf.base, b"signed")
        assert bytes(buf.view[:6]) == b"signed"
    with pytest.raises(AuthError):  # an engine without the secret cannot even publish itself
        TransferEngine("intruder", Config(metadata=MetadataConfig(url=server.url)))
