"""Fuzzing the control plane: the store master's codec, and a live master fed raw frames.

Targets:
  rpc-codec          decode_request / decode_response on random bytes, damaged valid frames,
                     wrong types in the maps, deep nesting: only ProtocolError comes out.
  rpc-server         a live MasterServer fed byte streams over fresh connections (well-framed
                     junk, damaged frames, oversized or lying length fields): every frame gets an
                     error reply or the connection closes, never an "internal" error, never a
                     hang; a good call on another connection succeeds after every input.
  rpc-master-fields  well-typed requests with out-of-range fields (sizes of 2**63, 0 or 1000
                     replicas, 100 KB keys, strings that are not UTF-8, a batch of 100k ops):
                     clean error replies on one connection that stays usable.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Iterator

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.conftest import fuzz_input, fuzz_settings
from tests.fuzz.raw_clients import Greeter, recv_exactly, split_frames
from tests.fuzz.strategies import deep_msgpack, edge_ints, edge_strings, mutated, not_utf8_msgpack_str, values
from tsukimi.config import MasterConfig
from tsukimi.errors import TsukimiError
from tsukimi.rpc import RpcClient
from tsukimi.rpc.codec import ErrorReply
from tsukimi.rpc.frame import HEADER, parse_endpoint
from tsukimi.store import protocol as p
from tsukimi.store.master.server import MasterServer
from tsukimi.store.protocol import CODEC

MAX_FRAME = CODEC.max_frame_bytes
VALID_REQUESTS: list[msgspec.Struct] = [
    p.Heartbeat("c"),
    p.MountSegment("c", "s", "te", 1 << 20, 1 << 20),
    p.UnmountSegment("c", "s"),
    p.PutStart("c", "k", 100, p.ReplicaConfig(2, soft_pin=True, preferred_segments=("te",)), upsert=True),
    p.PutEnd("c", "k", 7),
    p.PutRevoke("c", "k"),
    p.GetReplicas("k"),
    p.Exists("k"),
    p.ExistsMany(["k", "b"]),
    p.Remove("k", force=True),
    p.RemoveAll(),
    p.Batch([p.PutStart("c", "b", 10), p.Exists("b"), p.Remove("b")]),
    p.QueryKey("k"),
    p.ListSegments(),
]
VALID = [CODEC.encode(r) for r in VALID_REQUESTS]
VALID_RESPONSES = [
    CODEC.encode(r)
    for r in (
        p.Ok(),
        p.HeartbeatResult(True),
        p.PutStartResult([p.ReplicaLocation("te", 4096, 10)], 3),
        p.GetReplicasResult([p.ReplicaLocation("te", 4096, 10)], 10, 5.0),
        p.BatchResult([p.Ok(), p.Failure("x", "y")]),
        ErrorReply("protocol", "bad"),
    )
]
SPECIAL = (  # deep nesting, a str and an array claiming 2**31 elements, nothing
    deep_msgpack(100_000),
    b"\x82\xa4type\xa5Batch\xa3ops" + deep_msgpack(50_000),
    b"\xdb" + struct.pack(">I", 2**31) + b"x",
    b"\xdd\xff\xff\xff\xff",
    b"",
)
TAGS = [cls.__name__ for cls in p.REQUEST_TYPES]


def _error_codes() -> set[str]:
    out, todo = set(), [TsukimiError]
    while todo:
        cls = todo.pop()
        out.add(cls.code)
        todo.extend(cls.__subclasses__())
    return out


KNOWN_CODES = _error_codes()


@st.composite
def wrong_typed_maps(draw: st.DrawFn) -> bytes:
    """A map with a real tag and the right field names holding values of any type."""
    cls = draw(st.sampled_from(p.REQUEST_TYPES))
    names = [f.name for f in msgspec.structs.fields(cls)]
    fields = draw(st.dictionaries(st.sampled_from(names), values(), max_size=len(names))) if names else {}
    extra = draw(st.dictionaries(st.text(max_size=6), values(6), max_size=2))
    return msgspec.msgpack.encode({**extra, **fields, "type": draw(st.sampled_from([*TAGS, "", "Nope", 3]))})


def payloads() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=64),
        mutated(VALID + VALID_RESPONSES),
        wrong_typed_maps(),
        st.builds(msgspec.msgpack.encode, values()),
        st.sampled_from(range(len(SPECIAL))).map(SPECIAL.__getitem__),
    )


@given(payloads())
@fuzz_settings()
def test_codec_decoders_raise_only_protocol_errors(data: bytes) -> None:
    with fuzz_input("rpc-codec"):
        for decode in (CODEC.decode_request, CODEC.decode_response):
            try:
                decode(data)
            except TsukimiError as exc:
                assert exc.code in ("protocol", "invalid_argument"), exc
        with contextlib.suppress(TsukimiError):
            CODEC.decode_response(data[: len(data) // 2] + b"\xc1")


def test_codec_refuses_oversized_frames_before_decoding() -> None:
    with pytest.raises(TsukimiError, match="exceeds"):
        CODEC.decode_request(memoryview(bytes(MAX_FRAME + 1)))


@pytest.mark.parametrize("raw", [b"\xa2\xff\xfe", b"\xa3\xed\xa0\x80"])
def test_regression_codec_strings_that_are_not_utf8_are_protocol_errors(raw: bytes) -> None:
    """msgspec raised UnicodeDecodeError itself, which escaped the codec and killed the
    server's connection thread without a reply (found by the rpc fuzz targets)."""
    frame = b"\x82\xa4type\xa6Exists\xa3key" + raw
    with pytest.raises(TsukimiError, match="malformed request"):
        CODEC.decode_request(frame)


