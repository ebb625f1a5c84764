"""Tests of tsukimi.rpc: codec round trips, error mapping, timeouts, stale replies, bad frames,
reconnection and the serialized handler."""

from __future__ import annotations

import contextlib
import math
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tsukimi import auth
from tsukimi.clock import WallClock
from tsukimi.errors import (
    BrokenConnectionError,
    ClosedError,
    ConfigError,
    OutOfBounds,
    PeerError,
    ProtocolError,
    RpcTimeout,
    TsukimiError,
)
from tsukimi.netio import free_port
from tsukimi.rpc import NO_RETRY, UNSENT_RETRY, Codec, ErrorReply, RpcClient, RpcServer
from tsukimi.rpc import server as rpc_server
from tsukimi.rpc.frame import HEADER, FrameReader, format_endpoint, parse_endpoint

CLOCK = WallClock()


class EchoRequest(msgspec.Struct, tag=True, frozen=True):
    text: str


class SleepRequest(msgspec.Struct, tag=True, frozen=True):
    seconds: float
    text: str


class FailRequest(msgspec.Struct, tag=True, frozen=True):
    kind: str
    message: str


class EchoResponse(msgspec.Struct, tag=True, frozen=True):
    text: str


class CountResponse(msgspec.Struct, tag=True, frozen=True):
    count: int


CODEC = Codec([EchoRequest, SleepRequest, FailRequest], [EchoResponse, CountResponse])


def handle(request: msgspec.Struct) -> msgspec.Struct:
    match request:
        case EchoRequest(text=text):
            return EchoResponse(text)
        case SleepRequest(seconds=seconds, text=text):
            CLOCK.sleep(seconds)
            return EchoResponse(text)
        case FailRequest(kind="out_of_bounds", message=message):
            raise OutOfBounds(message)
        case FailRequest(kind="config", message=message):
            raise ConfigError(message)
        case FailRequest(message=message):
            raise ValueError(message)
    raise AssertionError(f"unexpected {request!r}")


@pytest.fixture(params=[0.0, 300e-6], ids=["sleeping", "polling"])
def server(request: pytest.FixtureRequest) -> Iterator[RpcServer]:
    """Every server test runs against a server that sleeps between frames and one that polls."""
    with RpcServer(CODEC, handle, name="test", spin_s=request.param) as srv:
        yield srv


@pytest.fixture
def client(server: RpcServer) -> Iterator[RpcClient]:
    with RpcClient(CODEC, server.endpoint, timeout_s=2.0) as cli:
        yield cli


def test_codec_round_trip() -> None:
    for message in (EchoRequest("hi"), SleepRequest(0.5, "x"), FailRequest("a", "b")):
        assert CODEC.decode_request(CODEC.encode(message)) == message
    assert CODEC.decode_response(CODEC.encode(CountResponse(3))) == CountResponse(3)
    assert CODEC.decode_response(CODEC.encode(ErrorReply("timeout", "late"))) == ErrorReply("timeout", "late")


def test_codec_rejects_wrong_direction_and_oversize() -> None:
    with pytest.raises(ProtocolError):
        CODEC.decode_request(CODEC.encode(EchoResponse("a response, not a request")))
    small = Codec([EchoRequest], [EchoResponse], max_frame_bytes=32)
    with pytest.raises(ProtocolError, match="limit"):
        small.encode(EchoRequest("x" * 64))
    with pytest.raises(ProtocolError, match="limit") as info:
        small.decode_request(CODEC.encode(EchoRequest("x" * 64)))
    assert info.value.__cause__ is None  # refused before decoding
    with pytest.raises(ProtocolError) as info:
        CODEC.decode_request(b"\xc1")
    assert isinstance(info.value.__cause__, msgspec.DecodeError)


def test_codec_rejects_untagged_and_colliding_types() -> None:
    class Plain(msgspec.Struct):
        x: int

    class Echo2(msgspec.Struct, tag="EchoRequest"):
        y: int

    with pytest.raises(ConfigError, match="tag=True"):
        Codec([Plain], [EchoResponse])
    with pytest.raises(ConfigError):
        Codec([EchoRequest, Echo2], [EchoResponse])
    with pytest.raises(ConfigError):
        Codec([], [EchoResponse])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_decode_random_bytes_only_raises_protocol_error(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        CODEC.decode_request(data)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["type", "text", "seconds", "kind", "message", "other"]),
        st.one_of(
            st.sampled_from(["EchoRequest", "SleepRequest", "FailRequest"]), st.integers(-(2**63), 2**63 - 1), st.text()
        ),
    )
)
def test_decode_near_miss_messages_only_raises_protocol_error(fields: dict[str, object]) -> None:
    try:
        request = CODEC.decode_request(msgspec.msgpack.encode(fields))
    except ProtocolError:
        return
    assert isinstance(request, EchoRequest | SleepRequest | FailRequest)


