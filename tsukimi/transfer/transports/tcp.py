"""TCP transport, client side: slices striped over a pool of connections per peer.

Each peer gets `num_connections` connections (opened on first use, spread over the peer's
endpoints, like Mooncake's multi-NIC striping), each owned by one worker thread with its
own queue. Slices are dealt round-robin. A worker pipelines up to `pipeline_depth` slices
of the same op: it sends every header (and write payload, straight from the caller's
memory with sendmsg) before reading the answers, which land in place with recv_into.

A connection error retries the affected slices on the next connection, up to max_retries;
every socket operation is bounded by the earliest deadline in the window, so a dead or
stalled peer turns into failed or timed-out requests, never a hang.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import queue
import socket
import threading

from tsukimi.clock import Clock
from tsukimi.config import TransferConfig
from tsukimi.errors import ClosedError, OutOfBounds, PeerError, ProtocolError
from tsukimi.transfer import wire
from tsukimi.transfer.batch import OpCode, RequestState
from tsukimi.transfer.segment import BufferDescriptor, Endpoint, SegmentDescriptor
from tsukimi.transfer.transports import Slice

logger = logging.getLogger(__name__)

_STATUS_CODES = {wire.Status.OUT_OF_BOUNDS: OutOfBounds.code}
_TICK_S = 0.1  # how often a blocked socket call wakes up to check deadlines and shutdown
_COALESCE_BYTES = 512 << 10  # a sender merges queued slices into one sendmsg up to this size


def connect(endpoint: Endpoint, timeout_s: float) -> socket.socket:
    """Open a TCP connection to `endpoint` with Nagle off. Raises OSError."""
    sock = socket.create_connection((endpoint.host, endpoint.port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def handshake(endpoint: Endpoint, payload: bytes, timeout_s: float) -> bytes:
    """Send our descriptor (may be empty) to a segment server and return its own.

    Raises:
        OSError: the peer cannot be reached or hung up.
        ProtocolError: the answer is malformed or oversized.
    """
    with connect(endpoint, timeout_s) as sock:
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


class _Connection:
    """One connection to a peer, driven full duplex by two threads.

    The sender takes slices from `queue`, appends them to `inflight` and writes their
    requests (and write payloads); the receiver reads the answers in order and lands read
    data in place. At most `pipeline_depth` slices are in flight. When either thread hits an
    error, `_broken` bumps the generation, closes the socket and hands every in-flight slice
    back to the peer for a retry on another connection; the sender reconnects on demand.
    """

    def __init__(self, peer: _TcpPeer, index: int) -> None:
        self.peer = peer
        self.index = index
        self.endpoint = peer.endpoints[index % len(peer.endpoints)]
        self.queue: queue.SimpleQueue[Slice | None] = queue.SimpleQueue()
        self.sock: socket.socket | None = None
        self.gen = 0
        self.stopping = False
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()  # one writer at a time: the sender thread or an inline caller
        self.ready = threading.Condition(self.lock)
        self.inflight: collections.deque[tuple[int, Slice, int, socket.socket]] = collections.deque()
        self.slots = threading.Semaphore(peer.config.pipeline_depth)
        self.seq = itertools.count(1)
        self._head = bytearray(wire.RESPONSE.size)
        self._head_view = memoryview(self._head)
        name = f"tsukimi-tcp-{peer.name}-{index}"
        self.threads = [
            threading.Thread(target=self._send_loop, name=name + "-tx", daemon=True),
            threading.Thread(target=self._receive_loop, name=name + "-rx", daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    # -- sender ------------------------------------------------------------------------

    def _send_loop(self) -> None:
        clock, depth = self.peer.clock, self.peer.config.pipeline_depth
        # NOTE: coalescing small slices saves syscalls and wake-ups; large ones stream better
        # one sendmsg each (measured: 16 MiB in one call slowed 1-connection writes by 15%).
        coalesce_bytes = _COALESCE_BYTES
        stop = False
        while not stop and (first := self.queue.get()) is not None:
            pieces: list[Slice] = []
            pending_bytes = 0
            candidate: Slice | None = first
            while candidate is not None:  # coalesce what is queued into one sendmsg
                if candidate.record.state is not RequestState.PENDING:
                    candidate.record.slice_failed("")  # the request already ended; only account for it
                elif clock.now() >= candidate.record.deadline:
                    candidate.record.slice_failed("request timed out before it was sent", timed_out=True)
                else:
                    pieces.append(candidate)
                    pending_bytes += len(candidate.local)
                if len(pieces) >= depth or pending_bytes >= coalesce_bytes:
                    break
                try:
                    candidate = self.queue.get_nowait()
                except queue.Empty:
                    break
                stop = candidate is None
            taken = [p for p in pieces if self._take_slot(p)]
            with self.send_lock:
                self._send(taken)
        self.fail_queued()

    def try_send_inline(self, pieces: list[Slice]) -> bool:
        """Send a small burst from the caller's thread when this connection is connected and
        idle (nothing queued, sender not writing, slots free): saves a thread hand-off.
        False means nothing was done and the caller should queue the pieces."""
        if self.sock is None or not self.queue.empty() or not self.send_lock.acquire(blocking=False):
            return False
        try:
            taken = 0
            while taken < len(pieces) and self.slots.acquire(blocking=False):
                taken += 1
            if taken < len(pieces):
                for _ in range(taken):
                    self.slots.release()
                return False
            self._send(pieces)
            return True
        finally:
            self.send_lock.release()

    def _take_slot(self, piece: Slice) -> bool:
        while not self.slots.acquire(timeout=_TICK_S):
            if self.stopping:
                piece.record.slice_failed("transfer engine closed", ClosedError.code)
                return False
        return True

    def _send(self, pieces: list[Slice]) -> None:
        """Write the requests (and write payloads) of `pieces`, each holding a slot.
        Called with `send_lock` held, so `inflight` order is wire order."""
        if not pieces:
            return
        while True:
            try:
                sock, gen = self._connected()
            except OSError as exc:
                for piece in pieces:
                    self.slots.release()
                    self.peer.retry(piece, self.index, f"cannot connect to {self.endpoint}: {exc}", False)
                return
            with self.lock:
                if gen == self.gen:
                    parts: list[bytes | memoryview] = []
                    for piece in pieces:
                        seq = next(self.seq) & 0xFFFFFFFF
                        self.inflight.append((seq, piece, gen, sock))
                        op = wire.Op.WRITE if piece.op is OpCode.WRITE else wire.Op.READ
                        parts.append(wire.REQUEST.pack(wire.MAGIC, op, 0, seq, piece.remote_offset, len(piece.local)))
                        if piece.op is OpCode.WRITE:
                            parts.append(piece.local)
                    self.ready.notify()
                    break
        deadline = min(piece.record.deadline for piece in pieces)
        try:
            wire.send_all(sock, parts, lambda: self.stopping or self.peer.clock.now() >= deadline)
        except OSError as exc:
            self._broken(gen, exc)

    def _connected(self) -> tuple[socket.socket, int]:
        with self.lock:
            if self.sock is not None:
                return self.sock, self.gen
        if self.stopping:
            raise ConnectionAbortedError("transfer engine closed")
        sock = connect(self.endpoint, self.peer.config.connect_timeout_s)
        sock.settimeout(None)
        wire.set_io_timeout(sock, _TICK_S)
        with self.lock:
            if self.sock is None:
                self.sock = sock
            else:
                sock.close()
            return self.sock, self.gen

    # -- receiver ----------------------------------------------------------------------

    def _receive_loop(self) -> None:
        while True:
            with self.lock:
                while not self.inflight and not self.stopping:
                    self.ready.wait()
                if not self.inflight:
                    return
                seq, piece, gen, sock = self.inflight.popleft()
            try:
                self._receive(sock, piece, seq)
            except (OSError, ProtocolError) as exc:
                self._broken(gen, exc, piece)
            else:
                self.slots.release()

    def _receive(self, sock: socket.socket, piece: Slice, seq: int) -> None:
        deadline = piece.record.deadline

        def expired(_: int) -> bool:
            return self.stopping or self.peer.clock.now() >= deadline

        wire.recv_exact(sock, self._head_view, expired)
        magic, status, _flags, got_seq, length = wire.RESPONSE.unpack_from(self._head)
        if magic != wire.MAGIC or got_seq != seq:
            raise ProtocolError(f"bad answer header (magic {magic:#x}, request {got_seq}, expected {seq})")
        if status == wire.Status.OK:
            if piece.op is OpCode.READ:
                if length != len(piece.local):
                    raise ProtocolError(f"read answer of {length} bytes, asked {len(piece.local)}")
                wire.recv_exact(sock, piece.local, expired)
            piece.record.slice_done(len(piece.local))
            return
        response = wire.decode_response(self._head)  # raises on an unknown status
        if length > wire.MAX_REASON_BYTES:
            raise ProtocolError(f"error reason of {length} bytes is over the limit")
        reason = bytearray(length)
        wire.recv_exact(sock, memoryview(reason), expired)
        code = _STATUS_CODES.get(response.status, PeerError.code)
        piece.record.slice_failed(reason.decode(errors="replace"), code)

    # -- failure and shutdown ----------------------------------------------------------

    def _broken(self, gen: int, exc: BaseException, popped: Slice | None = None) -> None:
        """Reset the connection of generation `gen` once; retry its slices elsewhere."""
        pieces = [popped] if popped is not None else []
        sock = None
        with self.lock:
            if gen == self.gen:
                self.gen += 1
                pieces += [p for _, p, _, _ in self.inflight]
                self.inflight.clear()
                sock, self.sock = self.sock, None
        if sock is not None:
            logger.debug("connection %d to %s broke: %s", self.index, self.peer.name, exc)
            _close(sock)
        timed_out = isinstance(exc, TimeoutError)
        for piece in pieces:
            self.slots.release()
            self.peer.retry(piece, self.index, f"{type(exc).__name__}: {exc}", timed_out)

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            self.ready.notify_all()
            sock = self.sock
        self.queue.put(None)
        if sock is not None:  # unblock threads waiting on a stalled peer
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def join(self, timeout_s: float) -> None:
        for thread in self.threads:
            thread.join(timeout=timeout_s)
        with self.lock:
            sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()

    def fail_queued(self) -> None:
        while True:
            try:
                late = self.queue.get_nowait()
            except queue.Empty:
                return
            if late is not None:
                late.record.slice_failed("transfer engine closed", ClosedError.code)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


class _TcpPeer:
    """The connection pool of one peer segment."""

    def __init__(self, desc: SegmentDescriptor, config: TransferConfig, clock: Clock) -> None:
        self.name = desc.name
        self.endpoints = list(desc.endpoints)
        self.config = config
        self.clock = clock
        self.closed = False
        self.connections = [_Connection(self, i) for i in range(config.num_connections)]
        self._next = itertools.count()

    def dispatch(self, pieces: list[Slice]) -> None:
        """Deal slices to connections in groups of about `slice_bytes`: large transfers are
        striped, while a burst of small requests stays on one connection (fewer wake-ups) and,
        when that connection is idle, is written by the calling thread itself."""
        n = len(self.connections)
        conn = self.connections[next(self._next) % n]
        small = len(pieces) <= self.config.pipeline_depth and sum(len(p.local) for p in pieces) <= _COALESCE_BYTES
        if small and conn.try_send_inline(pieces):
            return
        group_bytes = 0
        for piece in pieces:
            if group_bytes >= self.config.slice_bytes:
                conn, group_bytes = self.connections[next(self._next) % n], 0
            conn.queue.put(piece)
            group_bytes += len(piece.local)

    def retry(self, piece: Slice, failed_on: int, reason: str, timed_out: bool) -> None:
        piece.attempts += 1
        if self.closed:
            piece.record.slice_failed("transfer engine closed", ClosedError.code)
        elif self.clock.now() >= piece.record.deadline:
            piece.record.slice_failed(f"request timed out ({reason})", timed_out=True)
        elif piece.attempts > self.config.max_retries:
            piece.record.slice_failed(
                f"transfer to {self.name} failed after {piece.attempts} attempts: {reason}", PeerError.code
            )
        else:
            logger.debug("retrying a slice to %s on another connection: %s", self.name, reason)
            self.connections[(failed_on + 1) % len(self.connections)].queue.put(piece)

    def stop(self) -> None:
        self.closed = True
        for conn in self.connections:
            conn.stop()
        for conn in self.connections:
            conn.join(self.config.connect_timeout_s)
        for conn in self.connections:  # slices retried onto a connection that had stopped
            conn.fail_queued()


class TcpTransport:
    name = "tcp"

    def __init__(self, config: TransferConfig, clock: Clock) -> None:
        self._config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._peers: dict[str, _TcpPeer] = {}
        self._closed = False

    def can_serve(self, peer: SegmentDescriptor, buffer: BufferDescriptor) -> bool:
        return bool(peer.endpoints)

    def submit(self, peer: SegmentDescriptor, slices: list[Slice]) -> None:
        self._peer(peer).dispatch(slices)

    def forget(self, peer_name: str) -> None:
        with self._lock:
            state = self._peers.pop(peer_name, None)
        if state is not None:
            state.stop()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
        for state in peers:
            state.stop()

    def _peer(self, desc: SegmentDescriptor) -> _TcpPeer:
        state = self._peers.get(desc.name)
        if state is not None and state.endpoints == desc.endpoints:
            return state
        with self._lock:
            if self._closed:
                raise ClosedError("tcp transport is closed")
            stale = self._peers.get(desc.name)
            if stale is not None and stale.endpoints == desc.endpoints:
                return stale
            state = self._peers[desc.name] = _TcpPeer(desc, self._config, self._clock)
        if stale is not None:
            stale.stop()
        return state