# -- the live master ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def greeter(master: MasterServer) -> Greeter:
    return Greeter(*parse_endpoint(master.endpoint))


@pytest.fixture(scope="module")
def good_client(master: MasterServer) -> Iterator[RpcClient]:
    client = RpcClient(CODEC, master.endpoint, timeout_s=10.0)
    yield client
    client.close()


def frame(payload: bytes, request_id: int = 1, length: int | None = None) -> bytes:
    return HEADER.pack(len(payload) if length is None else length, request_id) + payload


@st.composite
def streams(draw: st.DrawFn) -> tuple[bytes, int]:
    """Bytes for one connection, and how many well-framed frames lead it."""
    parts, framed, broken = [], 0, False
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(("frame", "frame", "frame", "garbage", "oversized", "short", "lying")))
        if kind == "frame":
            parts.append(frame(draw(payloads()), draw(st.integers(0, 2**64 - 1))))
            framed += not broken
        elif kind == "garbage":
            parts.append(draw(st.binary(max_size=40)))
            broken = True
        elif kind == "oversized":
            parts.append(frame(b"\x80", length=draw(st.integers(MAX_FRAME + 1, 2**32 - 1))))
            broken = True
        elif kind == "short":
            parts.append(draw(st.binary(max_size=HEADER.size - 1)))
            broken = True
        else:  # a length larger than what follows: the server waits, then sees our half-close
            body = draw(payloads())
            parts.append(frame(body, length=len(body) + draw(st.integers(1, 1 << 20))))
            broken = True
    return b"".join(parts), framed


def check_replies(data: bytes, leading_frames: int) -> None:
    replies, tail = split_frames(data, HEADER, 0)
    assert not tail, f"a partial reply: {tail[:64]!r}"
    assert len(replies) >= leading_frames, f"{len(replies)} replies to {leading_frames} well-framed frames"
    for _, payload in replies:
        reply = CODEC.decode_response(payload)
        if isinstance(reply, ErrorReply):
            assert reply.code in KNOWN_CODES and reply.code != "internal", reply


def check_serving(client: RpcClient) -> None:
    assert isinstance(client.call(p.ListSegments()), p.SegmentsResult)


@given(streams())
@fuzz_settings()
def test_live_master_answers_or_closes_on_fuzzed_frames(
    master: MasterServer,
    greeter: Greeter,
    good_client: RpcClient,
    thread_crashes: list[object],
    stream: tuple[bytes, int],
) -> None:
    data, framed = stream
    with fuzz_input("rpc-server"):
        answer, _ = greeter.exchange(data)
        check_replies(answer, framed)
        check_serving(good_client)
        assert not thread_crashes


# -- well-typed requests with out-of-range fields -----------------------------------------------


def keys() -> st.SearchStrategy[object]:
    return st.one_of(edge_strings(), not_utf8_msgpack_str())


def replica_configs() -> st.SearchStrategy[dict[str, object]]:
    return st.fixed_dictionaries(
        {},
        optional={
            "replicas": st.sampled_from([-1, 0, 1, 2, 8, 9, 1000, 2**63 - 1]),
            "soft_pin": st.booleans(),
            "hard_pin": st.booleans(),
            "preferred_segments": st.lists(keys(), max_size=3) | st.just(["te"] * 10_000),
        },
    )


