"""The RPC server: a TCP listener, one thread per connection, one handler called under one lock.

Each connection's thread reads a frame (tsukimi/rpc/frame.py), decodes the request, calls
the handler and writes the reply with the request's id. Idle connections stay open; a frame
once started must arrive within `_FRAME_TIMEOUT_S`.

NOTE: handler calls are serialized by `_handler_lock`: the handler sees one request at a
time, each connection's requests in their order, and requests of different connections in
the order the lock grants (about arrival order). The master's state machine relies on this
and takes no lock of its own; a handler that blocks stalls the whole service, so handlers
must be quick.

A well-delimited frame that does not decode is answered with `ErrorReply("protocol", ...)`;
a `TsukimiError` from the handler with `ErrorReply(exc.code, str(exc))`; any other exception
is logged and answered with `ErrorReply("internal", ...)`. A frame whose length is over the
limit, or that stalls, closes its connection only. Nothing a peer sends stops the service.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from types import TracebackType

import msgspec

from tsukimi import netio
from tsukimi.clock import WallClock
from tsukimi.errors import ConfigError, ProtocolError, TsukimiError
from tsukimi.rpc.codec import Codec, ErrorReply
from tsukimi.rpc.frame import FrameReader, format_endpoint, parse_endpoint, send_frame

logger = logging.getLogger(__name__)

_TICK_S = 0.5  # blocked socket calls wake up this often to check close() and the frame deadline
_FRAME_TIMEOUT_S = 30.0  # a started frame (and the reply to it) must complete within this
_MAX_CONNECTIONS = 1024
_ACCEPT_BACKOFF_S = 0.05
_JOIN_S = 5.0  # close() waits at most this long for all threads together
_MAX_ERROR_CHARS = 16 << 10  # an error reply must always fit in a frame

Handler = Callable[[msgspec.Struct], msgspec.Struct]


class RpcServer:
    """Serves `handler` on a TCP socket bound to `bind`; starts serving at once.

    Args:
        codec: decodes requests and encodes replies.
        handler: maps one request to its response; never called concurrently (see the module).
        bind: "tcp://HOST:PORT"; port 0 picks a free port (see `endpoint`).
        name: names the threads and the log lines.

    Raises:
        ConfigError: the endpoint is malformed or cannot be bound (bad address, port in use).
    """

    def __init__(self, codec: Codec, handler: Handler, bind: str = "tcp://127.0.0.1:0", name: str = "rpc") -> None:
        host, port = parse_endpoint(bind)
        self._codec = codec
        self._handler = handler
        self._name = name
        self._clock = WallClock()
        self._handler_lock = threading.Lock()
        self._lock = threading.Lock()  # guards _closed, _conns and _threads
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._listener = socket.create_server((host, port), family=family, backlog=128)
        except OSError as exc:
            raise ConfigError(f"rpc server {name!r} cannot bind {bind!r}: {exc}") from exc
        self._endpoint = format_endpoint(host, self._listener.getsockname()[1])
        self._acceptor = threading.Thread(target=self._accept, name=f"tsukimi-rpc-{name}", daemon=True)
        self._acceptor.start()
        logger.info("rpc server %s serving on %s", name, self._endpoint)

    @property
    def endpoint(self) -> str:
        """The bound endpoint, with the real port, e.g. "tcp://127.0.0.1:40123"."""
        return self._endpoint

    def close(self) -> None:
        """Stop serving and drop every connection (mutates; idempotent; waits at most ~5 s).

        A handler call in progress is finished (its reply is dropped); frames not yet handled
        are dropped.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns, threads = list(self._conns), list(self._threads)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes recv(); the connection's thread closes it
        deadline = self._clock.now() + _JOIN_S
        for thread in (self._acceptor, *threads):
            if thread is not threading.current_thread():
                thread.join(timeout=max(0.0, deadline - self._clock.now()))
        self._listener.close()
        if any(thread.is_alive() for thread in threads):
            logger.warning("rpc server %s: a handler is still busy after %.1f s; left running", self._name, _JOIN_S)
        logger.info("rpc server %s on %s closed", self._name, self._endpoint)

    def __enter__(self) -> RpcServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, addr = self._listener.accept()
            except OSError as exc:
                if self._closed:
                    return
                # EMFILE, ECONNABORTED, ENOBUFS...: keep serving once the pressure eases
                logger.warning("rpc server %s: accept failed: %s", self._name, exc)
                self._clock.sleep(_ACCEPT_BACKOFF_S)
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            netio.set_io_timeout(conn, _TICK_S)
            thread = threading.Thread(
                target=self._serve, args=(conn, addr), name=f"tsukimi-rpc-{self._name}-conn", daemon=True
            )
            with self._lock:  # NOTE: started under the lock, so close() never joins an unstarted thread
                if self._closed or len(self._conns) >= _MAX_CONNECTIONS:
                    logger.warning("rpc server %s: refusing %s: closed or at the connection limit", self._name, addr)
                    conn.close()
                    continue
                self._conns.add(conn)
                self._threads.add(thread)
                thread.start()

    def _serve(self, conn: socket.socket, addr: object) -> None:
        reader = FrameReader(conn, self._codec.max_frame_bytes)
        clock = self._clock
        started: list[float | None] = [None]  # when the frame being read was first seen partial
        reply_deadline = [0.0]

        def expired(partial: bool) -> bool:  # idle: wait for ever; inside a frame: up to the bound
            if self._closed:
                return True
            if not partial:
                return False
            now = clock.now()
            if started[0] is None:
                started[0] = now
                return False
            return now - started[0] >= _FRAME_TIMEOUT_S

        def send_expired() -> bool:
            return self._closed or clock.now() >= reply_deadline[0]

        try:
            while True:
                started[0] = None
                request_id, payload = reader.read(expired)
                reply = self._reply_to(payload)
                if reply is None:  # closed while waiting for the handler
                    return
                reply_deadline[0] = clock.now() + _FRAME_TIMEOUT_S
                send_frame(conn, request_id, reply, send_expired)
        except ProtocolError as exc:
            logger.warning("rpc server %s: closing the connection from %s: %s", self._name, addr, exc)
        except OSError as exc:  # the peer left, a frame stalled (TimeoutError), or close()
            logger.debug("rpc server %s: connection from %s ended: %s", self._name, addr, exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())
            conn.close()

    def _reply_to(self, payload: memoryview) -> bytes | None:
        """The encoded reply to one request frame; None when the server closed meanwhile."""
        try:
            request = self._codec.decode_request(payload)
        except TsukimiError as exc:
            logger.debug("rpc server %s: %s", self._name, exc)
            return self._error(exc.code, str(exc))
        logger.debug("rpc server %s: %s", self._name, type(request).__name__)
        with self._handler_lock:
            if self._closed:
                return None
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
