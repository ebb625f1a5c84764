"""The RPC client: blocking calls with deadlines over one persistent TCP connection.

Each call sends one frame (tsukimi/rpc/frame.py) and reads the one reply, which must echo
the call's request id. The connection is opened on the first call and again after any
failure. Calls on one client are serialized by a lock; time spent waiting for it counts
against the call's deadline.

A late reply can never answer a later call: request ids are never reused, and a call that
fails after sending (timeout, bad reply, broken connection) closes the connection, so a
late reply has nowhere to arrive. A reply with another id is a `ProtocolError`.

Delivery is at most once: while the request surely has not reached the server (nothing
listening, the connection found dead before sending, a send that failed), the call tries
again under its `Retry` policy (by default every 20 ms until its deadline), then raises
`RpcTimeout`; once the whole request is sent, a dropped connection raises
`BrokenConnectionError` at once, never a resend, since the server may have acted on it.

Each new connection first runs the cluster-secret handshake (tsukimi/auth.py), bounded by
the call's deadline. An `AuthError` (a secret missing on one side, or a wrong one) raises at
once: nothing was sent, but retrying cannot help.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import math
import os
import select
import socket
import threading
from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

import msgspec

from tsukimi import auth, netio
from tsukimi.clock import WallClock
from tsukimi.errors import (
    BrokenConnectionError,
    ClosedError,
    ConfigError,
    ProtocolError,
    RpcTimeout,
    error_from_code,
)
from tsukimi.retry import Retry
from tsukimi.rpc.codec import Codec, ErrorReply
from tsukimi.rpc.frame import FrameReader, parse_endpoint, send_frame

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=msgspec.Struct)

_TICK_S = 0.02  # blocked socket calls wake up this often: bounds how late a deadline is noticed
_CLOSE_WAIT_S = 2.0
DEFAULT_SPIN_S = 250e-6  # a master answers a small call in ~20-100 us


class _NotSent(Exception):
    """The request surely did not reach the server; the call may try again. Wraps the OSError."""


UNSENT_RETRY = Retry(attempts=None, backoff_s=0.02, max_backoff_s=0.02, on=(_NotSent,))
"""The default: a request that surely was not sent is tried again every 20 ms until the call's deadline."""
NO_RETRY = Retry(attempts=1)


