"""Faults and hostile peers: one named regression test per bug found in review, plus retry.

Most use `FakePeer`, a scripted server that answers only when told.
"""

from __future__ import annotations

import errno
import gc
import socket
import time
import uuid
import weakref
from collections.abc import Iterator

import msgspec
import pytest
import torch

from tests.transfer.fake_peer import BASE, FakePeer, connect_raw, engine_for
from tsukimi.clock import WallClock
from tsukimi.config import Config, MetadataConfig, TransferConfig
from tsukimi.errors import ProtocolError
from tsukimi.transfer import OpCode, RequestState, TransferEngine, TransferRequest, wire
from tsukimi.transfer.batch import Batch
from tsukimi.transfer.segment import (
    BufferDescriptor,
    Endpoint,
    LocalSegment,
    SegmentDescriptor,
    decode_descriptor,
    encode_descriptor,
)
from tsukimi.transfer.server import SegmentServer, ServerHooks
from tsukimi.transfer.transports.base import Slice
from tsukimi.transfer.transports.tcp import TcpTransport

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def silent_peer() -> Iterator[FakePeer]:
    peer = FakePeer(answer=False)
    yield peer
    peer.close()


def test_a_broken_connection_is_retried_on_another_one() -> None:
    peer = FakePeer(drop_first=True)
    with engine_for(peer, num_connections=2) as engine:
        status = engine.transfer([TransferRequest(OpCode.WRITE, "fake", BASE, b"survives")])[0]
    peer.close()
    assert status.state is RequestState.COMPLETED
    assert peer.connections == 2 and peer.payloads == [b"survives"]


def test_regression_a_short_request_behind_a_stalled_one_times_out_on_time(silent_peer: FakePeer) -> None:
    """Only the head of the line used to be checked: the short request ended with the long one."""
    with engine_for(silent_peer, num_connections=1) as engine:
        long_batch = engine.submit([TransferRequest(OpCode.READ, "fake", BASE, bytearray(10))], timeout_s=30.0)
        time.sleep(0.2)  # the long request is on the wire, its answer awaited
        start = time.monotonic()
        short_batch = engine.submit([TransferRequest(OpCode.READ, "fake", BASE, bytearray(10))], timeout_s=0.5)
        assert short_batch.wait()[0].state is RequestState.TIMED_OUT
        assert time.monotonic() - start < 0.5 + 1.0
        assert long_batch.statuses()[0].state is RequestState.PENDING  # retried, still in time


def test_regression_a_read_keeps_its_torch_destination_alive(silent_peer: FakePeer) -> None:
    """The tensor could be freed while its READ was in flight, and the data landed in reused memory."""
    with engine_for(silent_peer, num_connections=1) as engine:
        tensor = torch.zeros(4096, dtype=torch.uint8)
        alive = weakref.ref(tensor)
        batch = engine.submit([TransferRequest(OpCode.READ, "fake", BASE, tensor)])
        del tensor
        gc.collect()
        assert alive() is not None
        silent_peer.answer.set()
        assert batch.wait()[0].state is RequestState.COMPLETED
        gc.collect()
        assert alive() is None  # released once the request ended, not before


def test_regression_slices_dispatched_after_the_pool_stopped_still_end(silent_peer: FakePeer) -> None:
    """A submit racing close() used to queue slices no thread would ever read."""
    transport = TcpTransport(TransferConfig(), WallClock())
    desc = silent_peer.descriptor()
    pool = transport._pool(desc)
    transport.close()
    batch = Batch([None], WallClock().now() + 30, WallClock())
    record = batch.records[0]
    record.slices_left = 2
    buffer = BufferDescriptor(BASE, 1 << 20)
    pool.dispatch([Slice(record, OpCode.WRITE, memoryview(b"x" * 10), BASE, buffer) for _ in range(2)])
    batch.wait(timeout_s=2)
    assert batch.done
    assert record.status().state is RequestState.FAILED and record.status().error_code == "closed"


