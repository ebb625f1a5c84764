"""The segment server: serves peers' one-sided READ and WRITE requests on this process's
registered buffers over TCP, on its own threads (never the application's).

One thread per connection (netserver.ConnectionServer). Every request is checked against the
registered buffers before a byte is touched: out-of-range requests get an OUT_OF_BOUNDS
answer (a write's payload is drained so the stream stays in sync) and the connection keeps
serving; a malformed frame closes only that connection. With the cluster secret, a peer is
served only after the handshake (tsukimi/auth.py, run by netserver.ConnectionServer): one that
fails it never reaches `serve`, so it can neither read nor write a byte.

A range in registered device memory is served through the engine's pinned staging chunks
(tsukimi/transfer/staging.py): a WRITE's payload is received chunk by chunk, each copied to
the device on a copy thread while the next arrives; a READ's chunks are copied from the device
one ahead of the one being sent. A device copy that fails before the answer started is
answered SERVER_ERROR; one that fails mid-stream closes the connection.

Besides READ and WRITE, a peer may send HANDSHAKE (descriptors both ways), NOTIFY (a
notification for this engine's inbox: answered BUSY when the inbox is full) and PING (answered
at once: the liveness probe). The engine's side of those is `ServerHooks`.
"""

from __future__ import annotations

import functools
import logging
import socket
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import msgspec

from tsukimi import netserver
from tsukimi.clock import Clock, WallClock
from tsukimi.config import TransferConfig
from tsukimi.device import DeviceRange, backend
from tsukimi.errors import OutOfBounds, ProtocolError, TsukimiError
from tsukimi.transfer import wire
from tsukimi.transfer.notifications import Notification
from tsukimi.transfer.segment import Endpoint, LocalSegment
from tsukimi.transfer.staging import StagingPool

logger = logging.getLogger(__name__)

_DRAIN_BYTES = 256 << 10
_DATA_OPS = (wire.Op.READ, wire.Op.WRITE)
_TICK_S = 0.5
_ACK_FLUSH_BYTES = 256 << 10  # a write at least this long first sends the acks held back
_READ_FLUSH_BYTES = 512 << 10  # read answers are held back (while more requests wait) up to this


def _refuse_notifications(_: Notification) -> bool:
    return False


def _now(job: Callable[[], None]) -> Future[None]:
    """Run `job` on this thread (one chunk: a hand-off would cost more than it overlaps)."""
    future: Future[None] = Future()
    try:
        job()
    except BaseException as exc:
        future.set_exception(exc)
    else:
        future.set_result(None)
    return future


def _outcome(future: Future[None]) -> TsukimiError | None:
    """Wait for a device copy; its error (the driver's or a bad range), if any."""
    error = future.exception()
    if error is None:
        return None
    if isinstance(error, TsukimiError):
        return error
    raise error


@dataclass(frozen=True, slots=True)
class ServerHooks:
    """What the server asks of its engine.

    describe: this engine's descriptor, encoded (the HANDSHAKE answer).
    on_handshake: a peer's descriptor, encoded (raises msgspec errors when malformed).
    on_notify: a peer's notification; False when there is no room for it (answered BUSY).
    """

    describe: Callable[[], bytes]
    on_handshake: Callable[[bytes], None]
    on_notify: Callable[[Notification], bool] = _refuse_notifications


