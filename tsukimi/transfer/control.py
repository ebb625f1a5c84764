"""Control requests to peers' segment servers: NOTIFY (deliver a notification into the peer's
inbox) and PING (is the peer alive and serving?), by segment name.

Unlike the data path (transports/tcp.py: pipelined slices on pooled connections), a control
request is one frame and its answer, on a connection of its own for the duration:

    ControlChannel.notify / probe
      -> directory.get(name)                    the cached descriptor, fetched on first use
      -> open(endpoints)                        an idle cached connection still open, or a new
                                                one (authenticated, like every connection)
         (none reachable and time left: fetch the descriptor again; once more if it moved)
      -> exchange(request) -> answer            bounded by the request's deadline
      -> the connection goes back to the cache  (closed instead after any failure)

Nothing is retried once a request was sent (a NOTIFY is delivered at most once). Idle
connections are bounded (MAX_IDLE_PER_ENDPOINT each, MAX_IDLE in all).
"""

from __future__ import annotations

import collections
import itertools
import logging
import socket
import threading
from collections.abc import Sequence

from tsukimi.clock import Clock
from tsukimi.errors import BrokenConnectionError, ClosedError, PeerError, ProtocolError, RpcTimeout
from tsukimi.transfer import wire
from tsukimi.transfer.directory import SegmentDirectory
from tsukimi.transfer.notifications import Notification
from tsukimi.transfer.segment import Endpoint
from tsukimi.transfer.transports.tcp_connection import connect

logger = logging.getLogger(__name__)

MAX_IDLE_PER_ENDPOINT = 2
MAX_IDLE = 64
_STATUS_ERRORS: dict[wire.Status, type[PeerError]] = {wire.Status.BAD_REQUEST: ProtocolError}


