"""Fuzzing the Transfer Engine's wire: header decoders, and a live segment server.

Targets:
  te-wire    wire.decode_request / decode_response on any header: ProtocolError or a header
             whose op, length and offset are within bounds.
  te-server  a live TransferEngine with two registered buffers (a gap between them) fed byte
             streams of fuzzed headers (bad magic and opcodes, lengths past the buffers or up
             to 2**64-1, offsets overflowing 64 bits, handshakes carrying junk descriptors):
             registered bytes outside every WRITE's addressed range never change, every
             answer is a well-formed response, the server never hangs or loses a thread, and
             a good engine's write and read succeed after every input.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.conftest import fuzz_input, fuzz_settings
from tests.fuzz.raw_clients import Greeter, split_frames
from tests.fuzz.strategies import EDGE_INTS, mutated
from tsukimi.config import Config, TransferConfig
from tsukimi.errors import ProtocolError
from tsukimi.transfer import TransferEngine, wire
from tsukimi.transfer.directory import parse_host_port
from tsukimi.transfer.segment import BufferDescriptor, Endpoint, SegmentDescriptor, encode_descriptor

BUFFER_BYTES = 16 << 10
GAP_BYTES = 4096
PATTERN = bytes(i * 7 % 251 for i in range(BUFFER_BYTES))
MAX_SLICE = TransferConfig().max_slice_bytes
PAYLOAD_CAP = 2 * BUFFER_BYTES + 64  # bytes of a WRITE payload actually sent at most


@given(st.binary(min_size=wire.REQUEST.size, max_size=wire.REQUEST.size), st.binary(min_size=16, max_size=16))
@fuzz_settings()
def test_header_decoders_bound_everything(request_head: bytes, response_head: bytes) -> None:
    with fuzz_input("te-wire"):
        try:
            head = wire.decode_request(request_head, MAX_SLICE)
        except ProtocolError:
            pass
        else:
            limit = wire.MAX_DESCRIPTOR_BYTES if head.op is wire.Op.HANDSHAKE else MAX_SLICE
            assert head.length <= limit and head.offset + head.length < 1 << 64
        with contextlib.suppress(ProtocolError):
            wire.decode_response(response_head)


@dataclass
class Target:
    engine: TransferEngine
    buffers: list[bytearray]
    bases: list[int]
    greeter: Greeter
    peer: TransferEngine  # the good engine


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    config = Config(transfer=TransferConfig(timeout_s=5.0))
    engine = TransferEngine(config=config)
    peer = TransferEngine(config=Config(transfer=TransferConfig(transport="tcp", timeout_s=5.0)))
    whole = bytearray(2 * BUFFER_BYTES + GAP_BYTES)  # two buffers of one allocation, a gap between
    views = [memoryview(whole)[:BUFFER_BYTES], memoryview(whole)[BUFFER_BYTES + GAP_BYTES :]]
    bases = [engine.register(v) for v in views]
    endpoint = parse_host_port(engine.name)
    try:
        yield Target(engine, [whole], bases, Greeter(endpoint.host, endpoint.port), peer)
    finally:
        peer.close()
        engine.close()


def restore(t: Target) -> None:
    whole = t.buffers[0]
    whole[:BUFFER_BYTES] = PATTERN
    whole[BUFFER_BYTES + GAP_BYTES :] = PATTERN


def descriptor_bytes() -> list[bytes]:
    desc = SegmentDescriptor(
        "127.0.0.1:1", "host/boot", 1, 1, [Endpoint("127.0.0.1", 1)], [BufferDescriptor(4096, 4096, "shm", 0)]
    )
    return [encode_descriptor(desc)]


@st.composite
def requests(draw: st.DrawFn, bases: list[int]) -> tuple[bytes, list[tuple[int, int]]]:
    """One fuzzed request frame with its payload, and the range it may legitimately write."""
    base = draw(st.sampled_from(bases))
    offset = draw(
        st.one_of(
            st.sampled_from(EDGE_INTS).filter(lambda v: v >= 0),
            st.integers(-64, BUFFER_BYTES + GAP_BYTES + 64).map(lambda d: base + d).filter(lambda v: v >= 0),
        )
    )
    length = draw(
        st.one_of(
            st.sampled_from(
                [
                    0,
                    1,
                    16,
                    BUFFER_BYTES,
                    BUFFER_BYTES + 1,
                    MAX_SLICE,
                    MAX_SLICE + 1,
                    wire.MAX_DESCRIPTOR_BYTES + 1,
                    2**63,
                    2**64 - 1,
                ]
            ),
            st.integers(0, 2 * BUFFER_BYTES),
        )
    )
    op = draw(st.sampled_from([1, 1, 2, 2, 2, 3, 0, 4, 255]))
    magic = draw(st.sampled_from([wire.MAGIC] * 8 + [0, wire.MAGIC ^ 1, 0xFFFF]))
    head = wire.REQUEST.pack(
        magic, op, draw(st.integers(0, 255)), draw(st.integers(0, 2**32 - 1)), offset % (1 << 64), length
    )
    if op == wire.Op.HANDSHAKE:
        body = draw(st.one_of(st.binary(max_size=64), mutated(descriptor_bytes())))
        sent = body[:length]
    else:
        sent = b"\xee" * min(length, draw(st.integers(0, PAYLOAD_CAP))) if op == wire.Op.WRITE else b""
    writes = [(offset, length)] if op == wire.Op.WRITE else []
    return head + sent, writes


@st.composite
def streams(draw: st.DrawFn, bases: list[int]) -> tuple[bytes, list[tuple[int, int]]]:
    frames = draw(st.lists(requests(bases), min_size=1, max_size=4))
    tail = draw(st.one_of(st.just(b""), st.binary(max_size=30)))
    return b"".join(f for f, _ in frames) + tail, [w for _, ws in frames for w in ws]


def check_untouched(t: Target, writes: list[tuple[int, int]]) -> None:
    """Every byte of both buffers outside the WRITE ranges still holds the pattern."""
    whole = t.buffers[0]
    for base, start in zip(t.bases, (0, BUFFER_BYTES + GAP_BYTES), strict=True):
        current = whole[start : start + BUFFER_BYTES]
        if current == PATTERN:
            continue
        for i in range(BUFFER_BYTES):
            if current[i] != PATTERN[i]:
                address = base + i
                assert any(off <= address < off + n for off, n in writes), f"byte at {address:#x} changed"


def check_responses(data: bytes) -> None:
    responses, tail = split_frames(data, wire.RESPONSE, 4)
    assert len(tail) < wire.RESPONSE.size or wire.RESPONSE.unpack_from(tail)[4] > len(tail) - wire.RESPONSE.size
    for fields, _ in responses:
        head = wire.decode_response(wire.RESPONSE.pack(*fields))
        assert head.status in wire.Status


def check_good_engine(t: Target) -> None:
    data = bytes(range(256))
    segment = t.peer.open_segment(t.engine.name)
    t.peer.write(segment, t.bases[1] + 100, data)
    out = bytearray(256)
    t.peer.read(segment, t.bases[1] + 100, out)
    assert out == data


@given(st.data())
@fuzz_settings()
def test_live_segment_server_survives_fuzzed_headers(
    target: Target, thread_crashes: list[object], data: st.DataObject
) -> None:
    stream, writes = data.draw(streams(target.bases))
    with fuzz_input("te-server"):
        restore(target)
        answer, _ = target.greeter.exchange(stream)
        check_responses(answer)
        check_untouched(target, writes)
        check_good_engine(target)
        assert not thread_crashes
