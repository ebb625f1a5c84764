"""One semantics suite for every metadata backend (memory, HTTP, etcd), then the memory backend's
specifics and connect_metadata (HTTP: test_metadata_http.py; etcd: test_metadata_etcd.py)."""

from __future__ import annotations

import concurrent.futures
import os
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tsukimi.config import MetadataConfig
from tsukimi.errors import ClosedError, ConfigError, RevisionConflict
from tsukimi.transfer.metadata import (
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    SEGMENT_PREFIX,
    MetadataBackend,
    connect_metadata,
)
from tsukimi.transfer.metadata.base import Versioned
from tsukimi.transfer.metadata.etcd import EtcdMetadata
from tsukimi.transfer.metadata.http_client import HttpMetadata
from tsukimi.transfer.metadata.memory import MemoryMetadata

pytestmark = pytest.mark.timeout(60)

Factory = Callable[[], MetadataBackend]


def unique_key(suffix: str = "desc") -> str:
    return f"{SEGMENT_PREFIX}{uuid.uuid4().hex}/{suffix}"


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
        lambda: closed.get_versioned(key),
        lambda: closed.compare_and_set(key, b"w", 0),
        lambda: closed.compare_and_delete(key, 1),
        lambda: closed.list_prefix(key),
        lambda: closed.put_ephemeral(key, b"w", 1.0),
    ]
    for call in calls:
        with pytest.raises(ClosedError):
            call()
    assert other.get(key) == b"v", "closing one handle must not affect the store"


# --- revisions, compare-and-set, listing, ephemeral keys ------------------------------------

# (ttl_s asked, longest it may live): etcd rounds the TTL up to whole seconds and raises it
# to its minimum lease (2 s with its default election timeout), checked every 0.5 s.
EPHEMERAL = {"memory": (0.2, 0.2), "http": (0.3, 0.3), "etcd": (1.0, 2.6)}


@pytest.fixture
def kind(request: pytest.FixtureRequest) -> str:
    """Which backend `open_backend` opens in this test."""
    return str(request.node.callspec.params["open_backend"])


def wait_until_gone(backend: MetadataBackend, key: str, within_s: float) -> float:
    """Seconds until `key` vanished; fails the test after `within_s` (+ a margin)."""
    started = time.monotonic()
    while backend.get(key) is not None:
        assert time.monotonic() - started < within_s + 1.0, f"{key!r} outlived its TTL"
        time.sleep(0.05)
    return time.monotonic() - started


def test_get_versioned_has_a_new_revision_after_every_write(backend: MetadataBackend) -> None:
    key = unique_key()
    assert backend.get_versioned(key) is None
    backend.put(key, b"one")
    first = backend.get_versioned(key)
    assert first is not None and first.value == b"one" and first.revision > 0
    backend.put(key, b"one")
    second = backend.get_versioned(key)
    assert second is not None and second.value == b"one" and second.revision not in (0, first.revision)


def test_compare_and_set_zero_creates_only_if_absent(backend: MetadataBackend) -> None:
    key = unique_key()
    revision = backend.compare_and_set(key, b"mine", 0)
    assert backend.get_versioned(key) == Versioned(b"mine", revision)
    with pytest.raises(RevisionConflict):
        backend.compare_and_set(key, b"theirs", 0)
    assert backend.get_versioned(key) == Versioned(b"mine", revision)


def test_compare_and_set_wins_once_per_revision(backend: MetadataBackend) -> None:
    key = unique_key()
    backend.put(key, b"v0")
    start = backend.get_versioned(key)
    assert start is not None
    revision = backend.compare_and_set(key, b"v1", start.revision)
    assert revision != start.revision
    assert backend.get_versioned(key) == Versioned(b"v1", revision)
    with pytest.raises(RevisionConflict):  # a second writer that read v0 loses, writes nothing
        backend.compare_and_set(key, b"v1-lost", start.revision)
    assert backend.get_versioned(key) == Versioned(b"v1", revision)
    with pytest.raises(RevisionConflict):  # a revision on a key that does not exist
        backend.compare_and_set(unique_key(), b"v", revision)