def test_round_trip(client: RpcClient) -> None:
    assert client.call(EchoRequest("hello")) == EchoResponse("hello")
    assert client.call_as(EchoRequest("typed"), EchoResponse).text == "typed"
    with pytest.raises(ProtocolError, match="expected CountResponse"):
        client.call_as(EchoRequest("x"), CountResponse)


def test_server_endpoint_has_real_port(server: RpcServer) -> None:
    assert server.endpoint.startswith("tcp://127.0.0.1:")
    assert int(server.endpoint.rsplit(":", 1)[1]) > 0


def test_tsukimi_errors_arrive_as_same_class(client: RpcClient) -> None:
    with pytest.raises(OutOfBounds, match=r"^range 5\.\.9 outside$"):
        client.call(FailRequest("out_of_bounds", "range 5..9 outside"))
    with pytest.raises(ConfigError, match="bad knob"):
        client.call(FailRequest("config", "bad knob"))
    assert client.call(EchoRequest("still here")) == EchoResponse("still here")


def test_unexpected_exception_is_internal_and_server_keeps_serving(client: RpcClient) -> None:
    with pytest.raises(PeerError, match=r"\[internal\] ValueError: boom"):
        client.call(FailRequest("bug", "boom"))
    assert client.call(EchoRequest("after")) == EchoResponse("after")


def test_timeout_then_next_call_gets_its_own_answer(client: RpcClient) -> None:
    start = CLOCK.now()
    with pytest.raises(RpcTimeout):
        client.call(SleepRequest(0.6, "stale"), timeout_s=0.2)
    assert CLOCK.now() - start < 0.2 + 0.5
    # The server is still busy with the stale request; its late reply must not answer this.
    assert client.call(EchoRequest("fresh"), timeout_s=2.0) == EchoResponse("fresh")
    assert client.call(EchoRequest("again")) == EchoResponse("again")


def test_nothing_listening_times_out() -> None:
    with RpcClient(CODEC, f"tcp://127.0.0.1:{free_port()}", timeout_s=0.3) as cli:
        start = CLOCK.now()
        with pytest.raises(RpcTimeout):
            cli.call(EchoRequest("anyone?"))
        assert CLOCK.now() - start < 0.3 + 0.5


def _frame(payload: bytes, request_id: int) -> bytes:
    return HEADER.pack(len(payload), request_id) + payload


def _read_frame(sock: socket.socket) -> tuple[int, bytes]:
    sock.settimeout(2.0)
    head = _recv_exact(sock, HEADER.size)
    length, request_id = HEADER.unpack(head)
    return request_id, _recv_exact(sock, length)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, "connection closed"
        data += chunk
    return data


