"""Fuzzing what peers and metadata services tell a Transfer Engine about segments.

Targets:
  metadata-descriptor  segment descriptors as bytes: `decode_descriptor` gives a sound
                       descriptor (sorted, disjoint, in-range buffers; valid endpoints) or a
                       msgspec error (the contract its callers rely on), and a directory
                       reading them from a metadata backend gives it or ProtocolError.
  metadata-handshake   a fake segment server answering the p2p handshake with fuzzed bytes:
                       the directory raises SegmentNotFound / ProtocolError / PeerError only.
  metadata-clients     the HTTP and etcd backends' clients given fuzzed answers (any status,
                       any body, any ETag) to every call (compare-and-set, listing, leases
                       too): a value of the right type, None, ConfigError, MetadataError or
                       RevisionConflict, nothing else.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import socket
import threading
from collections.abc import Callable, Iterator

import httpx
import msgspec
import pytest
import requests
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.conftest import fuzz_input, fuzz_settings
from tests.fuzz.strategies import EDGE_INTS, HUGE_INTS, NOT_UTF8, mutated, values
from tsukimi.errors import ConfigError, MetadataError, PeerError, ProtocolError, RevisionConflict, SegmentNotFound
from tsukimi.transfer import wire
from tsukimi.transfer.directory import SegmentDirectory
from tsukimi.transfer.metadata import SEGMENT_PREFIX, MetadataBackend
from tsukimi.transfer.metadata.etcd import EtcdMetadata
from tsukimi.transfer.metadata.http_client import HttpMetadata
from tsukimi.transfer.metadata.memory import MemoryMetadata
from tsukimi.transfer.segment import SegmentDescriptor, decode_descriptor

NAME = "peer"
VALID_DESCRIPTOR = {
    "name": NAME,
    "host_id": "host/boot",
    "pid": 42,
    "version": 3,
    "endpoints": [{"host": "127.0.0.1", "port": 4000}, {"host": "node-1.example", "port": 4001}],
    "buffers": [
        {"base": 8192, "length": 4096, "shm_name": "tsukimi-x", "shm_offset": 0},
        {"base": 4096, "length": 4096},
    ],
}
VALID = [json.dumps(VALID_DESCRIPTOR).encode(), msgspec.json.encode({**VALID_DESCRIPTOR, "buffers": []})]
SPECIAL = (b"[" * 100_000 + b"]" * 100_000, b'{"name": "' + b"x" * 1_000_000 + b'"}', b"", b"null")  # deep, huge


@st.composite
def field_damage(draw: st.DrawFn) -> bytes:
    """The valid descriptor with some fields replaced by values of any type or range."""
    desc = json.loads(VALID[0])
    endpoint = desc["endpoints"][0]
    buffer = desc["buffers"][0]
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from([desc, endpoint, buffer]))
        field = draw(st.sampled_from(sorted(where)))
        where[field] = draw(
            st.one_of(
                values(6),
                st.sampled_from(EDGE_INTS + HUGE_INTS),
                st.sampled_from(["", "x" * 300, "a..b", "-" * 64, "::1", "é", "\x00", "1.2.3.4.5"]),
            )
        )
    if draw(st.booleans()) and isinstance(desc["buffers"], list):
        edge = st.sampled_from(EDGE_INTS + HUGE_INTS)
        desc["buffers"].append(draw(st.fixed_dictionaries({"base": edge, "length": edge})))
    return msgspec.json.encode(desc)


@st.composite
def not_utf8_inside(draw: st.DrawFn) -> bytes:
    """A valid descriptor whose `name` (or another string) holds bytes that are not UTF-8."""
    field = draw(st.sampled_from(["name", "host_id", "shm_name", "host"]))
    raw = VALID[0]
    marker = {"name": b'"peer"', "host_id": b'"host/boot"', "shm_name": b'"tsukimi-x"', "host": b'"127.0.0.1"'}[field]
    return raw.replace(marker, b'"' + draw(st.sampled_from(NOT_UTF8)) + b'"', 1)


def descriptor_payloads() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=64),
        mutated(VALID),
        field_damage(),
        not_utf8_inside(),
        st.builds(msgspec.json.encode, values()),
        st.sampled_from(range(len(SPECIAL))).map(SPECIAL.__getitem__),
    )


def check_sound(desc: SegmentDescriptor) -> None:
    assert all(0 < e.port < 65536 and e.host for e in desc.endpoints)
    for a, b in itertools.pairwise(desc.buffers):
        assert a.base + a.length <= b.base
    assert all(b.base >= 0 and b.length > 0 and b.base + b.length < 1 << 64 for b in desc.buffers)


@given(descriptor_payloads())
@fuzz_settings()
def test_descriptor_decoding_is_sound_or_a_clean_error(raw: bytes) -> None:
    with fuzz_input("metadata-descriptor"):
        with contextlib.suppress(msgspec.DecodeError):  # ValidationError too: what every caller catches
            check_sound(decode_descriptor(raw))
        backend = MemoryMetadata()
        backend.put(SEGMENT_PREFIX + NAME, raw)
        directory = SegmentDirectory(backend, lambda: b"", 1.0)
        try:
            desc = directory.fetch(NAME)
        except ProtocolError:
            pass
        else:
            assert desc.name == NAME
            check_sound(desc)


@pytest.mark.parametrize("bad", NOT_UTF8)
def test_regression_descriptor_strings_that_are_not_utf8_are_decode_errors(bad: bytes) -> None:
    """msgspec raised UnicodeDecodeError itself, which no caller catches: it escaped
    `SegmentDirectory.fetch` and killed the segment server's thread on a handshake."""
    with pytest.raises(msgspec.DecodeError):
        decode_descriptor(VALID[0].replace(b'"peer"', b'"' + bad + b'"'))
    backend = MemoryMetadata()
    backend.put(SEGMENT_PREFIX + NAME, VALID[0].replace(b'"peer"', b'"' + bad + b'"'))
    with pytest.raises(ProtocolError):
        SegmentDirectory(backend, lambda: b"", 1.0).fetch(NAME)


