"""Notifications (notify / notifications), liveness probes (probe), and the engine's views of
its own memory and of peers (local_view, lookup): the NOTIFY and PING frames, the bounded
inbox, and engines talking over loopback (p2p and through a metadata backend). That a
notification follows its transfer, for every transport, is in the conformance suite."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from tests.transfer.fake_peer import connect_raw
from tsukimi.config import Config, MetadataConfig, TransferConfig
from tsukimi.errors import (
    AuthError,
    BrokenConnectionError,
    ClosedError,
    ConfigError,
    InvalidArgument,
    OutOfBounds,
    PeerError,
    ProtocolError,
    RpcTimeout,
    SegmentNotFound,
)
from tsukimi.testing.engine_pairs import secret_file
from tsukimi.testing.processes import JsonWorker, wait_until
from tsukimi.transfer import Notification, TransferEngine, wire
from tsukimi.transfer.control import MAX_IDLE_PER_ENDPOINT
from tsukimi.transfer.notifications import MAX_QUEUED_BYTES, NotificationInbox
from tsukimi.transfer.segment import LocalSegment
from tsukimi.transfer.server import SegmentServer, ServerHooks

pytestmark = pytest.mark.timeout(60)


def _config(url: str, **transfer: object) -> Config:
    return Config(transfer=TransferConfig(**transfer), metadata=MetadataConfig(url=url))  # type: ignore[arg-type]


@pytest.fixture
def url() -> str:
    return f"memory://{uuid.uuid4().hex}"


@pytest.fixture
def engines(url: str) -> Iterator[tuple[TransferEngine, TransferEngine]]:
    """(target, initiator) on one in-memory metadata backend; the target owns 1 MiB."""
    with TransferEngine("target", _config(url)) as target, TransferEngine("initiator", _config(url)) as initiator:
        target.allocate(1 << 20)
        yield target, initiator


# -- the frames ----------------------------------------------------------------------------


def test_a_notification_payload_round_trips() -> None:
    for name, message in [("req-7", b"kv ready"), ("", b""), ("名前", bytes(range(256)))]:
        assert wire.decode_notification(wire.encode_notification(name, message)) == (name, message)


def test_notification_bounds() -> None:
    room = wire.MAX_NOTIFY_BYTES - wire.NOTIFY_NAME.size - 1
    assert len(wire.encode_notification("n", bytes(room))) == wire.MAX_NOTIFY_BYTES
    with pytest.raises(InvalidArgument, match="at most"):
        wire.encode_notification("n", bytes(room + 1))
    for bad in [b"", b"\x01", b"\x05\x00abc", b"\x02\x00\xff\xfe"]:  # short, overrun, not UTF-8
        with pytest.raises(ProtocolError):
            wire.decode_notification(bad)
    with pytest.raises(ProtocolError, match="NOTIFY length"):
        wire.decode_request(wire.RequestHeader(wire.Op.NOTIFY, 1, 0, wire.MAX_NOTIFY_BYTES + 1).pack(), 1 << 20)
    with pytest.raises(ProtocolError, match="PING length"):
        wire.decode_request(wire.RequestHeader(wire.Op.PING, 1, 0, 1).pack(), 1 << 20)


def _ask(sock: socket.socket, op: wire.Op, seq: int, payload: bytes = b"") -> tuple[wire.ResponseHeader, bytes]:
    sock.sendall(wire.RequestHeader(op, seq, 0, len(payload)).pack() + payload)
    head = bytearray(wire.RESPONSE.size)
    wire.recv_exact(sock, memoryview(head))
    response = wire.decode_response(head)
    body = bytearray(response.length)
    wire.recv_exact(sock, memoryview(body))
    return response, bytes(body)


def test_the_server_answers_notify_and_ping() -> None:
    delivered: list[Notification] = []
    room = [2]

    def on_notify(notification: Notification) -> bool:
        if room[0] == 0:
            return False
        room[0] -= 1
        delivered.append(notification)
        return True

    server = SegmentServer(LocalSegment("s"), TransferConfig(), ServerHooks(lambda: b"{}", lambda _: None, on_notify))
    try:
        with connect_raw(server.endpoint) as sock:
            sock.settimeout(5)
            assert _ask(sock, wire.Op.PING, 1) == (wire.ResponseHeader(wire.Status.OK, 1, 0), b"")
            head, body = _ask(sock, wire.Op.NOTIFY, 2, wire.encode_notification("a", b"1"))
            assert (head.status, head.seq, body) == (wire.Status.OK, 2, b"")
            head, body = _ask(sock, wire.Op.NOTIFY, 3, b"\x09\x00a")  # the name overruns the payload
            assert head.status is wire.Status.BAD_REQUEST and body.startswith(b"bad notification")
            assert _ask(sock, wire.Op.NOTIFY, 4, wire.encode_notification("b", b"2"))[0].status is wire.Status.OK
            head, body = _ask(sock, wire.Op.NOTIFY, 5, wire.encode_notification("c", b"3"))
            assert head.status is wire.Status.BUSY and b"full" in body
            assert _ask(sock, wire.Op.PING, 6)[0].status is wire.Status.OK  # still serving
        assert delivered == [Notification("a", b"1"), Notification("b", b"2")]
        with connect_raw(server.endpoint) as sock:  # a PING with a payload is malformed: closed
            sock.settimeout(5)
            sock.sendall(wire.RequestHeader(wire.Op.PING, 1, 0, 4).pack() + b"junk")
            with contextlib.suppress(ConnectionResetError):  # closed with "junk" unread: a reset
                assert sock.recv(16) == b""
    finally:
        server.close()


# -- the inbox -----------------------------------------------------------------------------


def test_the_inbox_is_bounded_by_count_and_by_bytes() -> None:
    inbox = NotificationInbox(max_count=3, max_bytes=10)
    assert inbox.put(Notification("a", b"1234"))  # 5 bytes
    assert inbox.put(Notification("b", b"123"))  # 9
    assert not inbox.put(Notification("c", b"12"))  # 12 > 10
    assert inbox.put(Notification("c"))  # 10
    assert not inbox.put(Notification(""))  # 4 > 3 notifications
    assert inbox.take(max_count=2) == [Notification("a", b"1234"), Notification("b", b"123")]
    assert len(inbox) == 1 and inbox.put(Notification("d", b"1234"))  # room again: 6 bytes, 2 queued
    assert inbox.take() == [Notification("c"), Notification("d", b"1234")]
    assert inbox.take() == []
    with pytest.raises(ConfigError):
        inbox.take(max_count=0)
    with pytest.raises(ConfigError):
        NotificationInbox(max_count=0)


def test_take_waits_for_a_notification() -> None:
    inbox = NotificationInbox()
    threading.Timer(0.2, inbox.put, [Notification("late")]).start()
    start = time.monotonic()
    assert inbox.take(timeout_s=5.0) == [Notification("late")]
    assert time.monotonic() - start < 2.0
    start = time.monotonic()
    assert inbox.take(timeout_s=0.2) == []
    assert 0.15 < time.monotonic() - start < 2.0


# -- engines -------------------------------------------------------------------------------


def test_notify_between_p2p_engines() -> None:
    with TransferEngine(config=_config("p2p")) as target, TransferEngine(config=_config("p2p")) as initiator:
        for i in range(3):
            initiator.notify(target.name, Notification(f"n{i}", b"x" * i))
        assert target.notifications() == [Notification(f"n{i}", b"x" * i) for i in range(3)]
        assert target.notifications() == []
        assert initiator.probe(target.name) > 0.0


def test_a_full_inbox_refuses_and_drops_nothing(engines: tuple[TransferEngine, TransferEngine]) -> None:
    target, initiator = engines
    message = bytes(wire.MAX_NOTIFY_BYTES - wire.NOTIFY_NAME.size - 1)  # one byte of name: 65534 queued
    fits = MAX_QUEUED_BYTES // (1 + len(message))
    for i in range(fits):
        initiator.notify("target", Notification(chr(ord("a") + i % 26), message))
    with pytest.raises(PeerError, match="full"):
        initiator.notify("target", Notification("z", message))
    taken = target.notifications()
    assert len(taken) == fits == 256 and [n.name for n in taken[:3]] == ["a", "b", "c"]
    initiator.notify("target", Notification("again"))
    assert target.notifications() == [Notification("again")]


def test_notify_errors_are_the_callers_or_the_peers(engines: tuple[TransferEngine, TransferEngine]) -> None:
    target, initiator = engines
    with pytest.raises(InvalidArgument):
        initiator.notify("target", Notification("big", bytes(wire.MAX_NOTIFY_BYTES)))
    with pytest.raises(SegmentNotFound, match="nobody"):
        initiator.notify("nobody", Notification("n"))
    with pytest.raises(SegmentNotFound):
        initiator.probe("nobody")
    assert target.notifications() == []
    initiator.close()
    with pytest.raises(ClosedError):
        initiator.notify("target", Notification("n"))
    with pytest.raises(ClosedError):
        initiator.probe("target")


def test_a_notification_without_the_cluster_secret_is_refused(url: str, tmp_path: object) -> None:
    security = secret_file(tmp_path, b"notify-secret-" + uuid.uuid4().hex.encode())  # type: ignore[arg-type]
    strict = Config(metadata=MetadataConfig(url=url), security=security)
    with TransferEngine("target", strict) as target, TransferEngine("outsider", _config(url)) as outsider:
        with pytest.raises(AuthError):
            outsider.notify("target", Notification("let me in"))
        with pytest.raises(AuthError):
            outsider.probe("target")
        with TransferEngine("member", strict) as member:
            member.notify("target", Notification("hello"))
        assert target.notifications() == [Notification("hello")]


def test_control_connections_are_reused(engines: tuple[TransferEngine, TransferEngine]) -> None:
    target, initiator = engines
    for _ in range(5):
        initiator.probe("target")
        initiator.notify("target", Notification("n"))
    assert len(target._servers[0]._conns) == 1  # one connection carried all ten requests
    assert len(target.notifications()) == 5


def test_concurrent_notifications_arrive_in_each_senders_order(
    engines: tuple[TransferEngine, TransferEngine],
) -> None:
    target, initiator = engines

    def send(thread: int) -> None:
        for i in range(20):
            initiator.notify("target", Notification(f"t{thread}", i.to_bytes(1, "little")))

    threads = [threading.Thread(target=send, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    taken = target.notifications()
    assert len(taken) == 160
    for t in range(8):
        assert [n.message[0] for n in taken if n.name == f"t{t}"] == list(range(20))
    # at most MAX_IDLE_PER_ENDPOINT connections stay open once the burst is over
    wait_until(lambda: len(target._servers[0]._conns) <= MAX_IDLE_PER_ENDPOINT, timeout_s=10.0)


def test_a_probe_finds_a_restarted_peer(url: str) -> None:
    with TransferEngine("initiator", _config(url)) as initiator:
        with TransferEngine("target", _config(url)) as first:
            initiator.probe("target")
            old = first.describe().endpoints
        with TransferEngine("target", _config(url)) as second:  # a new port; the cache has the old one
            assert second.describe().endpoints != old
            initiator.probe("target")
            initiator.notify("target", Notification("after restart"))
            assert second.notifications() == [Notification("after restart")]
        with pytest.raises(SegmentNotFound):  # withdrawn on close
            initiator.probe("target")


def test_probing_a_killed_or_stopped_peer(target_process: JsonWorker) -> None:
    with TransferEngine(config=_config("p2p")) as engine:
        name = target_process.ready["name"]
        assert engine.probe(name) > 0.0
        target_process.send_signal(signal.SIGSTOP)
        try:
            wait_until(lambda: _state(target_process.pid) == "T", timeout_s=5.0)  # stopped, not stopping
            start = time.monotonic()
            with pytest.raises(RpcTimeout):
                engine.probe(name, timeout_s=0.5)
            assert time.monotonic() - start < 2.0
        finally:
            target_process.send_signal(signal.SIGCONT)
        assert engine.probe(name) > 0.0
        target_process.kill()
        with pytest.raises((SegmentNotFound, BrokenConnectionError)):
            engine.probe(name)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


# -- local memory and peers' descriptors ----------------------------------------------------


def test_local_view_reaches_registered_memory_only(engines: tuple[TransferEngine, TransferEngine]) -> None:
    target, _ = engines
    buf = target.lookup("target").buffers[0]
    target.local_view(buf.base + 10, 5)[:] = b"hello"
    assert bytes(target.local_view(buf.base, 15)[10:]) == b"hello"
    for address, length in [(buf.base + buf.length - 2, 4), (buf.base - 1, 1), (buf.base, 0), (1, 1)]:
        with pytest.raises(OutOfBounds):
            target.local_view(address, length)


def test_lookup_finds_peers_and_itself(engines: tuple[TransferEngine, TransferEngine]) -> None:
    target, initiator = engines
    assert initiator.lookup("initiator") == initiator.describe()
    seen = initiator.lookup("target")
    assert seen.buffers == target.describe().buffers and len(seen.buffers) == 1
    extra = target.allocate(4096)
    assert initiator.lookup("target") == seen  # cached
    assert extra.base in {b.base for b in initiator.lookup("target", fresh=True).buffers}
    with pytest.raises(SegmentNotFound):
        initiator.lookup("nobody")


def test_on_this_host_by_host_identity(engines: tuple[TransferEngine, TransferEngine]) -> None:
    _, initiator = engines
    assert initiator.on_this_host("initiator")
    assert initiator.on_this_host("target")  # both engines live in this process's host
    assert not initiator.on_this_host("nobody")  # unknown: not local, no error