class SegmentServer(netserver.ConnectionServer):
    """Serves `segment` on `host:config.port` (0 = ephemeral; `host` is one of the
    comma-separated `config.bind_host`: an engine runs one server per address, one per NIC);
    with `secret`, only to peers that prove they know it."""

    def __init__(
        self,
        segment: LocalSegment,
        config: TransferConfig,
        hooks: ServerHooks,
        clock: Clock | None = None,
        *,
        secret: bytes | None = None,
        host: str = "",
        staging: StagingPool | None = None,
    ) -> None:
        """`staging`: the pinned chunks device memory is served through (None: a pool of
        this server's own)."""
        host = host or config.bind_hosts[0]
        super().__init__(host, config.port, "segment-server", config.max_server_connections, _TICK_S, secret)
        self._segment = segment
        self._config = config
        self._clock = clock or WallClock()
        self._hooks = hooks
        self._owns_staging = staging is None
        self._staging = staging if staging is not None else StagingPool("serve")
        self.endpoint = Endpoint(host, self.port)
        self.start()

    def serve(self, conn: socket.socket, addr: object) -> None:
        head = bytearray(wire.REQUEST.size)
        head_view = memoryview(head)
        deadline = [0.0]  # of the frame being served; read by `expired` on socket ticks
        clock, timeout_s, max_slice = self._clock, self._config.timeout_s, self._config.max_slice_bytes
        resolve, unpack, ok = self._segment.resolve_any, wire.REQUEST.unpack_from, wire.RESPONSE.pack

        def idle(got: int) -> bool:  # between frames: wait for ever; inside a header: not at all
            return self.closed or got > 0

        def expired(_: int = 0) -> bool:
            return self.closed or clock.now() >= deadline[0]

        acks: list[bytes | memoryview] = []  # answers held back while more requests are queued
        held = 0  # an upper bound on the read bytes in `acks` (a flush in _next_header leaves it as it was)
        try:
            while True:
                deadline[0] = clock.now() + timeout_s  # bounds a header that arrives in pieces
                self._next_header(conn, head_view, acks, idle, expired)
                deadline[0] = clock.now() + timeout_s
                magic, op, _flags, seq, offset, length = unpack(head)
                # NOTE: the hot path (a valid READ/WRITE in bounds) creates no objects per frame
                # beyond the packed answer.
                if magic == wire.MAGIC and op in _DATA_OPS and length <= max_slice:
                    try:
                        view = resolve(offset, length)
                    except OutOfBounds as exc:
                        self._flush(conn, acks, expired)
                        self._refuse(conn, wire.decode_request(head, max_slice), exc, expired)
                        continue
                    if view.__class__ is DeviceRange:  # NOTE: the one check host memory pays
                        self._flush(conn, acks, expired)
                        self._serve_device(conn, op, seq, view, expired)
                        continue
                    assert isinstance(view, memoryview)
                    if op == wire.Op.WRITE:
                        # NOTE: held read answers go first: they must carry the bytes from
                        # before this write, in the connection's order
                        if held or length >= _ACK_FLUSH_BYTES:  # and no acks held through a long payload
                            self._flush(conn, acks, expired)
                            held = 0
                        wire.recv_exact(conn, view, expired, strict=True)
                        acks.append(ok(wire.MAGIC, 0, 0, seq, 0))
                    else:  # NOTE: held only while the next request is already here (_next_header)
                        acks += (ok(wire.MAGIC, 0, 0, seq, length), view)
                        held += length
                        if held >= _READ_FLUSH_BYTES:
                            self._flush(conn, acks, expired)
                            held = 0
                else:  # control requests, and malformed frames (decode_request raises ProtocolError)
                    self._flush(conn, acks, expired)
                    self._control(conn, wire.decode_request(head, max_slice), expired)
        except ProtocolError as exc:
            logger.warning("closing connection from %s: %s", addr, exc)
        except OSError as exc:
            logger.debug("connection from %s ended: %s", addr, exc)

    def close(self, join_s: float = 5.0) -> None:
        super().close(join_s)
        if self._owns_staging:
            self._staging.close()

    def _serve_device(
        self, conn: socket.socket, op: int, seq: int, memory: DeviceRange, expired: Callable[[int], bool]
    ) -> None:
        """Serve one READ or WRITE of device memory through staging chunks (see the module).
        Raises OSError (the connection is then closed) when a chunk cannot be had or a device
        copy fails after the answer started."""
        device = backend(memory.device)
        pool = self._staging
        step = pool.chunk_bytes
        parts = [memory.sub(start, min(step, memory.length - start)) for start in range(0, memory.length, step)]
        pending: list[Future[None]] = []

        def chunk() -> memoryview:
            try:
                return pool.acquire(memory.kind, self._config.timeout_s)
            except TsukimiError as exc:
                raise TimeoutError(f"serving {memory.device} memory: {exc}") from exc

        def copy(job: Callable[[], None], taken: memoryview) -> Future[None]:
            def run() -> None:
                try:
                    job()
                finally:
                    pool.release(taken)

            return pool.copies.submit(run) if len(parts) > 1 else _now(run)

        if op == wire.Op.WRITE:
            error: TsukimiError | None = None
            for part in parts:
                if len(pending) >= 2:  # NOTE: two chunks per frame: one on the socket, one copying
                    error = error or _outcome(pending.pop(0))
                taken = chunk()
                view = taken[: part.length]
                wire.recv_exact(conn, view, expired, strict=True)
                pending.append(copy(functools.partial(device.from_host, part, view), taken))
            for future in pending:
                error = error or _outcome(future)
            status, body = (wire.Status.OK, b"") if error is None else (wire.Status.SERVER_ERROR, str(error).encode())
            self._reply(conn, wire.ResponseHeader(status, seq, 0), body, expired)
            return
        staged: list[tuple[Future[None], memoryview]] = []

        def stage(part: DeviceRange) -> None:
            taken = chunk()
            view = taken[: part.length]
            job = functools.partial(device.to_host, part, view)
            future = pool.copies.submit(job) if len(parts) > 1 else _now(job)
            staged.append((future, taken))

        stage(parts[0])
        first = _outcome(staged[0][0])
        if first is not None:
            pool.release(staged.pop()[1])
            self._reply(conn, wire.ResponseHeader(wire.Status.SERVER_ERROR, seq, 0), str(first).encode(), expired)
            return
        wire.send_all(conn, [wire.RESPONSE.pack(wire.MAGIC, 0, 0, seq, memory.length)], lambda: expired(0))
        try:
            for i, part in enumerate(parts):
                if i + 1 < len(parts):
                    stage(parts[i + 1])
                future, taken = staged[0]
                failed = _outcome(future)
                if failed is not None:
                    raise OSError(f"copy from {memory.device} failed mid-answer: {failed}")
                wire.send_all(conn, [taken[: part.length]], lambda: expired(0))
                pool.release(staged.pop(0)[1])
        finally:
            for future, taken in staged:
                future.exception()  # NOTE: wait: the copy must end before its chunk is reused
                pool.release(taken)

    @staticmethod
    def _next_header(
        conn: socket.socket,
        head: memoryview,
        acks: list[bytes | memoryview],
        idle: Callable[[int], bool],
        expired: Callable[[int], bool],
    ) -> None:
        """Read the next request header. Held-back acks go out first unless another request
        is already waiting (then one peer wake-up covers several acks)."""
        got = 0
        if acks:
            try:
                got = conn.recv_into(head, len(head), socket.MSG_DONTWAIT)
            except BlockingIOError:
                got = 0
            else:
                if got == 0:
                    raise ConnectionResetError("peer closed the connection")
            if got == 0:
                SegmentServer._flush(conn, acks, expired)
        if got == 0:
            wire.recv_exact(conn, head, idle)
        elif got < len(head):
            wire.recv_exact(conn, head[got:], expired, strict=True)

    @staticmethod
    def _flush(conn: socket.socket, acks: list[bytes | memoryview], expired: Callable[[int], bool]) -> None:
        if acks:
            wire.send_all(conn, acks, lambda: expired(0))
            acks.clear()

    def _refuse(
        self, conn: socket.socket, req: wire.RequestHeader, exc: OutOfBounds, expired: Callable[[int], bool]
    ) -> None:
        """Answer OUT_OF_BOUNDS; a write's payload is drained so the stream stays in sync."""
        if req.op is wire.Op.WRITE:
            scratch = memoryview(bytearray(max(1, min(req.length, _DRAIN_BYTES))))
            left = req.length
            while left > 0:
                chunk = min(left, len(scratch))
                wire.recv_exact(conn, scratch[:chunk], expired, strict=True)
                left -= chunk
        self._reply(conn, wire.ResponseHeader(wire.Status.OUT_OF_BOUNDS, req.seq, 0), str(exc).encode(), expired)

    def _control(self, conn: socket.socket, req: wire.RequestHeader, expired: Callable[[int], bool]) -> None:
        """Answer a HANDSHAKE, NOTIFY or PING (decode_request let only valid frames through)."""
        assert req.op not in _DATA_OPS
        body = bytearray(req.length)
        wire.recv_exact(conn, memoryview(body), expired, strict=True)
        status, answer = wire.Status.OK, b""
        if req.op is wire.Op.HANDSHAKE:
            status, answer = self._handshake(bytes(body))
        elif req.op is wire.Op.NOTIFY:
            try:
                name, message = wire.decode_notification(body)
            except ProtocolError as exc:
                status, answer = wire.Status.BAD_REQUEST, f"bad notification: {exc}".encode()
            else:
                if not self._hooks.on_notify(Notification(name, message)):
                    status, answer = wire.Status.BUSY, b"the notification queue is full"
        self._reply(conn, wire.ResponseHeader(status, req.seq, 0), answer, expired)

    def _handshake(self, body: bytes) -> tuple[wire.Status, bytes]:
        if body:
            try:
                self._hooks.on_handshake(body)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                return wire.Status.BAD_REQUEST, f"bad descriptor: {exc}".encode()
        return wire.Status.OK, self._hooks.describe()

    @staticmethod
    def _reply(
        conn: socket.socket, head: wire.ResponseHeader, body: bytes | memoryview, expired: Callable[[int], bool]
    ) -> None:
        """Send a response; an error reason is cut to MAX_REASON_BYTES."""
        if head.status is not wire.Status.OK:
            body = bytes(body[: wire.MAX_REASON_BYTES])
        head = wire.ResponseHeader(head.status, head.seq, len(body))
        wire.send_all(conn, [head.pack(), body], lambda: expired(0))
