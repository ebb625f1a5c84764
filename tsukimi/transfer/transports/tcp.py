"""TCP transport, client side: slices striped over a pool of connections per peer.

Each peer gets a `PeerPool` of `num_connections` connections (tcp_connection.py), opened on
first use and spread over the peer's endpoints (one per NIC), like Mooncake's multi-NIC
striping. A path (endpoint) whose connection broke or stalled (a NIC that died silently:
tcp_stall.py) is avoided for SUSPECT_S: new slices go to the other paths, and a slice that
failed on it is retried on another. While another path is healthy, a connection on a path that
failed reconnects without slices in hand (a probe: tcp_connection.py), so a connect to a dead
NIC never holds a request up; the path is used again once a probe connects. Slices
are dealt in groups of about `slice_bytes`, so large transfers stripe over every connection
while a burst of small requests stays on one. A slice whose connection broke is retried on
the next connection, up to `max_retries` times (a `Retry` policy), unless its deadline passed;
a failed cluster-secret handshake is not retried (tcp_connection.py). The server side is
`tsukimi.transfer.server`; the frames are in `wire.py`.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import math
import threading
from collections.abc import Callable

from tsukimi.clock import Clock
from tsukimi.config import TransferConfig
from tsukimi.errors import ClosedError, PeerError, ProtocolError
from tsukimi.retry import Retry
from tsukimi.transfer import wire
from tsukimi.transfer.batch import OpCode
from tsukimi.transfer.segment import BufferDescriptor, Endpoint, SegmentDescriptor, view_address
from tsukimi.transfer.transports.base import PreparedItem, Slice, TransportContext, register_transport
from tsukimi.transfer.transports.tcp_connection import COALESCE_BYTES, Connection, PeerLink, PreparedCall, connect
from tsukimi.transfer.transports.tcp_stall import StallPolicy

logger = logging.getLogger(__name__)

SUSPECT_S = 1.0  # a path whose connection broke is avoided this long
LONE_STALL_FACTOR = 8  # silence breaks a connection after this many stall_s with no path to compare


def handshake(endpoint: Endpoint, payload: bytes, timeout_s: float, secret: bytes | None = None) -> bytes:
    """Send our descriptor (may be empty) to a segment server and return its own (after the
    cluster-secret handshake, which `secret` answers).

    Raises:
        AuthError: the cluster-secret handshake failed.
        OSError: the peer cannot be reached or hung up.
        ProtocolError: the answer is malformed or oversized.
        PeerError: the peer refused our descriptor.
    """
    with connect(endpoint, timeout_s, secret) as sock:
        sock.settimeout(timeout_s)
        wire.send_all(sock, [wire.RequestHeader(wire.Op.HANDSHAKE, 0, 0, len(payload)).pack(), payload])
        head = bytearray(wire.RESPONSE.size)
        wire.recv_exact(sock, memoryview(head))
        response = wire.decode_response(head)
        if response.length > wire.MAX_DESCRIPTOR_BYTES:
            raise ProtocolError(f"descriptor of {response.length} bytes is over the limit")
        body = bytearray(response.length)
        wire.recv_exact(sock, memoryview(body))
        if response.status is not wire.Status.OK:
            raise PeerError(body.decode(errors="replace"))
        return bytes(body)


class PeerPool:
    """The connections to one peer segment, and the retry policy for their slices."""

    def __init__(
        self, desc: SegmentDescriptor, config: TransferConfig, clock: Clock, secret: bytes | None = None
    ) -> None:
        self.name = desc.name
        self.endpoints = list(desc.endpoints)
        self.config = config
        self.clock = clock
        self.closed = False
        self._retry = Retry(attempts=config.max_retries + 1)  # NOTE: no backoff: another connection
        self._policy = StallPolicy(config.stall_s, LONE_STALL_FACTOR * config.stall_s)
        self._next = itertools.count()
        self._suspect_until = [0.0] * len(self.endpoints)  # per endpoint: avoided until then
        self._failed = [False] * len(self.endpoints)  # per endpoint: failed, no connect since
        link = PeerLink(desc.name, config, clock, secret)
        self.connections = [
            Connection(link, i, self.endpoints[i % len(self.endpoints)], self) for i in range(config.num_connections)
        ]

    def _pick(self, after: int | None = None) -> Connection:
        """The next connection (after connection `after`, for a retry) on a path not suspect;
        any when every path is."""
        n = len(self.connections)
        start = (after + 1) if after is not None else next(self._next)
        now = self.clock.now()
        for k in range(n):
            conn = self.connections[(start + k) % n]
            if self._suspect_until[conn.index % len(self.endpoints)] <= now:
                return conn
        return self.connections[start % n]

    def dispatch(self, pieces: list[Slice], waiting: bool = False) -> None:
        """Deal slices to connections in groups of about `slice_bytes`: large transfers are
        striped, while a burst of small requests stays on one connection (fewer wake-ups) and,
        when that connection is idle, is written by the calling thread itself, which also
        reads their answers when it `waiting` for them anyway (no thread hand-off either way)."""
        conn = self._pick()
        small = len(pieces) <= self.config.pipeline_depth and sum(len(p.local) for p in pieces) <= COALESCE_BYTES
        if small and conn.try_send_inline(pieces, receive=waiting):
            return
        touched = {conn}
        group_bytes = 0
        for piece in pieces:
            if group_bytes >= self.config.slice_bytes:
                conn, group_bytes = self._pick(), 0
                touched.add(conn)
            conn.queue.put(piece)
            group_bytes += len(piece.local)
        if self.closed:  # stopped while we queued: nobody reads those queues any more
            for conn in touched:
                conn.fail_queued()

    def retry(self, piece: Slice, failed_on: int, reason: str, timed_out: bool) -> None:
        """Give a slice whose connection failed another connection, or end it. (`timed_out`
        says the connection broke on a deadline; the slice's own deadline decides.)"""
        piece.attempts += 1
        if len(self.endpoints) > 1 and not timed_out:
            path = failed_on % len(self.endpoints)
            self._failed[path] = True
            self._suspect_until[path] = max(self._suspect_until[path], self.clock.now() + SUSPECT_S)
        if self.closed:
            piece.record.slice_failed(f"connection pool to {self.name} closed ({reason})", ClosedError.code)
        elif self.clock.now() >= piece.record.deadline:
            piece.record.slice_failed(f"request timed out ({reason})", timed_out=True)
        elif piece.record.doomed:
            piece.record.slice_failed("")
        elif not self._retry.allows(piece.attempts):
            piece.record.slice_failed(
                f"transfer to {self.name} failed after {piece.attempts} attempts: {reason}", PeerError.code
            )
        else:
            logger.debug("retrying a slice to %s on another connection: %s", self.name, reason)
            self.reroute(piece, failed_on)

    def reroute(self, piece: Slice, index: int) -> None:
        """Queue a slice on the next usable connection after connection `index` (mutates)."""
        conn = self._pick(after=index)
        conn.queue.put(piece)
        if self.closed:
            conn.fail_queued()

    def stalled(self, index: int, silent_s: float, peer_unanswered: bool) -> bool:
        """Whether connection `index`, silent for `silent_s` with slices in flight, is stalled:
        another path progressed since it fell silent (or is connected and idle, having answered
        all it was given), or long silence with the peer's kernel not answering either
        (tcp_stall.py). Does not mutate."""
        since = self.connections[index].progress_at
        path, num_paths = index % len(self.endpoints), len(self.endpoints)
        # NOTE: idle counts: a path that finished its share of the batch early must not leave
        # the stalled share waiting for the deadline; a path stuck itself has slices in flight.
        alive = any(
            c.progress_at > since or (c.sock is not None and not c.inflight and not self._failed[c.index % num_paths])
            for c in self.connections
            if c.index % num_paths != path
        )
        return self._policy.stalled(silent_s, alive, peer_unanswered)

    def probe_first(self, index: int) -> bool:
        """True when connection `index` should reconnect without slices in hand: its path
        failed and no connect succeeded since, while another path is healthy and connected.
        Marks the path suspect for the probe's duration (mutates)."""
        num_paths = len(self.endpoints)
        path = index % num_paths
        if not self._failed[path]:
            return False
        now = self.clock.now()
        usable = {p for p in range(num_paths) if p != path and not self._failed[p] and self._suspect_until[p] <= now}
        healthy = any(c.sock is not None and c.index % num_paths in usable for c in self.connections)
        if healthy:
            self._suspect_until[path] = math.inf  # NOTE: until the probe ends (`probed`)
        return healthy

    def probed(self, index: int, ok: bool) -> None:
        """Connection `index` connected (`ok`: its path is usable again) or failed to (its path
        stays suspect SUSPECT_S more). Mutates."""
        path = index % len(self.endpoints)
        if ok:
            self._failed[path] = False
            self._suspect_until[path] = 0.0
        elif len(self.endpoints) > 1:
            self._failed[path] = True
            self._suspect_until[path] = self.clock.now() + SUSPECT_S

    def run_prepared(self, calls: list[PreparedCall], timeout_s: float) -> bool:
        """A prepared call (TcpTransport.prepare) on the next connection that is connected,
        idle and on a path not suspect; False when there is none (the engine then redoes the
        list the ordinary way) or any request did not complete within `timeout_s`."""
        if self.closed:
            return False
        deadline = self.clock.now() + timeout_s
        n, start = len(self.connections), next(self._next)
        for k in range(n):  # NOTE: the first connected, idle one (a pool connects only what it used)
            conn = self.connections[(start + k) % n]
            if conn.sock is not None and self._suspect_until[conn.index % len(self.endpoints)] <= self.clock.now():
                done = conn.run_prepared(calls, deadline)
                if done is not None:
                    return done
        return False

    def stop(self) -> None:
        """Close every connection; in-flight and queued slices end (mutates; blocks briefly)."""
        self.closed = True
        for conn in self.connections:
            conn.stop()
        for conn in self.connections:
            conn.join(self.config.connect_timeout_s)
        for conn in self.connections:  # slices retried onto a connection that had stopped
            conn.fail_queued()


class TcpTransport:
    """Moves slices over pooled TCP connections; every connection proves `secret` (if any)."""

    name = "tcp"
    prepared_waits = True  # its prepared call waits on the network: `transfer()` takes it, `submit()` never

    def __init__(self, config: TransferConfig, clock: Clock, secret: bytes | None = None) -> None:
        self._config = config
        self._secret = secret
        self._clock = clock
        self.slice_bytes = config.slice_bytes
        self._lock = threading.Lock()
        self._pools: dict[str, PeerPool] = {}
        self._closed = False

    def can_serve(self, peer: SegmentDescriptor, buffer: BufferDescriptor) -> bool:
        return bool(peer.endpoints)

    def submit(self, peer: SegmentDescriptor, slices: list[Slice]) -> None:
        self._pool(peer).dispatch(slices)

    def prepare(self, peer: SegmentDescriptor, items: list[PreparedItem]) -> Callable[[float], bool] | None:
        """Prepared requests (tsukimi/transfer/prepared.py) for a small list, one that
        `dispatch` would keep on one connection (at most `pipeline_depth` requests and
        COALESCE_BYTES, none over `slice_bytes`): a run writes and reads it whole on the
        calling thread over an idle connection (tcp_connection.py `run_prepared`), False
        (the ordinary way then) when the connection is busy. Larger lists are striped over the
        connections by the ordinary path (None). Keeps addresses, not views."""
        sizes = [len(local) for _, local, _ in items]
        if (
            not items
            or len(items) > self._config.pipeline_depth
            or sum(sizes) > COALESCE_BYTES
            or max(sizes) > self.slice_bytes
            or not peer.endpoints
        ):
            return None
        calls: list[PreparedCall] = [
            (op is OpCode.READ, ctypes.c_char * len(local), view_address(local), offset) for op, local, offset in items
        ]
        pool = self._pool(peer)
        return functools.partial(pool.run_prepared, calls)

    def submit_waiting(self, peer: SegmentDescriptor, slices: list[Slice]) -> None:
        """`submit`; a small burst on an idle connection is answered on this thread (base.py `Waitable`)."""
        self._pool(peer).dispatch(slices, waiting=True)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.stop()

    def _pool(self, desc: SegmentDescriptor) -> PeerPool:
        pool = self._pools.get(desc.name)
        if pool is not None and pool.endpoints == desc.endpoints:
            return pool
        with self._lock:
            if self._closed:
                raise ClosedError("tcp transport is closed")
            stale = self._pools.get(desc.name)
            if stale is not None and stale.endpoints == desc.endpoints:
                return stale
            pool = self._pools[desc.name] = PeerPool(desc, self._config, self._clock, self._secret)
        if stale is not None:  # the peer moved: retire its old pool without blocking the caller
            threading.Thread(target=stale.stop, name=f"tsukimi-retire-{desc.name}", daemon=True).start()
        return pool


def _create(context: TransportContext) -> TcpTransport:
    return TcpTransport(context.config, context.clock, context.secret)


register_transport("tcp", _create, rank=100)