def test_regression_a_descriptor_with_an_unusable_host_is_rejected() -> None:
    """An over-long host label made connect() raise UnicodeError and killed the sender thread."""
    bad = SegmentDescriptor("x", "h", 1, 1, [Endpoint("a" * 70, 1234)], [BufferDescriptor(BASE, 100)])
    with pytest.raises(msgspec.ValidationError, match="bad endpoint"):
        decode_descriptor(encode_descriptor(bad))
    store = f"bad-{uuid.uuid4().hex}"
    cfg = Config(metadata=MetadataConfig(url=f"memory://{store}"))
    with TransferEngine("me", cfg) as engine:
        engine._directory._backend.put("tsukimi/segments/x", encode_descriptor(bad))  # type: ignore[union-attr]
        with pytest.raises(ProtocolError, match="malformed descriptor"):
            engine.open_segment("x")


def test_regression_shm_buffer_reallocated_at_the_same_address() -> None:
    """A stale descriptor kept naming the released file: every later write failed, and the
    mapping of the released file was never dropped."""
    cfg = Config(transfer=TransferConfig(transport="shm"), metadata=MetadataConfig(url=f"memory://{uuid.uuid4().hex}"))
    with TransferEngine("owner", cfg) as owner, TransferEngine("user", cfg) as user:
        first = owner.allocate(8 << 20)
        seg = user.open_segment("owner")
        user.write(seg, first.base, b"x")
        old_base, old_file = first.base, first.shm_name
        owner.unregister(first.base)
        del first
        second = owner.allocate(8 << 20)
        results = [user.transfer([TransferRequest(OpCode.WRITE, seg, second.base, b"hello")])[0] for _ in range(3)]
        states = [r.state for r in results]
        if second.base == old_base:  # the kernel reused the address (the case this test is about)
            assert states[1:] == [RequestState.COMPLETED] * 2
        else:
            assert states == [RequestState.COMPLETED] * 3
        assert bytes(second.view[:5]) == b"hello"
        if second.base == old_base:  # the stale descriptor was noticed: the old file is unmapped
            with open("/proc/self/maps") as maps:
                assert not [line for line in maps if old_file in line]


def test_regression_a_handshake_cannot_redirect_a_named_peer() -> None:
    """Any client of the segment server could replace the descriptor of any peer name."""
    evil = FakePeer()
    cfg = Config(transfer=TransferConfig(transport="tcp"), metadata=MetadataConfig(url=f"memory://{uuid.uuid4().hex}"))
    with TransferEngine("owner", cfg) as owner, TransferEngine("user", cfg) as user:
        buf = owner.allocate(4096)
        seg = user.open_segment("owner")
        user.write(seg, buf.base, b"first")
        claim = msgspec.structs.replace(evil.descriptor(name="owner"), pid=1, buffers=[BufferDescriptor(1, 1 << 62)])
        body = encode_descriptor(claim)  # "I am owner, and every address is mine"
        endpoint = user.describe().endpoints[0]
        with connect_raw(endpoint) as sock:
            sock.sendall(wire.RequestHeader(wire.Op.HANDSHAKE, 1, 0, len(body)).pack() + body)
            sock.recv(1 << 20)
        user.write(seg, buf.base, b"secret for owner")
        assert bytes(buf.view[:16]) == b"secret for owner"
    evil.close()
    assert evil.payloads == []


class _FlakyListener:
    """Wraps a listening socket; its next accept() fails like a process out of descriptors."""

    def __init__(self, real: socket.socket) -> None:
        self.real = real
        self.fail_next = True

    def accept(self) -> tuple[socket.socket, object]:
        if self.fail_next:
            self.fail_next = False
            raise OSError(errno.EMFILE, "Too many open files")
        return self.real.accept()

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)


def test_regression_an_accept_error_does_not_stop_the_server() -> None:
    server = SegmentServer(LocalSegment("s"), TransferConfig(), ServerHooks(lambda: b"{}", lambda _: None))
    flaky = _FlakyListener(server._listener)
    server._listener = flaky  # type: ignore[assignment]
    try:
        for _ in range(2):  # the first wakes the blocked accept(); the next meets the failure
            with connect_raw(server.endpoint) as sock:
                sock.sendall(wire.RequestHeader(wire.Op.HANDSHAKE, 1, 0, 0).pack())
                sock.settimeout(5)
                assert len(sock.recv(64)) >= wire.RESPONSE.size
        assert not flaky.fail_next
    finally:
        server._listener = flaky.real
        server.close()