# -- the p2p handshake, answered by a fake segment server ------------------------------------


def _greeting() -> bytes:
    """What a segment server sends first, when this tree has the cluster-secret handshake."""
    try:
        from tsukimi import auth
    except ImportError:
        return b""
    return auth.encode_greeting(False, bytes(auth.NONCE_BYTES))


GREETING = _greeting()


class FakeSegmentServer:
    """Greets each connection, answers its first 24 bytes with `self.answer`, then closes."""

    def __init__(self) -> None:
        self.answer = b""
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(5.0)
                    conn.sendall(GREETING)
                    conn.recv(wire.REQUEST.size)
                    conn.sendall(self.answer)
                except OSError:
                    pass

    def close(self) -> None:
        self._listener.close()


@pytest.fixture(scope="module")
def fake_segment_server() -> Iterator[FakeSegmentServer]:
    server = FakeSegmentServer()
    yield server
    server.close()


@st.composite
def handshake_answers(draw: st.DrawFn) -> bytes:
    body = draw(descriptor_payloads())
    status = draw(st.sampled_from([0, 0, 0, 1, 2, 3, 4, 255]))
    magic = draw(st.sampled_from([wire.MAGIC] * 6 + [0, 0xFFFF]))
    length = draw(st.sampled_from([len(body)] * 6 + [0, len(body) + 1, wire.MAX_DESCRIPTOR_BYTES + 1, 2**64 - 1]))
    answer = wire.RESPONSE.pack(magic, status, 0, 0, length) + body
    return draw(st.one_of(st.just(answer), mutated([answer]), st.binary(max_size=40)))


@given(handshake_answers())
@fuzz_settings()
def test_p2p_handshake_answers_raise_clean_errors(
    fake_segment_server: FakeSegmentServer, thread_crashes: list[object], answer: bytes
) -> None:
    fake_segment_server.answer = answer
    name = f"127.0.0.1:{fake_segment_server.port}"
    with fuzz_input("metadata-handshake"):
        try:
            desc = SegmentDirectory(None, lambda: b"", 1.0).fetch(name)
        except (SegmentNotFound, ProtocolError, PeerError):
            pass
        else:
            assert desc.name == name
            check_sound(desc)
        assert not thread_crashes


# -- the HTTP and etcd clients, given any answer -----------------------------------------------


HttpAnswer = tuple[int, bytes, str | None]  # status, body, ETag


@st.composite
def http_answers(draw: st.DrawFn) -> HttpAnswer:
    status = draw(st.sampled_from([200, 201, 204, 400, 404, 412, 413, 422, 500, 502, 503, 302, 418]))
    body = draw(
        st.one_of(
            st.binary(max_size=32),
            st.builds(msgspec.json.encode, values()),
            st.builds(msgspec.msgpack.encode, values()),
            st.sampled_from([b'{"detail": 3}', b'{"detail": null}', b"[]", b"\xff\xfe"]),
        )
    )
    etag = draw(st.sampled_from([None, '"7"', '"0"', "7", '"-1"', '"' + "9" * 30 + '"', '"\u0661"', ""]))
    return status, body, etag