def _raw(server: RpcServer, handshake: bool = True) -> socket.socket:
    """A raw connection to `server`, past the (secret-less) handshake unless told otherwise."""
    host, port = server.endpoint.removeprefix("tcp://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=2.0)
    if handshake:
        auth.client_handshake(sock, None, auth.deadline_expired(CLOCK.now() + 2.0))
    return sock


def _assert_closed_by_peer(sock: socket.socket) -> None:
    sock.settimeout(2.0)
    with contextlib.suppress(ConnectionResetError):
        assert sock.recv(1) == b""


def test_malformed_frames_get_protocol_error_and_server_keeps_serving(server: RpcServer, client: RpcClient) -> None:
    with _raw(server) as raw:
        raw.sendall(_frame(b"\xc1garbage", 7) + _frame(msgspec.msgpack.encode(EchoResponse("wrong way")), 8))
        for expected_id in (7, 8):
            request_id, payload = _read_frame(raw)
            assert request_id == expected_id
            reply = CODEC.decode_response(payload)
            assert isinstance(reply, ErrorReply)
            assert reply.code == "protocol"
        raw.sendall(_frame(CODEC.encode(EchoRequest("same connection")), 9))  # still in sync
        assert _read_frame(raw) == (9, CODEC.encode(EchoResponse("same connection")))
    assert client.call(EchoRequest("ok")) == EchoResponse("ok")


def test_frame_sent_byte_by_byte_and_pipelined_frames_are_served(server: RpcServer) -> None:
    with _raw(server) as raw:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for byte in _frame(CODEC.encode(EchoRequest("slow")), 1):
            raw.sendall(bytes([byte]))
        assert _read_frame(raw) == (1, CODEC.encode(EchoResponse("slow")))
        raw.sendall(b"".join(_frame(CODEC.encode(EchoRequest(str(i))), 10 + i) for i in range(20)))
        for i in range(20):
            assert _read_frame(raw) == (10 + i, CODEC.encode(EchoResponse(str(i))))
        texts = [str(i) * 30_000 for i in range(5)]  # frames straddle the end of the server's buffer
        raw.sendall(b"".join(_frame(CODEC.encode(EchoRequest(text)), 40 + i) for i, text in enumerate(texts)))
        for i, text in enumerate(texts):
            assert _read_frame(raw) == (40 + i, CODEC.encode(EchoResponse(text)))


def test_large_frames_round_trip(client: RpcClient) -> None:
    text = "x" * (1 << 20)  # larger than the readers' buffers
    assert client.call_as(EchoRequest(text), EchoResponse).text == text
    assert client.call(EchoRequest("small again")) == EchoResponse("small again")


def test_garbage_oversized_and_truncated_frames_close_only_their_connection(
    server: RpcServer, client: RpcClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rpc_server, "_FRAME_TIMEOUT_S", 0.3)
    with _raw(server) as oversized, _raw(server) as garbage, _raw(server) as truncated, _raw(server) as stalled:
        oversized.sendall(HEADER.pack(CODEC.max_frame_bytes + 1, 1))  # refused before allocating
        garbage.sendall(b"\xff" * 64)  # reads as an absurd length prefix
        truncated.sendall(_frame(CODEC.encode(EchoRequest("cut short")), 2)[:-3])
        truncated.shutdown(socket.SHUT_WR)
        stalled.sendall(_frame(CODEC.encode(EchoRequest("never finished")), 3)[:5])
        for sock in (oversized, garbage, truncated):
            _assert_closed_by_peer(sock)
        assert client.call(EchoRequest("meanwhile")) == EchoResponse("meanwhile")
        start = CLOCK.now()
        _assert_closed_by_peer(stalled)  # after the frame bound and at most one tick
        assert CLOCK.now() - start < 1.5
    assert client.call(EchoRequest("after")) == EchoResponse("after")


def test_idle_connections_stay_open(server: RpcServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rpc_server, "_FRAME_TIMEOUT_S", 0.1)
    with _raw(server) as raw:
        CLOCK.sleep(0.7)  # over a server tick with no frame started
        raw.sendall(_frame(CODEC.encode(EchoRequest("still there")), 4))
        assert _read_frame(raw) == (4, CODEC.encode(EchoResponse("still there")))


def test_connection_limit_refuses_extra_connections(server: RpcServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "_max_connections", 1)
    with _raw(server) as first, _raw(server, handshake=False) as second:
        first.sendall(_frame(CODEC.encode(EchoRequest("first")), 1))
        assert _read_frame(first) == (1, CODEC.encode(EchoResponse("first")))
        _assert_closed_by_peer(second)


class _Listener:
    """A scripted server: accept() greets each connection like an RpcServer without a secret."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def settimeout(self, seconds: float) -> None:
        self.sock.settimeout(seconds)

    def accept(self) -> tuple[socket.socket, object]:
        conn, addr = self.sock.accept()
        conn.sendall(auth.encode_greeting(False, bytes(auth.NONCE_BYTES)))
        return conn, addr


@contextlib.contextmanager
def _fake_server() -> Iterator[tuple[_Listener, str]]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(2.0)
        yield _Listener(listener), f"tcp://127.0.0.1:{listener.getsockname()[1]}"


def test_reply_with_another_request_id_is_a_protocol_error() -> None:
    """A late reply carrying an earlier call's id must never answer the current call."""
    with (
        _fake_server() as (listener, endpoint),
        RpcClient(CODEC, endpoint, timeout_s=2.0) as cli,
        ThreadPoolExecutor(1) as pool,
    ):
        future = pool.submit(cli.call, EchoRequest("question"))
        conn, _ = listener.accept()
        with conn:
            request_id, payload = _read_frame(conn)
            assert CODEC.decode_request(payload) == EchoRequest("question")
            conn.sendall(_frame(CODEC.encode(EchoResponse("stale")), request_id - 1))
            with pytest.raises(ProtocolError, match="reply for request"):
                future.result(timeout=2.0)
            _assert_closed_by_peer(conn)  # the client dropped the connection
        future = pool.submit(cli.call, EchoRequest("again"))
        conn, _ = listener.accept()  # a fresh connection, a fresh id
        with conn:
            next_id, _payload = _read_frame(conn)
            assert next_id > request_id
            conn.sendall(_frame(CODEC.encode(EchoResponse("answer")), next_id))
            assert future.result(timeout=2.0) == EchoResponse("answer")


def test_connection_lost_after_sending_is_not_retried() -> None:
    """Once the whole request left, the server may have acted on it: no resend."""
    with (
        _fake_server() as (listener, endpoint),
        RpcClient(CODEC, endpoint, timeout_s=2.0) as cli,
        ThreadPoolExecutor(1) as pool,
    ):
        future = pool.submit(cli.call, EchoRequest("once"))
        conn, _ = listener.accept()
        _read_frame(conn)
        conn.close()
        start = CLOCK.now()
        with pytest.raises(BrokenConnectionError) as info:
            future.result(timeout=2.0)
        assert isinstance(info.value.__cause__, OSError)
        assert CLOCK.now() - start < 0.5
        listener.settimeout(0.2)
        with pytest.raises(TimeoutError):
            listener.accept()


def test_client_reconnects_after_server_restart() -> None:
    with RpcServer(CODEC, handle) as first, RpcClient(CODEC, first.endpoint, timeout_s=3.0) as cli:
        assert cli.call(EchoRequest("before")) == EchoResponse("before")
        first.close()
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(cli.call, EchoRequest("during"))  # retries until the new server is up
            CLOCK.sleep(0.2)
            with RpcServer(CODEC, handle, bind=first.endpoint):
                assert future.result(timeout=3.0) == EchoResponse("during")
                assert cli.call(EchoRequest("after")) == EchoResponse("after")


def test_handler_calls_never_overlap() -> None:
    guard = threading.Lock()
    active = [0]
    overlaps = [0]
    calls = [0]

    def counting(request: msgspec.Struct) -> msgspec.Struct:
        with guard:
            active[0] += 1
            calls[0] += 1
            overlaps[0] += active[0] > 1
        CLOCK.sleep(0.0002)  # invites another connection's thread in, were it allowed
        with guard:
            active[0] -= 1
        return handle(request)

    with RpcServer(CODEC, counting, spin_s=300e-6, spinners=2) as srv:
        assert _echo_from_many_clients(srv.endpoint, clients=4, calls=100) == [100] * 4
    assert calls[0] == 400
    assert overlaps[0] == 0


@pytest.mark.parametrize("spinners", [1, 3])
def test_polling_threads_are_bounded(spinners: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """However many clients are busy, at most `spinners` server threads poll at once."""
    guard = threading.Lock()
    polling = [0]
    peak = [0]
    original = FrameReader.spin

    def counting_spin(reader: FrameReader, seconds: float) -> None:
        if not seconds:  # the clients' (they do not poll)
            return
        with guard:
            polling[0] += 1
            peak[0] = max(peak[0], polling[0])
        try:
            original(reader, seconds)
        finally:
            with guard:
                polling[0] -= 1

    monkeypatch.setattr(FrameReader, "spin", counting_spin)
    with RpcServer(CODEC, handle, spin_s=500e-6, spinners=spinners) as srv:
        assert _echo_from_many_clients(srv.endpoint, clients=6, calls=60, spin_s=0) == [60] * 6
    assert 1 <= peak[0] <= spinners


def _echo_from_many_clients(endpoint: str, clients: int, calls: int, spin_s: float = 250e-6) -> list[int]:
    """Each of `clients` clients, in its own thread, makes `calls` echo calls; the successes."""
    opened = [RpcClient(CODEC, endpoint, spin_s=spin_s) for _ in range(clients)]
    try:

        def worker(cli: RpcClient) -> int:
            return sum(cli.call(EchoRequest("n")) == EchoResponse("n") for _ in range(calls))

        with ThreadPoolExecutor(max_workers=clients) as pool:
            return list(pool.map(worker, opened))
    finally:
        for cli in opened:
            cli.close()


def test_concurrent_calls_on_one_client(client: RpcClient) -> None:
    def worker(thread: int) -> list[bool]:
        return [client.call_as(EchoRequest(f"{thread}-{i}"), EchoResponse).text == f"{thread}-{i}" for i in range(50)]

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(worker, range(8)))
    assert all(all(ok) for ok in results)
    assert sum(len(ok) for ok in results) == 400


def test_close_is_idempotent_and_calls_after_close_fail(server: RpcServer) -> None:
    cli = RpcClient(CODEC, server.endpoint)
    assert cli.call(EchoRequest("x")) == EchoResponse("x")
    cli.close()
    cli.close()
    with pytest.raises(ClosedError):
        cli.call(EchoRequest("y"))
    start = CLOCK.now()
    server.close()
    server.close()
    assert CLOCK.now() - start < 1.0


@pytest.mark.parametrize("spin_s", [0.0, 0.5], ids=["sleeping", "polling"])
@pytest.mark.parametrize("closing", ["client", "server"])
def test_closing_either_end_interrupts_a_waiting_call(server: RpcServer, closing: str, spin_s: float) -> None:
    """Whether the client sleeps or polls for the reply, a close ends the call promptly (the
    server first finishes the handler call in progress)."""
    cli = RpcClient(CODEC, server.endpoint, timeout_s=5.0, spin_s=spin_s)
    expected = ClosedError if closing == "client" else BrokenConnectionError
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(cli.call, SleepRequest(0.4, "slow"))
        CLOCK.sleep(0.05)
        start = CLOCK.now()
        (cli if closing == "client" else server).close()
        with pytest.raises(expected):
            future.result(timeout=2.0)
        assert CLOCK.now() - start < (0.3 if closing == "client" else 1.0)
    cli.close()


def test_bad_arguments_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        RpcClient(CODEC, "tcp://127.0.0.1:1", timeout_s=0)
    with pytest.raises(ConfigError):
        RpcClient(CODEC, "not an endpoint")
    for endpoint in ("tcp://127.0.0.1:65536", "ipc:///tmp/x", "tcp://:80", "tcp://host"):
        with pytest.raises(ConfigError):
            RpcClient(CODEC, endpoint)
    for spin in (-1.0, math.inf, math.nan):
        with pytest.raises(ConfigError, match="spin_s"):
            RpcClient(CODEC, "tcp://127.0.0.1:1", spin_s=spin)
        with pytest.raises(ConfigError, match="spin_s"):
            RpcServer(CODEC, handle, spin_s=spin)
    with pytest.raises(ConfigError, match="spinners"):
        RpcServer(CODEC, handle, spinners=-1)
    with pytest.raises(ConfigError):
        RpcServer(CODEC, handle, bind="tcp://256.0.0.1:0")
    with RpcServer(CODEC, handle) as taken, pytest.raises(ConfigError, match="cannot bind"):
        RpcServer(CODEC, handle, bind=taken.endpoint)
    with pytest.raises(TsukimiError):
        Codec([EchoRequest], [EchoResponse], max_frame_bytes=0)


def test_endpoints_parse_and_format() -> None:
    assert parse_endpoint("tcp://127.0.0.1:5") == ("127.0.0.1", 5)
    assert parse_endpoint("tcp://*:0") == ("0.0.0.0", 0)
    assert parse_endpoint("tcp://[::1]:7") == ("::1", 7)
    assert format_endpoint("::1", 7) == "tcp://[::1]:7"
    with RpcServer(CODEC, handle, bind="tcp://*:0") as srv:
        assert srv.endpoint.startswith("tcp://0.0.0.0:")
        with RpcClient(CODEC, srv.endpoint.replace("0.0.0.0", "127.0.0.1")) as cli:
            assert cli.call(EchoRequest("any interface")) == EchoResponse("any interface")


def test_an_unreachable_server_is_retried_until_the_deadline_unless_told_not_to() -> None:
    endpoint = format_endpoint("127.0.0.1", free_port())  # a port with nothing listening
    clock = WallClock()
    for retry_unsent, least_s in ((True, 0.3), (False, 0.0)):
        policy = UNSENT_RETRY if retry_unsent else NO_RETRY
        with RpcClient(CODEC, endpoint, timeout_s=0.3, retry=policy) as client:
            started = clock.now()
            with pytest.raises(RpcTimeout, match="unreachable"):
                client.call(EchoRequest("x"))
            elapsed = clock.now() - started
            assert elapsed >= least_s and (retry_unsent or elapsed < 0.3)