def test_compare_and_delete(backend: MetadataBackend) -> None:
    key = unique_key()
    revision = backend.compare_and_set(key, b"v", 0)
    backend.put(key, b"w")
    with pytest.raises(RevisionConflict):
        backend.compare_and_delete(key, revision)
    current = backend.get_versioned(key)
    assert current is not None and current.value == b"w"
    backend.compare_and_delete(key, current.revision)
    assert backend.get(key) is None
    with pytest.raises(RevisionConflict):  # a missing key: someone else removed it
        backend.compare_and_delete(key, current.revision)


def test_list_prefix_lists_exactly_the_keys_under_it(backend: MetadataBackend) -> None:
    base = unique_key("holders")
    inside = [f"{base}/a", f"{base}/b/c", f"{base}/日本"]
    for key in [*inside, base, f"{base}x", base[:-1]]:
        backend.put(key, key.encode() + b"\x00\xff")
    listing = backend.list_prefix(base + "/")
    assert sorted(listing) == sorted(inside)
    for key in inside:
        assert listing[key] == backend.get_versioned(key)
    assert backend.list_prefix(unique_key("nothing-here")) == {}
    assert set(backend.list_prefix(base)) == {*inside, base, f"{base}x"}


def test_ephemeral_keys_expire_unless_a_write_ended_their_ephemerality(backend: MetadataBackend, kind: str) -> None:
    ttl_s, lifetime_s = EPHEMERAL[kind]
    base = unique_key("ephemeral")
    gone, put, deleted, swapped = (f"{base}/{name}" for name in ("gone", "put", "deleted", "swapped"))
    for key in (gone, put, deleted, swapped):
        backend.put_ephemeral(key, b"alive", ttl_s)
    assert backend.get(gone) == b"alive"
    assert set(backend.list_prefix(base + "/")) == {gone, put, deleted, swapped}
    backend.put(put, b"kept")
    backend.delete(deleted)
    backend.put(deleted, b"kept")
    current = backend.get_versioned(swapped)
    assert current is not None
    backend.compare_and_set(swapped, b"kept", current.revision)
    wait_until_gone(backend, gone, lifetime_s)
    time.sleep(0.6 if kind == "etcd" else 0.2)  # the others became ephemeral just after `gone`
    assert backend.list_prefix(base + "/").keys() == {put, deleted, swapped}
    assert {backend.get(key) for key in (put, deleted, swapped)} == {b"kept"}


def test_refreshing_an_ephemeral_key_keeps_it_and_may_change_it(backend: MetadataBackend, kind: str) -> None:
    ttl_s, lifetime_s = EPHEMERAL[kind]
    key = unique_key()
    backend.put_ephemeral(key, b"v0", ttl_s)
    started = time.monotonic()
    for step in range(1, 4):
        time.sleep(lifetime_s / 2)
        assert backend.get(key) == f"v{step - 1}".encode(), f"expired {time.monotonic() - started:.2f} s in"
        backend.put_ephemeral(key, f"v{step}".encode(), ttl_s)
    assert time.monotonic() - started > lifetime_s  # it outlived one TTL: the refreshes kept it
    assert backend.get(key) == b"v3"


def test_close_withdraws_the_handles_ephemeral_keys(open_backend: Factory, kind: str) -> None:
    """etcd revokes the handle's leases and the HTTP client deletes what it still owns (If-Match
    of its last write); memory leaves them to their TTL, like a holder that died."""
    holder, other = open_backend(), open_backend()
    mine, rewritten = unique_key("mine"), unique_key("rewritten")
    holder.put_ephemeral(mine, b"holder", 30.0)
    holder.put_ephemeral(rewritten, b"holder", 30.0)
    other.put(rewritten, b"other")
    holder.close()
    assert other.get(mine) == (b"holder" if kind == "memory" else None)
    assert other.get(rewritten) == b"other"