def etcd_bodies() -> st.SearchStrategy[bytes]:
    good = {"kvs": [{"key": base64.b64encode(b"k").decode(), "value": base64.b64encode(b"v").decode()}]}
    weird_kvs = st.one_of(values(6), st.lists(st.dictionaries(st.sampled_from(["key", "value"]), values(4))))
    header = st.one_of(st.fixed_dictionaries({"revision": st.one_of(values(2), st.just("12"))}), values(3))
    shaped = st.fixed_dictionaries(
        {},
        optional={  # the txn, lease grant and keepalive answers
            "header": header,
            "succeeded": values(2),
            "ID": values(2),
            "TTL": values(2),
            "more": values(2),
            "result": st.one_of(values(3), st.fixed_dictionaries({}, optional={"TTL": values(2)})),
        },
    )
    return st.one_of(
        st.binary(max_size=32),
        st.builds(msgspec.json.encode, values()),
        st.builds(lambda kvs: msgspec.json.encode({"kvs": kvs}), weird_kvs),
        st.builds(msgspec.json.encode, shaped),
        mutated([json.dumps(good).encode()]),
    )


class _Adapter(requests.adapters.BaseAdapter):
    """A requests transport that answers every call with `status` and `body`."""

    def __init__(self) -> None:
        super().__init__()
        self.status, self.body = 200, b""

    def send(self, request: requests.PreparedRequest, **kwargs: object) -> requests.Response:
        response = requests.Response()
        response.status_code, response._content, response.request = self.status, self.body, request
        response.url, response.reason = str(request.url), "fuzz"
        return response

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def fuzzed_clients() -> Iterator[tuple[HttpMetadata, EtcdMetadata, list[HttpAnswer], _Adapter]]:
    """An HTTP and an etcd backend whose every call gets the answer the test sets."""
    http_answer: list[HttpAnswer] = [(200, b"", None)]

    def answer(_: httpx.Request) -> httpx.Response:
        status, body, etag = http_answer[0]
        return httpx.Response(status, content=body, headers={} if etag is None else {"etag": etag.encode()})

    http = HttpMetadata("http://127.0.0.1:9/metadata", timeout_s=1.0)
    http._client = httpx.Client(transport=httpx.MockTransport(answer))
    adapter = _Adapter()
    etcd = EtcdMetadata([("127.0.0.1", 9)], timeout_s=1.0)
    for client in etcd._etcd.clients:
        client.session.mount("http://", adapter)
    yield http, etcd, http_answer, adapter
    http.close()
    etcd.close()


@given(http_answers(), st.sampled_from([200, 200, 200, 400, 404, 408, 500, 503, 504]), etcd_bodies())
@fuzz_settings()
def test_metadata_clients_turn_any_answer_into_a_value_or_a_clean_error(
    fuzzed_clients: tuple[HttpMetadata, EtcdMetadata, list[HttpAnswer], _Adapter],
    http_answer: HttpAnswer,
    etcd_status: int,
    etcd_body: bytes,
) -> None:
    http, etcd, answer, adapter = fuzzed_clients
    answer[0] = http_answer
    adapter.status, adapter.body = etcd_status, etcd_body
    with fuzz_input("metadata-clients"):
        for backend in (http, etcd):
            for call in _client_calls(backend):
                with contextlib.suppress(ConfigError, MetadataError, RevisionConflict):
                    call()


def _client_calls(backend: MetadataBackend) -> list[Callable[[], None]]:
    """Every backend call, each checking the type of what it returns."""
    key = "tsukimi/segments/x"

    def get() -> None:
        value = backend.get(key)
        assert value is None or isinstance(value, bytes)

    def get_versioned() -> None:
        found = backend.get_versioned(key)
        assert found is None or (isinstance(found.value, bytes) and isinstance(found.revision, int))

    def compare_and_set() -> None:
        assert isinstance(backend.compare_and_set(key, b"v", 3), int)

    def list_prefix() -> None:
        found = backend.list_prefix("tsukimi/")
        assert all(isinstance(k, str) and isinstance(v.value, bytes) for k, v in found.items())

    return [
        get,
        get_versioned,
        compare_and_set,
        list_prefix,
        lambda: backend.put(key, b"v"),
        lambda: backend.delete(key),
        lambda: backend.compare_and_delete(key, 3),
        lambda: backend.put_ephemeral(key, b"v", 1.0),
    ]


@pytest.mark.parametrize("body", [b"null", b"3", b'{"kvs": "ab"}', b'{"kvs": [3]}', b'{"kvs": [{"value": 3}]}'])
def test_regression_etcd_answers_of_another_shape_are_metadata_errors(body: bytes) -> None:
    """etcd3gw indexes the JSON it gets as it comes; TypeError / AttributeError escaped
    `EtcdMetadata.get` instead of MetadataError."""
    adapter = _Adapter()
    adapter.body = body
    with EtcdMetadata([("127.0.0.1", 9)], timeout_s=1.0) as etcd:
        etcd._etcd.clients[0].session.mount("http://", adapter)
        with pytest.raises(MetadataError, match="unexpectedly"):
            etcd.get("tsukimi/segments/x")
