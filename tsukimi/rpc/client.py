"""The RPC client: blocking calls with deadlines over one zmq DEALER socket.

Each call sends ``[request id, payload]`` and waits for the reply that echoes the same id
(see tsukimi/rpc/server.py for the wire format). Two guards keep a late reply to a
timed-out call from ever answering a later call:

- ids are never reused, and a reply whose id is not the current call's is discarded;
- on a timeout the socket is closed (LINGER 0, so queued requests and late replies are
  dropped) and a fresh one is connected, so the server's late reply goes to an identity
  that no longer exists and ROUTER drops it.

Calls on one client are serialized by a lock (the server handles one request at a time
anyway); time spent waiting for the lock counts against the call's deadline.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
from types import TracebackType
from typing import TypeVar

import msgspec
import zmq

from tsukimi.clock import WallClock
from tsukimi.errors import ClosedError, ConfigError, ProtocolError, RpcTimeout, error_from_code
from tsukimi.rpc.codec import Codec, ErrorReply

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=msgspec.Struct)

_SLICE_S = 0.1  # a waiting call checks for close() this often
_CLOSE_WAIT_S = 2.0


class RpcClient:
    """Calls the `RpcServer` at `endpoint`. Thread-safe; connects lazily (no I/O here).

    Args:
        codec: the same message types as the server's codec.
        endpoint: e.g. "tcp://127.0.0.1:40123".
        timeout_s: the default deadline of a call, in seconds.

    Raises:
        ConfigError: `timeout_s` is not positive and finite or `endpoint` is not a valid zmq endpoint.
    """

    def __init__(self, codec: Codec, endpoint: str, timeout_s: float = 5.0) -> None:
        _check_timeout(timeout_s)
        self._codec = codec
        self._endpoint = endpoint
        self._timeout_s = timeout_s
        self._clock = WallClock()
        self._lock = threading.Lock()  # guards the socket and the id counter
        self._ids = itertools.count(1)
        self._closed = False
        self._socket: zmq.Socket[bytes] | None = self._connect()

    @property
    def endpoint(self) -> str:
        """The server endpoint this client calls."""
        return self._endpoint

    def call(self, request: msgspec.Struct, timeout_s: float | None = None) -> msgspec.Struct:
        """Send `request` and return the server's response (blocks up to the deadline).

        Args:
            request: one of the codec's request types.
            timeout_s: the deadline for this call; the client's default when None.

        Returns:
            The decoded response (one of the codec's response types).

        Raises:
            RpcTimeout: no reply before the deadline (the socket is reset).
            TsukimiError: the server answered with an error: the same class as raised there;
                `PeerError` for codes this side does not know (e.g. "internal").
            ProtocolError: the reply frame is malformed or of an undeclared type.
            ClosedError: the client is closed, or was closed during the call.
        """
        timeout = self._timeout_s if timeout_s is None else timeout_s
        _check_timeout(timeout)
        deadline = self._clock.now() + timeout
        payload = self._codec.encode(request)
        if self._closed:
            raise ClosedError(f"rpc client to {self._endpoint} is closed")
        if not self._lock.acquire(timeout=timeout):
            raise RpcTimeout(f"{type(request).__name__} to {self._endpoint}: client busy for {timeout:.3f} s")
        try:
            reply = self._exchange(request, payload, deadline, timeout)
        finally:
            if self._closed and self._socket is not None:
                self._socket.close(linger=0)
                self._socket = None
            self._lock.release()
        if isinstance(reply, ErrorReply):
            raise error_from_code(reply.code, reply.message)
        return reply

    def call_as(self, request: msgspec.Struct, response_type: type[T], timeout_s: float | None = None) -> T:
        """`call`, then check that the response is a `response_type`.

        Raises:
            ProtocolError: the server answered with another response type.
            (and everything `call` raises)
        """
        reply = self.call(request, timeout_s)
        if not isinstance(reply, response_type):
            raise ProtocolError(
                f"{type(request).__name__} to {self._endpoint}: expected {response_type.__name__}, "
                f"got {type(reply).__name__}"
            )
        return reply

    def close(self) -> None:
        """Close the socket (mutates; idempotent; never blocks on the network).

        A call in flight on another thread ends within ~0.1 s with `ClosedError`.
        """
        if self._closed:
            return
        self._closed = True
        if self._lock.acquire(timeout=_CLOSE_WAIT_S):
            try:
                if self._socket is not None:
                    self._socket.close(linger=0)
                    self._socket = None
            finally:
                self._lock.release()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _connect(self) -> zmq.Socket[bytes]:
        socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, self._codec.max_frame_bytes)
        try:
            socket.connect(self._endpoint)
        except zmq.ZMQError as exc:
            socket.close()
            raise ConfigError(f"invalid rpc endpoint {self._endpoint!r}: {exc}") from exc
        return socket

    def _reset(self) -> None:
        """Replace the socket, dropping whatever is queued on it (caller holds the lock)."""
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        self._socket = self._connect()

    def _exchange(self, request: msgspec.Struct, payload: bytes, deadline: float, timeout: float) -> msgspec.Struct:
        """Send one request and wait for its reply (caller holds the lock)."""
        if self._closed or self._socket is None:
            raise ClosedError(f"rpc client to {self._endpoint} is closed")
        socket = self._socket
        request_id = next(self._ids).to_bytes(8, "big")
        # NOTE: send may block when the queue to an absent server is full; wait for room
        # within the deadline like for the reply.
        if self._wait(socket, zmq.POLLOUT, deadline):
            socket.send_multipart([request_id, payload], zmq.NOBLOCK)
            while self._wait(socket, zmq.POLLIN, deadline):
                frames = socket.recv_multipart(zmq.NOBLOCK)
                if len(frames) == 2 and frames[0] == request_id:
                    return self._codec.decode_response(frames[1])
                logger.debug("rpc client to %s: discarded a stale or malformed reply", self._endpoint)
        self._reset()
        raise RpcTimeout(f"{type(request).__name__} to {self._endpoint}: no reply within {timeout:.3f} s")

    def _wait(self, socket: zmq.Socket[bytes], event: int, deadline: float) -> bool:
        """Poll `socket` for `event` until the deadline: True when ready, False when late.

        Raises:
            ClosedError: `close()` was called meanwhile.
        """
        while True:
            if self._closed:
                raise ClosedError(f"rpc client to {self._endpoint} was closed during a call")
            remaining = deadline - self._clock.now()
            if remaining <= 0:
                return False
            if socket.poll(max(1, round(min(remaining, _SLICE_S) * 1000)), event):
                return True


def _check_timeout(timeout_s: float) -> None:
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ConfigError(f"timeout_s must be positive and finite, got {timeout_s}")
