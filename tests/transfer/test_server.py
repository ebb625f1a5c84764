"""The segment server against raw frames: bounds checks, malformed input, fuzzing."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.transfer.fake_peer import connect_raw
from tsukimi.config import TransferConfig
from tsukimi.errors import ProtocolError
from tsukimi.transfer import wire
from tsukimi.transfer.segment import LocalSegment, decode_descriptor
from tsukimi.transfer.server import SegmentServer, ServerHooks

BASE, SIZE = 0x10000, 1 << 16


class _Memory(bytearray):
    def __repr__(self) -> str:  # keep Hypothesis' failure reports readable
        return f"<{len(self)} bytes of served memory>"


@pytest.fixture
def served() -> Iterator[tuple[SegmentServer, bytearray]]:
    memory = _Memory(bytes(range(256)) * (SIZE // 256))
    segment = LocalSegment("raw")
    segment.add(memoryview(memory), BASE, memory)
    server = SegmentServer(
        segment,
        TransferConfig(slice_bytes=1 << 20, max_slice_bytes=1 << 20, timeout_s=2.0),
        ServerHooks(lambda: b"{}", lambda _: None),
    )
    yield server, memory
    server.close()


def _connect(server: SegmentServer, handshake: bool = True) -> socket.socket:
    return connect_raw(server.endpoint, handshake)


def _ask(
    sock: socket.socket, op: wire.Op, seq: int, offset: int, length: int, payload: bytes = b""
) -> tuple[wire.ResponseHeader, bytes]:
    sock.sendall(wire.RequestHeader(op, seq, offset, length).pack() + payload)
    head = bytearray(wire.RESPONSE.size)
    wire.recv_exact(sock, memoryview(head))
    response = wire.decode_response(head)
    body = bytearray(response.length)
    wire.recv_exact(sock, memoryview(body))
    return response, bytes(body)


def test_in_bounds_read_and_write(served: tuple[SegmentServer, bytearray]) -> None:
    server, memory = served
    with _connect(server) as sock:
        head, body = _ask(sock, wire.Op.READ, 1, BASE + 10, 5)
        assert head.status is wire.Status.OK and head.seq == 1 and body == bytes([10, 11, 12, 13, 14])
        head, _ = _ask(sock, wire.Op.WRITE, 2, BASE + SIZE - 3, 3, b"end")
        assert head.status is wire.Status.OK and memory[-3:] == b"end"


@pytest.mark.parametrize(
    ("offset", "length"), [(BASE - 1, 2), (BASE + SIZE - 2, 3), (0, 1), (BASE + SIZE, 1), (BASE, 0)]
)
def test_out_of_bounds_is_refused_and_the_connection_keeps_serving(
    served: tuple[SegmentServer, bytearray], offset: int, length: int
) -> None:
    server, memory = served
    before = bytes(memory)
    with _connect(server) as sock:
        head, reason = _ask(sock, wire.Op.WRITE, 7, offset, length, b"z" * length)  # payload is drained
        assert head.status is wire.Status.OUT_OF_BOUNDS and b"not inside a registered buffer" in reason
        head, reason = _ask(sock, wire.Op.READ, 8, offset, length)
        assert head.status is wire.Status.OUT_OF_BOUNDS
        head, body = _ask(sock, wire.Op.READ, 9, BASE, 2)
        assert head.status is wire.Status.OK and body == b"\x00\x01"
    assert bytes(memory) == before


@pytest.mark.parametrize(
    "frame",
    [
        struct.pack("<HBBIQQ", 0xBEEF, 1, 0, 1, BASE, 1),  # bad magic
        struct.pack("<HBBIQQ", wire.MAGIC, 99, 0, 1, BASE, 1),  # unknown op
        struct.pack("<HBBIQQ", wire.MAGIC, 2, 0, 1, BASE, 2 << 20),  # over max_slice_bytes
        struct.pack("<HBBIQQ", wire.MAGIC, 3, 0, 1, 0, 64 << 20),  # handshake over its bound
        struct.pack("<HBBIQQ", wire.MAGIC, 1, 0, 1, (1 << 64) - 2, 5),  # offset + length overflows
    ],
)
def test_a_malformed_frame_closes_only_its_connection(served: tuple[SegmentServer, bytearray], frame: bytes) -> None:
    server, _ = served
    with _connect(server) as bystander, _connect(server) as bad:
        bad.sendall(frame)
        assert bad.recv(16) == b""  # closed by the server
        head, body = _ask(bystander, wire.Op.READ, 1, BASE, 1)
        assert head.status is wire.Status.OK and body == b"\x00"


def _strict_handshake(raw: bytes) -> None:
    decode_descriptor(raw)  # raises on garbage, as the engine's handler does


def test_a_bad_handshake_descriptor_is_answered_not_fatal() -> None:
    strict = SegmentServer(LocalSegment("strict"), TransferConfig(), ServerHooks(lambda: b"{}", _strict_handshake))
    try:
        with _connect(strict) as sock:
            head, reason = _ask(sock, wire.Op.HANDSHAKE, 1, 0, 9, b"not json!")
            assert head.status is wire.Status.BAD_REQUEST and b"bad descriptor" in reason
            head, body = _ask(sock, wire.Op.HANDSHAKE, 2, 0, 0)
            assert head.status is wire.Status.OK and body == b"{}"
    finally:
        strict.close()


def test_a_stalled_partial_frame_is_dropped(served: tuple[SegmentServer, bytearray]) -> None:
    server, _ = served
    with _connect(server) as sock:
        sock.sendall(wire.RequestHeader(wire.Op.WRITE, 1, BASE, 100).pack()[:10])
        sock.settimeout(5)
        assert sock.recv(16) == b""


def test_connection_limit() -> None:
    segment = LocalSegment("tiny")
    server = SegmentServer(
        segment, TransferConfig(max_server_connections=1), ServerHooks(lambda: b"{}", lambda _: None)
    )
    try:
        with _connect(server) as first:
            _ask(first, wire.Op.HANDSHAKE, 1, 0, 0)
            with _connect(server, handshake=False) as second:
                assert second.recv(16) == b""
    finally:
        server.close()


@given(st.binary(min_size=wire.REQUEST.size, max_size=wire.REQUEST.size))
def test_decode_request_never_crashes(frame: bytes) -> None:
    try:
        req = wire.decode_request(frame, 4096)
    except ProtocolError:
        return
    assert req.length <= (wire.MAX_DESCRIPTOR_BYTES if req.op is wire.Op.HANDSHAKE else 4096)
    assert req.offset + req.length < 1 << 64


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    garbage=st.one_of(
        st.binary(max_size=200),
        st.builds(
            lambda op, off, ln, tail: struct.pack("<HBBIQQ", wire.MAGIC, op, 0, 1, off, ln) + tail,
            st.integers(0, 255),
            st.one_of(st.integers(0, (1 << 64) - 1), st.integers(BASE - 10, BASE + SIZE + 10)),
            st.integers(0, 1 << 16),
            st.binary(max_size=64),
        ),
    )
)
def test_fuzzed_bytes_never_stop_the_server(served: tuple[SegmentServer, bytearray], garbage: bytes) -> None:
    server, _ = served
    with _connect(server) as sock:
        try:
            sock.sendall(garbage)
            sock.shutdown(socket.SHUT_WR)  # the frame ends here, however short
            sock.settimeout(5)
            while sock.recv(65536):
                pass
        except (ConnectionResetError, BrokenPipeError, OSError) as exc:  # refused mid-way: fine
            assert not isinstance(exc, TimeoutError), "the server neither answered nor closed"
    with _connect(server) as sock:  # a fuzzed in-bounds write may have changed the bytes
        head, body = _ask(sock, wire.Op.READ, 1, BASE + 1, 1)
        assert head.status is wire.Status.OK and len(body) == 1