class ControlChannel:
    """NOTIFY and PING to peers found through `directory`; every connection proves `secret`
    (if any) and connects within `connect_timeout_s`. Thread-safe; close() when done."""

    def __init__(
        self, directory: SegmentDirectory, clock: Clock, connect_timeout_s: float, secret: bytes | None = None
    ) -> None:
        self._directory = directory
        self._clock = clock
        self._connect_timeout_s = connect_timeout_s
        self._secret = secret
        self._lock = threading.Lock()
        self._idle: collections.OrderedDict[Endpoint, list[socket.socket]] = collections.OrderedDict()
        self._seq = itertools.count(1)
        self._closed = False

    def notify(self, name: str, notification: Notification, timeout_s: float) -> None:
        """Deliver `notification` into segment `name`'s inbox within `timeout_s`.

        Raises:
            InvalidArgument: the notification is over wire.MAX_NOTIFY_BYTES.
            SegmentNotFound / MetadataError: the segment cannot be found.
            BrokenConnectionError: no endpoint of the peer can be reached, or the connection broke.
            PeerError: the peer's inbox is full (it is not taking its notifications).
            RpcTimeout: no answer within `timeout_s`. AuthError: the cluster-secret handshake failed.
            ClosedError: this channel is closed.
        """
        payload = wire.encode_notification(notification.name, notification.message)
        self._call(name, wire.Op.NOTIFY, payload, timeout_s)

    def probe(self, name: str, timeout_s: float) -> float:
        """Seconds segment `name`'s server took to answer a PING (connecting included when no
        connection was open). Raises what `notify` raises (but InvalidArgument)."""
        started = self._clock.now()
        self._call(name, wire.Op.PING, b"", timeout_s)
        return self._clock.now() - started

    def close(self) -> None:
        """Close the idle connections; calls in flight end by their deadlines (idempotent)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, collections.OrderedDict()
        for socks in idle.values():
            for sock in socks:
                sock.close()

    def _call(self, name: str, op: wire.Op, payload: bytes, timeout_s: float) -> None:
        deadline = self._clock.now() + timeout_s
        desc = self._directory.get(name)
        try:
            endpoint, sock = self._open(desc.endpoints, deadline)
        except BrokenConnectionError:
            # NOTE: nothing was sent: safe to try where it moved (the fetch has its own bound,
            # metadata.timeout_s)
            fresh = self._directory.fetch(name)
            if fresh.endpoints == desc.endpoints:
                raise
            endpoint, sock = self._open(fresh.endpoints, deadline)
        try:
            self._exchange(sock, op, payload, deadline, name)
        except BaseException:
            sock.close()
            raise
        self._release(endpoint, sock)

    def _open(self, endpoints: Sequence[Endpoint], deadline: float) -> tuple[Endpoint, socket.socket]:
        """A connection to the first endpoint that takes one (an idle one when still open).

        Raises BrokenConnectionError (none reachable: nothing was sent), AuthError, RpcTimeout.
        """
        failures: list[str] = []
        for endpoint in endpoints:
            sock = self._idle_socket(endpoint)
            if sock is not None:
                return endpoint, sock
            left = deadline - self._clock.now()
            if left <= 0:
                raise RpcTimeout(f"no connection to {endpoint.host}:{endpoint.port} before the deadline")
            try:
                return endpoint, connect(endpoint, min(left, self._connect_timeout_s), self._secret)
            except (OSError, ValueError) as exc:  # ValueError: e.g. UnicodeError from a bad host name
                failures.append(f"{endpoint.host}:{endpoint.port}: {exc}")
        said = "; ".join(failures) or "no endpoints"
        if self._clock.now() >= deadline:  # e.g. a stopped peer: accepted, never greeted
            raise RpcTimeout(f"no connection to the peer before the deadline ({said})")
        raise BrokenConnectionError(f"cannot connect to the peer ({said})")

    def _exchange(self, sock: socket.socket, op: wire.Op, payload: bytes, deadline: float, name: str) -> None:
        """Send one request and read its (empty) answer. Raises PeerError and its kin, RpcTimeout."""
        seq = next(self._seq) & 0xFFFFFFFF

        def expired(_: int = 0) -> bool:
            return self._closed or self._clock.now() >= deadline

        head = bytearray(wire.RESPONSE.size)
        try:
            wire.send_all(sock, [wire.RequestHeader(op, seq, 0, len(payload)).pack(), payload], expired)
            wire.recv_exact(sock, memoryview(head), expired)
            answer = wire.decode_response(head)
            if answer.seq != seq or answer.length > wire.MAX_REASON_BYTES:
                raise ProtocolError(f"{op.name} to {name}: answer for request {answer.seq}, {answer.length} bytes")
            body = bytearray(answer.length)
            wire.recv_exact(sock, memoryview(body), expired, strict=True)
        except TimeoutError as exc:
            if self._closed:
                raise ClosedError(f"{op.name} to {name}: the engine closed") from exc
            raise RpcTimeout(f"{op.name} to {name} got no answer in time") from exc
        except OSError as exc:
            raise BrokenConnectionError(f"{op.name} to {name}: the connection broke: {exc}") from exc
        if answer.status is not wire.Status.OK:
            error = _STATUS_ERRORS.get(answer.status, PeerError)
            raise error(f"{name} refused {op.name}: {body.decode(errors='replace')}")
        if body:
            raise ProtocolError(f"{op.name} to {name}: an OK answer carries {len(body)} bytes")

    def _idle_socket(self, endpoint: Endpoint) -> socket.socket | None:
        """An idle connection to `endpoint` that is still open, if any (closes dead ones)."""
        while True:
            with self._lock:
                if self._closed:
                    raise ClosedError("the control channel is closed")
                socks = self._idle.get(endpoint)
                if not socks:
                    return None
                sock = socks.pop()
                if not socks:
                    del self._idle[endpoint]
            if _still_open(sock):
                return sock
            sock.close()

    def _release(self, endpoint: Endpoint, sock: socket.socket) -> None:
        """Keep `sock` for the next request to `endpoint`, within the idle bounds."""
        evicted: list[socket.socket] = []
        with self._lock:
            socks = self._idle.setdefault(endpoint, [])
            self._idle.move_to_end(endpoint)
            if self._closed or len(socks) >= MAX_IDLE_PER_ENDPOINT:
                evicted.append(sock)
            else:
                socks.append(sock)
            while sum(len(s) for s in self._idle.values()) > MAX_IDLE:
                _, oldest = self._idle.popitem(last=False)
                evicted += oldest
        for extra in evicted:
            extra.close()


def _still_open(sock: socket.socket) -> bool:
    """Whether the peer has not closed `sock` (nothing should be waiting on an idle one)."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True  # nothing to read: open and quiet
    except OSError:
        return False
    return False  # the peer closed it, or sent bytes nobody asked for