class RpcClient:
    """Calls the `RpcServer` at `endpoint`. Thread-safe; connects lazily (no I/O here).

    Args:
        codec: the same message types as the server's codec.
        endpoint: e.g. "tcp://127.0.0.1:40123".
        timeout_s: the default deadline of a call, in seconds.
        spin_s: how long a call polls for its reply before it sleeps on the socket (see
            `FrameReader.spin`): replies faster than this skip a wake-up (~50 us on a VM)
            at the price of this much CPU per call at most; 0 never polls.
        secret: the cluster secret, proven to (and by) the server on every connection;
            None talks only to servers without one.
        retry: when a request that surely was not sent is tried again (bounded by the call's
            deadline). `NO_RETRY` fails a call at once (RpcTimeout) when the server is
            unreachable: for a caller that can go elsewhere (the store's MasterLink, which
            then looks for the new leader).

    Raises:
        ConfigError: `timeout_s` is not positive and finite, `spin_s` is negative or not
            finite, or `endpoint` is not tcp://HOST:PORT.
    """

    def __init__(
        self,
        codec: Codec,
        endpoint: str,
        timeout_s: float = 5.0,
        spin_s: float = DEFAULT_SPIN_S,
        *,
        secret: bytes | None = None,
        retry: Retry = UNSENT_RETRY,
    ) -> None:
        _check_timeout(timeout_s)
        if not (spin_s >= 0 and math.isfinite(spin_s)):
            raise ConfigError(f"spin_s must be >= 0 and finite, got {spin_s}")
        self._spin_s = spin_s
        self._secret = secret
        self._address = parse_endpoint(endpoint)
        self._codec = codec
        self._endpoint = endpoint
        self._timeout_s = timeout_s
        self._clock = WallClock()
        self._lock = threading.Lock()  # serializes calls: guards the connection and the id counter
        self._sock_lock = threading.Lock()  # guards _sock between a call and close()
        self._closing = threading.Event()
        self._ids = itertools.count(1)
        self._sock: socket.socket | None = None  # set as soon as connecting starts, for close()
        self._conn: _Connection | None = None  # once connected
        self._retry = retry

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
            RpcTimeout: no reply before the deadline (the connection is closed), or the server
                could not be reached before it.
            BrokenConnectionError: the connection dropped after the request was sent (the
                request may or may not have been acted on).
            AuthError: the handshake failed: this side or the server lacks the cluster secret,
                or they differ (raised at once; the request was not sent).
            TsukimiError: the server answered with an error: the same class as raised there;
                `PeerError` for codes this side does not know (e.g. "internal").
            ProtocolError: the reply is malformed, of an undeclared type, or for another request.
            ClosedError: the client is closed, or was closed during the call.
        """
        timeout = self._timeout_s if timeout_s is None else timeout_s
        _check_timeout(timeout)
        deadline = self._clock.now() + timeout
        payload = self._codec.encode(request)
        if self._closing.is_set():
            raise ClosedError(f"rpc client to {self._endpoint} is closed")
        if not self._lock.acquire(timeout=timeout):
            raise RpcTimeout(f"{type(request).__name__} to {self._endpoint}: client busy for {timeout:.3f} s")
        try:
            reply = self._exchange(request, payload, deadline, timeout)
        finally:
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
        """Close the connection (mutates; idempotent; never blocks on the network).

        A call in flight on another thread ends promptly with `ClosedError`.
        """
        with self._sock_lock:
            if self._closing.is_set():
                return
            self._closing.set()
            sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a call blocked on it; its thread closes it
        # NOTE: the socket is closed only by whoever holds the call lock, never under a
        # thread blocked on it (its descriptor could be reused meanwhile).
        if self._lock.acquire(timeout=_CLOSE_WAIT_S):
            try:
                self._drop()
            finally:
                self._lock.release()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _exchange(self, request: msgspec.Struct, payload: bytes, deadline: float, timeout: float) -> msgspec.Struct:
        """Send one request and read its reply, reconnecting while it surely was not sent
        (caller holds the lock)."""
        request_id = next(self._ids)
        clock, closing = self._clock, self._closing

        def expired(_: object = None) -> bool:
            return closing.is_set() or clock.now() >= deadline

        attempts = self._retry.start(clock, deadline)
        while True:
            self._check_open()
            try:
                reader = self._send(request_id, payload, deadline, expired)
                break
            except _NotSent as exc:
                self._drop()
                if not attempts.wait(exc, closing):
                    self._check_open()
                    raise RpcTimeout(f"{self._what(request)}: unreachable for {timeout:.3f} s") from exc.__cause__
                logger.debug("rpc client %s: retrying: %s", self._what(request), exc.__cause__)
            except TimeoutError as exc:
                self._drop()
                self._check_open()
                raise RpcTimeout(f"{self._what(request)}: not sent within {timeout:.3f} s") from exc
            except BaseException:
                self._drop()
                raise
        try:
            reader.spin(self._spin_s)
            reply_id, body = reader.read(expired)
            if reply_id != request_id:
                raise ProtocolError(f"{self._what(request)}: reply for request {reply_id}, expected {request_id}")
            if reader.buffered_bytes:
                raise ProtocolError(f"{self._what(request)}: {reader.buffered_bytes} unexpected bytes after the reply")
            return self._codec.decode_response(body)
        except TimeoutError as exc:
            self._drop()
            self._check_open()
            raise RpcTimeout(f"{self._what(request)}: no reply within {timeout:.3f} s") from exc
        except OSError as exc:
            self._drop()
            self._check_open()
            raise BrokenConnectionError(f"{self._what(request)}: connection lost awaiting the reply: {exc}") from exc
        except BaseException:
            self._drop()
            raise

    def _send(self, request_id: int, payload: bytes, deadline: float, expired: Callable[[], bool]) -> FrameReader:
        """Send the whole request on a live connection, opening one if needed; returns the
        connection's reader (caller holds the lock).

        Raises:
            _NotSent: the request did not (fully) leave; the connection is unusable.
            TimeoutError: the deadline passed while sending (a partial frame may be out).
            ClosedError: `close()` was called meanwhile.
        """
        conn = self._conn
        # NOTE: a kept connection the server has closed meanwhile (it restarted) is found
        # here, before sending, so that the request can go on a new one without ambiguity.
        if conn is None or not conn.idle_and_open():
            self._drop()
            conn = self._conn = _Connection(self._connect(deadline), self._codec.max_frame_bytes)
        try:
            send_frame(conn.sock, request_id, payload, expired)
        except TimeoutError:
            raise
        except OSError as exc:
            raise _NotSent from exc
        return conn.reader

    def _connect(self, deadline: float) -> socket.socket:
        """A connected, authenticated socket, registered for close() (caller holds the lock).

        Raises:
            _NotSent: no connection (refused, unreachable, timed out, unresolvable host, the
                server hung up or stalled in the handshake).
            AuthError: the handshake failed.
            ClosedError: `close()` was called meanwhile.
        """
        host, port = self._address
        try:
            family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        except OSError as exc:
            raise _NotSent from exc
        sock = socket.socket(family, kind, proto)
        with self._sock_lock:
            if self._closing.is_set():
                sock.close()
                raise ClosedError(f"rpc client to {self._endpoint} was closed during a call")
            self._sock = sock
        try:
            sock.setblocking(False)
            err = sock.connect_ex(address)
            poller = select.poll()
            poller.register(sock, select.POLLOUT)
            while err in (errno.EINPROGRESS, errno.EALREADY):
                self._check_open()
                remaining = deadline - self._clock.now()
                if remaining <= 0:
                    err = errno.ETIMEDOUT
                elif poller.poll(max(1, round(min(remaining, _TICK_S) * 1000))):
                    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise OSError(err, os.strerror(err))
            sock.setblocking(True)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            netio.set_io_timeout(sock, _TICK_S)
            expired = auth.deadline_expired(deadline, self._closing.is_set)
            auth.client_handshake(sock, self._secret, expired, f"rpc server {self._endpoint}")
        except OSError as exc:
            raise _NotSent from exc
        return sock

    def _drop(self) -> None:
        """Close the connection, if any (caller holds the lock)."""
        with self._sock_lock:
            sock, self._sock, self._conn = self._sock, None, None
        if sock is not None:
            sock.close()

    def _check_open(self) -> None:
        if self._closing.is_set():
            raise ClosedError(f"rpc client to {self._endpoint} is closed")

    def _what(self, request: msgspec.Struct) -> str:
        return f"{type(request).__name__} to {self._endpoint}"


class _Connection:
    """A connected socket, its frame reader, and a poller that tells whether it is usable."""

    __slots__ = ("_poller", "reader", "sock")

    def __init__(self, sock: socket.socket, max_payload_bytes: int) -> None:
        self.sock = sock
        self.reader = FrameReader(sock, max_payload_bytes)
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)

    def idle_and_open(self) -> bool:
        """True when nothing is pending (no end of stream, no stray bytes, no error); pure."""
        return not self._poller.poll(0)


def _check_timeout(timeout_s: float) -> None:
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ConfigError(f"timeout_s must be positive and finite, got {timeout_s}")