def test_concurrent_increments_lose_no_update(open_backend: Factory) -> None:
    """Eight handles on eight threads add one to a counter, read + compare-and-set until
    their write wins: each revision has exactly one winner, so no increment is lost."""
    key, num_threads, num_increments = unique_key("counter"), 8, 5
    open_backend().put(key, b"0")
    handles = [open_backend() for _ in range(num_threads)]
    won: list[int] = []

    def increment(handle: MetadataBackend) -> None:
        for _ in range(num_increments):
            while True:
                current = handle.get_versioned(key)
                assert current is not None
                try:
                    handle.compare_and_set(key, str(int(current.value) + 1).encode(), current.revision)
                except RevisionConflict:
                    continue
                won.append(current.revision)
                break

    with concurrent.futures.ThreadPoolExecutor(num_threads) as pool:
        list(pool.map(increment, handles))
    assert handles[0].get(key) == str(num_threads * num_increments).encode()
    assert len(won) == len(set(won)) == num_threads * num_increments


_KEYS = ("a", "b", "c")
_ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "delete", "cas", "cad"]),
        st.sampled_from(_KEYS),
        st.sampled_from(["current", "stale", "zero"]),
        st.binary(max_size=8),
    ),
    max_size=12,
)


@given(ops=_ops)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_writes_agree_with_a_model(backend: MetadataBackend, ops: list[tuple[str, str, str, bytes]]) -> None:
    """Random writes, conditional ones with the current, an old or no revision: each CAS
    succeeds exactly when its revision is the current one, and the listing always equals
    the model (values and revisions); a key never gets a revision it had before."""
    base = unique_key("model") + "/"
    model: dict[str, Versioned] = {}
    seen: dict[str, set[int]] = {key: set() for key in _KEYS}
    for op, name, which, value in ops:
        key, current = base + name, model.get(base + name)
        expected = {"current": current.revision if current else 0, "stale": max(seen[name], default=1) + 7}
        revision = expected.get(which, 0)
        if op in ("put", "cas"):
            if op == "put":
                backend.put(key, value)
                written = backend.get_versioned(key)
                assert written is not None
                new = written.revision
            elif revision == (current.revision if current else 0):
                new = backend.compare_and_set(key, value, revision)
            else:
                with pytest.raises(RevisionConflict):
                    backend.compare_and_set(key, value, revision)
                continue
            assert new not in seen[name]
            seen[name].add(new)
            model[key] = Versioned(value, new)
        elif op == "delete":
            backend.delete(key)
            model.pop(key, None)
        elif current is not None and which == "current":
            backend.compare_and_delete(key, current.revision)
            del model[key]
        else:
            with pytest.raises(RevisionConflict):
                backend.compare_and_delete(key, expected["stale"])
        assert backend.list_prefix(base) == model


@pytest.mark.parametrize("revision", [-1, True, 1.0, "1", None])
def test_bad_revisions_are_config_errors(backend: MetadataBackend, revision: object) -> None:
    key = unique_key()
    with pytest.raises(ConfigError, match="revision"):
        backend.compare_and_set(key, b"v", revision)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="revision"):
        backend.compare_and_delete(key, revision)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="revision"):
        backend.compare_and_delete(key, 0)
    assert backend.get(key) is None


@pytest.mark.parametrize("ttl_s", [0, -1.0, 0.05, True, float("nan"), float("inf"), 3601.0, "1"])
def test_bad_ttls_are_config_errors(backend: MetadataBackend, ttl_s: object) -> None:
    key = unique_key()
    with pytest.raises(ConfigError, match="ttl_s"):
        backend.put_ephemeral(key, b"v", ttl_s)  # type: ignore[arg-type]
    assert backend.get(key) is None


def test_bad_prefixes_and_values_are_config_errors(backend: MetadataBackend) -> None:
    with pytest.raises(ConfigError, match="non-empty"):
        backend.list_prefix("")
    with pytest.raises(ConfigError, match="limit is 1024"):
        backend.list_prefix("k" * (MAX_KEY_BYTES + 1))
    with pytest.raises(ConfigError, match="bytes"):
        backend.compare_and_set(unique_key(), "text", 0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="limit is"):
        backend.put_ephemeral(unique_key(), bytes(MAX_VALUE_BYTES + 1), 1.0)


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
