"""The RPC server: a TCP listener, one thread per connection, one handler called under one lock.

Each connection's thread reads a frame (tsukimi/rpc/frame.py), decodes the request, calls
the handler and writes the reply with the request's id. Idle connections stay open; a frame
once started must arrive within `_FRAME_TIMEOUT_S`.

NOTE: handler calls are serialized by `_handler_lock`: the handler sees one request at a
time, each connection's requests in their order, and requests of different connections in
the order the lock grants (about arrival order). The master's state machine relies on this
and takes no lock of its own; a handler that blocks stalls the whole service, so handlers
must be quick.

After answering, a connection's thread may poll for that client's next frame for `spin_s`
before sleeping in recv (see `FrameReader.spin`): a client that calls again within that
window is served without a wake-up. It polls only while the client's previous call came
within the window, and at most `spinners` threads poll at once (a semaphore taken without
waiting): polling costs at most that many CPUs while clients are busy, none when they idle.

With a cluster secret, a connection is served only once the client passed the handshake
(tsukimi/auth.py, run by netserver.ConnectionServer): a client without the secret, or with
another one, is refused before its first frame is read, and the handler never sees it.

A well-delimited frame that does not decode is answered with `ErrorReply("protocol", ...)`;
a `TsukimiError` from the handler with `ErrorReply(exc.code, str(exc))`; any other exception
is logged and answered with `ErrorReply("internal", ...)`. A frame whose length is over the
limit, or that stalls, closes its connection only. Nothing a peer sends stops the service.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from types import TracebackType

import msgspec

from tsukimi import netserver
from tsukimi.clock import WallClock
from tsukimi.errors import ConfigError, ProtocolError, TsukimiError
from tsukimi.rpc.codec import Codec, ErrorReply
from tsukimi.rpc.frame import FrameReader, format_endpoint, parse_endpoint, send_frame

logger = logging.getLogger(__name__)

_TICK_S = 0.5  # blocked socket calls wake up this often to check close() and the frame deadline
_FRAME_TIMEOUT_S = 30.0  # a started frame (and the reply to it) must complete within this
_MAX_CONNECTIONS = 1024
_JOIN_S = 5.0  # close() waits at most this long for all threads together
_MAX_ERROR_CHARS = 16 << 10  # an error reply must always fit in a frame

Handler = Callable[[msgspec.Struct], msgspec.Struct]


class RpcServer(netserver.ConnectionServer):
    """Serves `handler` on a TCP socket bound to `bind`; starts serving at once.

    Args:
        codec: decodes requests and encodes replies.
        handler: maps one request to its response; never called concurrently (see the module).
        bind: "tcp://HOST:PORT"; port 0 picks a free port (see `endpoint`).
        name: names the threads and the log lines.
        spin_s / spinners: poll this long for a connection's next frame, in at most this
            many threads at once (see the module); 0 never polls.
        settle: called on the connection's thread after each handler call, outside the
            handler lock, before the reply is sent; a TsukimiError it raises is the reply.
        secret: the cluster secret every client must prove it knows; None admits anyone
            (and refuses clients that have a secret: authentication is mutual).

    Raises:
        ConfigError: the endpoint is malformed or cannot be bound (bad address, port in use),
            or `spin_s` / `spinners` is negative.
    """

    def __init__(
        self,
        codec: Codec,
        handler: Handler,
        bind: str = "tcp://127.0.0.1:0",
        name: str = "rpc",
        spin_s: float = 0.0,
        spinners: int = 1,
        *,
        secret: bytes | None = None,
        settle: Callable[[], None] | None = None,
    ) -> None:
        if not (0 <= spin_s < 1 and spinners >= 0):
            raise ConfigError(f"rpc server {name!r}: spin_s must be in [0, 1) and spinners >= 0")
        self._spin_s = spin_s if spinners else 0.0
        self._spinners = threading.BoundedSemaphore(max(1, spinners))
        host, port = parse_endpoint(bind)
        try:
            super().__init__(host, port, f"rpc-{name}", _MAX_CONNECTIONS, _TICK_S, secret)
        except OSError as exc:
            raise ConfigError(f"rpc server {name!r} cannot bind {bind!r}: {exc}") from exc
        self._codec = codec
        self._handler = handler
        self._settle = settle
        self._name = name
        self._clock = WallClock()
        self._handler_lock = threading.Lock()
        self._endpoint = format_endpoint(host, self.port)
        self.start()
        logger.info("rpc server %s serving on %s%s", name, self._endpoint, " (cluster secret)" if secret else "")

    @property
    def endpoint(self) -> str:
        """The bound endpoint, with the real port, e.g. "tcp://127.0.0.1:40123"."""
        return self._endpoint

    def close(self, join_s: float = _JOIN_S) -> None:
        """Stop serving and drop every connection (mutates; idempotent; waits at most ~5 s).

        A handler call in progress is finished (its reply is dropped); frames not yet handled
        are dropped.
        """
        super().close(join_s)

    def __enter__(self) -> RpcServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def serve(self, conn: socket.socket, addr: object) -> None:
        reader = FrameReader(conn, self._codec.max_frame_bytes)
        clock = self._clock
        started: list[float | None] = [None]  # when the frame being read was first seen partial
        reply_deadline = [0.0]

        def expired(partial: bool) -> bool:  # idle: wait for ever; inside a frame: up to the bound
            if self.closed:
                return True
            if not partial:
                return False
            now = clock.now()
            if started[0] is None:
                started[0] = now
                return False
            return now - started[0] >= _FRAME_TIMEOUT_S

        def send_expired() -> bool:
            return self.closed or clock.now() >= reply_deadline[0]

        answered, gap = clock.now(), 0.0  # gap: from our last reply to the client's next frame
        try:
            while True:
                started[0] = None
                # NOTE: polls only while this client's last call came within the window, so
                # a client that calls rarely costs no polling after its first slow call.
                if gap <= self._spin_s and self._spinners.acquire(blocking=False):
                    try:
                        reader.spin(self._spin_s)
                    finally:
                        self._spinners.release()
                request_id, payload = reader.read(expired)
                gap = clock.now() - answered
                reply = self._reply_to(payload)
                if reply is None:  # closed while waiting for the handler
                    return
                reply_deadline[0] = clock.now() + _FRAME_TIMEOUT_S
                send_frame(conn, request_id, reply, send_expired)
                answered = clock.now()
        except ProtocolError as exc:
            logger.warning("rpc server %s: closing the connection from %s: %s", self._name, addr, exc)
        except OSError as exc:  # the peer left, a frame stalled (TimeoutError), or close()
            logger.debug("rpc server %s: connection from %s ended: %s", self._name, addr, exc)

    def _reply_to(self, payload: memoryview) -> bytes | None:
        """The encoded reply to one request frame; None when the server closed meanwhile."""
        try:
            request = self._codec.decode_request(payload)
        except TsukimiError as exc:
            logger.debug("rpc server %s: %s", self._name, exc)
            return self._error(exc.code, str(exc))
        logger.debug("rpc server %s: %s", self._name, type(request).__name__)
        with self._handler_lock:
            if self.closed:
                return None
            reply = self._handle(request)
        if self._settle is not None:
            # NOTE: outside the handler lock: a handler whose effect must become durable
            # before it is answered (the HA master) waits here while others are handled.
            try:
                self._settle()
            except TsukimiError as exc:
                return self._error(exc.code, str(exc))
        return reply

    def _handle(self, request: msgspec.Struct) -> bytes:
        try:
            return self._codec.encode(self._handler(request))
        except TsukimiError as exc:
            return self._error(exc.code, str(exc))
        except Exception as exc:
            # NOTE: the one place where catching Exception is right: a bug in one handler
            # call must not stop the service for every other caller.
            logger.exception("rpc server %s: handler failed on %s", self._name, type(request).__name__)
            return self._error("internal", f"{type(exc).__name__}: {exc}")

    @staticmethod
    def _error(code: str, message: str) -> bytes:
        # NOTE: bypasses the codec's frame limit so that answering can never raise; the
        # truncation keeps the frame small.
        return msgspec.msgpack.encode(ErrorReply(code[:_MAX_ERROR_CHARS], message[:_MAX_ERROR_CHARS]))
