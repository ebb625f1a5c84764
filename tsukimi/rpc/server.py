"""The RPC server: one zmq ROUTER socket, one background thread, one handler.

Wire format (one zmq multipart message each way)::

    request  [routing envelope ..., payload]   envelope = ROUTER identity + whatever the
    reply    [routing envelope ..., payload]   client put before the payload (RpcClient: a
                                               request id), echoed back unchanged

NOTE: the handler runs on the single server thread, so it sees requests strictly one at a
time, in arrival order. The master's state machine relies on this and takes no lock of its
own; a handler that blocks stalls the whole service, so handlers must be quick.

A malformed frame is answered with `ErrorReply("protocol", ...)`; a `TsukimiError` from the
handler with `ErrorReply(exc.code, str(exc))`; any other exception is logged and answered
with `ErrorReply("internal", ...)`. Nothing a peer sends stops the loop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import TracebackType

import msgspec
import zmq

from tsukimi.errors import ConfigError, TsukimiError
from tsukimi.rpc.codec import Codec, ErrorReply

logger = logging.getLogger(__name__)

_POLL_MS = 50  # how often the loop checks for close(); bounds close() latency
_MAX_BATCH = 256  # requests served per poll wakeup before checking for close() again
_JOIN_S = 5.0
_MAX_ERROR_CHARS = 16 << 10  # an error reply must always fit in a frame

Handler = Callable[[msgspec.Struct], msgspec.Struct]


class RpcServer:
    """Serves `handler` on a ROUTER socket bound to `bind`; starts serving at once.

    Args:
        codec: decodes requests and encodes replies.
        handler: maps one request to its response; called on the server thread only.
        bind: a zmq endpoint; port 0 picks a free port (see `endpoint`).
        name: names the thread and the log lines.

    Raises:
        ConfigError: the endpoint cannot be bound (bad address, port in use).
    """

    def __init__(self, codec: Codec, handler: Handler, bind: str = "tcp://127.0.0.1:0", name: str = "rpc") -> None:
        self._codec = codec
        self._handler = handler
        self._name = name
        self._stop = threading.Event()
        self._close_lock = threading.Lock()
        self._closed = False
        socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        # NOTE: zmq drops a peer that sends a bigger frame instead of buffering it.
        socket.setsockopt(zmq.MAXMSGSIZE, codec.max_frame_bytes)
        try:
            socket.bind(bind)
        except zmq.ZMQError as exc:
            socket.close()
            raise ConfigError(f"rpc server {name!r} cannot bind {bind!r}: {exc}") from exc
        self._endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        # NOTE: from here on only the server thread touches the socket (starting a thread
        # is a full memory barrier, which is all zmq asks of a socket moving threads).
        self._socket = socket
        self._thread = threading.Thread(target=self._serve, name=f"tsukimi-rpc-{name}", daemon=True)
        self._thread.start()
        logger.info("rpc server %s serving on %s", name, self._endpoint)

    @property
    def endpoint(self) -> str:
        """The bound endpoint, with the real port, e.g. "tcp://127.0.0.1:40123"."""
        return self._endpoint

    def close(self) -> None:
        """Stop serving and close the socket (mutates; idempotent; waits at most ~5 s).

        A request being handled is finished first; requests not yet read are dropped.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=_JOIN_S)
            if self._thread.is_alive():
                logger.warning("rpc server %s: handler still busy after %.1f s; left running", self._name, _JOIN_S)
        logger.info("rpc server %s on %s closed", self._name, self._endpoint)

    def __enter__(self) -> RpcServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._socket.poll(_POLL_MS, zmq.POLLIN):
                    continue
                for _ in range(_MAX_BATCH):
                    try:
                        frames = self._socket.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._serve_one(frames)
                    if self._stop.is_set():
                        break
        except zmq.ZMQError:
            if not self._stop.is_set():
                logger.exception("rpc server %s: socket failed; no longer serving", self._name)
        finally:
            self._socket.close(linger=0)

    def _serve_one(self, frames: list[bytes]) -> None:
        if len(frames) < 2:  # a ROUTER always prepends the identity; nothing to answer
            logger.debug("rpc server %s: dropped a message of %d frame(s)", self._name, len(frames))
            return
        envelope, payload = frames[:-1], frames[-1]
        reply = self._reply_to(payload)
        try:
            self._socket.send_multipart([*envelope, reply], zmq.NOBLOCK)
        except zmq.Again:  # the peer's queue is full; it will time out and retry
            logger.debug("rpc server %s: reply dropped, peer not reading", self._name)

    def _reply_to(self, payload: bytes) -> bytes:
        try:
            request = self._codec.decode_request(payload)
        except TsukimiError as exc:
            logger.debug("rpc server %s: %s", self._name, exc)
            return self._error(exc.code, str(exc))
        logger.debug("rpc server %s: %s", self._name, type(request).__name__)
        try:
            return self._codec.encode(self._handler(request))
        except TsukimiError as exc:
            return self._error(exc.code, str(exc))
        except Exception as exc:
            # NOTE: the one place where catching Exception is right: a bug in one handler
            # call must not stop the service for every other caller.
            logger.exception("rpc server %s: handler failed on %s", self._name, type(request).__name__)
            return self._error("internal", f"{type(exc).__name__}: {exc}")

    def _error(self, code: str, message: str) -> bytes:
        # NOTE: bypasses the codec's frame limit so that answering can never raise; the
        # truncation keeps the frame small.
        return msgspec.msgpack.encode(ErrorReply(code[:_MAX_ERROR_CHARS], message[:_MAX_ERROR_CHARS]))
