"""Tests of tsukimi.rpc: codec round trips, error mapping, timeouts, stale replies, bad frames."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from tsukimi.clock import WallClock
from tsukimi.errors import (
    ClosedError,
    ConfigError,
    OutOfBounds,
    PeerError,
    ProtocolError,
    RpcTimeout,
    TsukimiError,
)
from tsukimi.rpc import Codec, ErrorReply, RpcClient, RpcServer

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


@pytest.fixture
def server() -> Iterator[RpcServer]:
    with RpcServer(CODEC, handle, name="test") as srv:
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
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with RpcClient(CODEC, f"tcp://127.0.0.1:{port}", timeout_s=0.3) as cli:
        start = CLOCK.now()
        with pytest.raises(RpcTimeout):
            cli.call(EchoRequest("anyone?"))
        assert CLOCK.now() - start < 0.3 + 0.5


def test_malformed_frames_get_protocol_error_and_server_keeps_serving(server: RpcServer, client: RpcClient) -> None:
    raw: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.endpoint)
    try:
        raw.send_multipart([b"\x00" * 8, b"\xc1garbage"])
        assert raw.poll(2000, zmq.POLLIN)
        request_id, payload = raw.recv_multipart()
        assert request_id == b"\x00" * 8
        reply = CODEC.decode_response(payload)
        assert isinstance(reply, ErrorReply)
        assert reply.code == "protocol"
        raw.send_multipart([b"just one frame"])  # envelope is only the identity
        raw.send_multipart([b"a", b"b", msgspec.msgpack.encode(EchoResponse("wrong way"))])
        replies = []
        for _ in range(2):
            assert raw.poll(2000, zmq.POLLIN)
            replies.append(raw.recv_multipart())
        assert [len(frames) for frames in replies] == [1, 3]
        for frames in replies:
            error = CODEC.decode_response(frames[-1])
            assert isinstance(error, ErrorReply)
            assert error.code == "protocol"
    finally:
        raw.close(linger=0)
    assert client.call(EchoRequest("ok")) == EchoResponse("ok")


def test_reply_with_another_request_id_is_discarded() -> None:
    """A late reply carrying an earlier call's id must never answer the current call."""
    router: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        with RpcClient(CODEC, f"tcp://127.0.0.1:{port}", timeout_s=2.0) as cli, ThreadPoolExecutor(1) as pool:
            future = pool.submit(cli.call, EchoRequest("question"))
            assert router.poll(2000, zmq.POLLIN)
            identity, request_id, payload = router.recv_multipart()
            assert CODEC.decode_request(payload) == EchoRequest("question")
            stale_id = (int.from_bytes(request_id, "big") - 1).to_bytes(8, "big")
            router.send_multipart([identity, stale_id, CODEC.encode(EchoResponse("stale"))])
            router.send_multipart([identity, b"junk"])
            router.send_multipart([identity, request_id, CODEC.encode(EchoResponse("answer"))])
            assert future.result(timeout=2.0) == EchoResponse("answer")
    finally:
        router.close(linger=0)


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


def test_close_interrupts_a_waiting_call(server: RpcServer) -> None:
    cli = RpcClient(CODEC, server.endpoint, timeout_s=5.0)
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(cli.call, SleepRequest(0.4, "slow"))
        CLOCK.sleep(0.05)
        start = CLOCK.now()
        cli.close()
        with pytest.raises(ClosedError):
            future.result(timeout=2.0)
        assert CLOCK.now() - start < 0.3


def test_bad_arguments_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        RpcClient(CODEC, "tcp://127.0.0.1:1", timeout_s=0)
    with pytest.raises(ConfigError):
        RpcClient(CODEC, "not an endpoint")
    with pytest.raises(ConfigError):
        RpcServer(CODEC, handle, bind="tcp://256.0.0.1:0")
    with pytest.raises(TsukimiError):
        Codec([EchoRequest], [EchoResponse], max_frame_bytes=0)