def ops() -> st.SearchStrategy[dict[str, object]]:
    client = keys()
    return st.one_of(
        st.fixed_dictionaries({"type": st.just("Heartbeat"), "client_id": client}),
        st.fixed_dictionaries(
            {
                "type": st.just("MountSegment"),
                "client_id": client,
                "segment_id": keys(),
                "te_segment": keys(),
                "base": edge_ints(),
                "size": edge_ints(),
            }
        ),
        st.fixed_dictionaries({"type": st.just("UnmountSegment"), "client_id": client, "segment_id": keys()}),
        st.fixed_dictionaries(
            {"type": st.just("PutStart"), "client_id": client, "key": keys(), "size": edge_ints()},
            optional={"config": replica_configs(), "upsert": st.booleans()},
        ),
        st.fixed_dictionaries(
            {"type": st.sampled_from(["PutEnd", "PutRevoke"]), "client_id": client, "key": keys()},
            optional={"put_id": edge_ints()},
        ),
        st.fixed_dictionaries({"type": st.sampled_from(["GetReplicas", "Exists", "QueryKey"]), "key": keys()}),
        st.fixed_dictionaries({"type": st.just("Remove"), "key": keys()}, optional={"force": st.booleans()}),
        st.fixed_dictionaries({"type": st.just("ListSegments")}),
    )


BIG_BATCH = msgspec.msgpack.encode({"type": "Batch", "ops": [{"type": "Exists", "key": "k"}] * 100_000})


def requests() -> st.SearchStrategy[bytes]:
    batch = st.fixed_dictionaries({"type": st.just("Batch"), "ops": st.lists(ops(), max_size=6)})
    return st.one_of(ops().map(msgspec.msgpack.encode), batch.map(msgspec.msgpack.encode), st.just(BIG_BATCH))


class _Connection:
    """One raw connection reused across examples (well-framed requests keep it in sync)."""

    def __init__(self, greeter: Greeter) -> None:
        self._greeter = greeter
        self._sock: socket.socket | None = None
        self._ids = 0
        self.lock = threading.Lock()

    def call(self, payload: bytes) -> msgspec.Struct:
        if self._sock is None:
            self._sock = self._greeter.connect(timeout_s=10.0)
        self._ids += 1
        self._sock.sendall(frame(payload, self._ids))
        length, request_id = HEADER.unpack(recv_exactly(self._sock, HEADER.size))
        assert request_id == self._ids
        return CODEC.decode_response(recv_exactly(self._sock, length))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()


@pytest.fixture(scope="module")
def connection(greeter: Greeter) -> Iterator[_Connection]:
    conn = _Connection(greeter)
    yield conn
    conn.close()


@given(requests())
@fuzz_settings()
def test_out_of_range_fields_get_clean_error_replies(
    master: MasterServer, connection: _Connection, thread_crashes: list[object], payload: bytes
) -> None:
    with fuzz_input("rpc-master-fields"):
        reply = connection.call(payload)
        if isinstance(reply, ErrorReply):
            assert reply.code in KNOWN_CODES and reply.code != "internal", reply
        elif isinstance(reply, p.BatchResult):
            assert all(r.code in KNOWN_CODES for r in reply.results if isinstance(r, p.Failure))
        assert isinstance(connection.call(CODEC.encode(p.Exists("probe"))), p.ExistsResult)
        assert not thread_crashes


def test_master_state_is_consistent_after_the_fuzzing(master: MasterServer) -> None:
    with master._lock:
        master.state.check_invariants()


def test_regression_a_segment_past_64_bits_or_too_small_is_refused_at_mount() -> None:
    with MasterServer(MasterConfig(rpc_port=0, http_port=0)) as server:
        client = RpcClient(CODEC, server.endpoint, timeout_s=10.0)
        try:
            with pytest.raises(TsukimiError) as refused:
                client.call(p.MountSegment("c", "s", "te", 2**64 - 1, 1 << 20))
                client.call(p.PutStart("c", "k1", 100))
                client.call(p.PutStart("c", "k2", 100))
            assert refused.value.code == "invalid_argument", refused.value
            with pytest.raises(TsukimiError, match="at least"):
                client.call(p.MountSegment("c", "s2", "te", 1 << 20, 16))
        finally:
            client.close()
