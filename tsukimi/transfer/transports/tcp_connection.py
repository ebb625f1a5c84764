"""One pooled TCP connection to a peer's segment server, driven full duplex.

The sender thread takes slices from `queue` (coalescing small ones into one sendmsg),
appends them to `inflight` and writes their requests and write payloads; the receiver
thread reads the answers in order and lands read data in place with recv_into. At most
`pipeline_depth` slices are in flight (`slots`). A small burst may instead be written by the
submitting thread (`try_send_inline`) when the connection is connected and idle.

Invariants (all under `lock`): `inflight` order is wire order (every write holds
`send_lock` from append to sendmsg); nothing is appended once `stopping` is set; every slot
is released exactly once, when its slice leaves `inflight` or fails before entering it.
When either thread hits an error, `_broken` bumps the generation, closes the socket and
hands every in-flight slice to the pool's `retry` (tcp.py), which retries it on another
connection or ends it. Waits are bounded by the earliest deadline among the in-flight slices.

A path that dies silently (no reset) is caught by the receiver: at each I/O tick it spends
waiting for an answer it asks whether the connection progressed (tcp_stall.py); when the pool
judges it stalled, the connection breaks with `BrokenConnectionError`, not a timeout, so its
slices move to another path. A connection whose path failed does not reconnect with slices in
hand while another path is healthy: it hands them back to the pool (`reroute`, no attempt
counted) and reconnects on its own thread, as a probe of the path (`probe_first`, `probed`).

Every connection runs the cluster-secret handshake (tsukimi/auth.py) right after connecting,
within `connect_timeout_s`. An `AuthError` is final: the slices that wanted the connection
fail at once with code "auth" (no retry: another attempt cannot fix a secret).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import math
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tsukimi import auth
from tsukimi.clock import Clock
from tsukimi.config import TransferConfig
from tsukimi.errors import AuthError, BrokenConnectionError, ClosedError, OutOfBounds, PeerError, ProtocolError
from tsukimi.transfer import wire
from tsukimi.transfer.batch import OpCode
from tsukimi.transfer.segment import Endpoint
from tsukimi.transfer.transports.base import Slice
from tsukimi.transfer.transports.tcp_stall import enable_keepalive, read_progress

logger = logging.getLogger(__name__)

TICK_S = 0.1  # how often a blocked socket call wakes up to check deadlines and shutdown
COALESCE_BYTES = 512 << 10  # small slices are merged into one sendmsg (or sent inline) up to this
_STATUS_CODES = {wire.Status.OUT_OF_BOUNDS: OutOfBounds.code}


def connect(
    endpoint: Endpoint, timeout_s: float, secret: bytes | None, stop: Callable[[], bool] | None = None
) -> socket.socket:
    """Open an authenticated TCP connection to `endpoint` with Nagle off, blocking with
    TICK_S I/O ticks; connecting and the handshake together take at most `timeout_s`.

    Raises:
        AuthError: the handshake failed (a secret missing on one side, or a wrong one).
        OSError: unreachable, refused, timed out (TimeoutError), or `stop()` became True.
    """
    expired = auth.deadline_expired(time.monotonic() + timeout_s, stop)
    sock = socket.create_connection((endpoint.host, endpoint.port), timeout=timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        wire.set_io_timeout(sock, TICK_S)
        auth.client_handshake(sock, secret, expired, f"segment server {endpoint.host}:{endpoint.port}")
    except BaseException:
        sock.close()
        raise
    return sock


@dataclass(frozen=True, slots=True)
class PeerLink:
    """What every connection to one peer shares: the peer's name, the settings, the clock
    that deadlines are read on, and the cluster secret."""

    name: str
    config: TransferConfig
    clock: Clock
    secret: bytes | None = None


class PoolHooks(Protocol):
    """What a connection asks of its pool (tcp.py's `PeerPool`); `index` names the connection."""

    def retry(self, piece: Slice, failed_on: int, reason: str, timed_out: bool) -> None:
        """Retry or end a slice whose connection broke (`timed_out`: it broke on a deadline)."""

    def reroute(self, piece: Slice, index: int) -> None:
        """Give a slice that was never sent to another connection (no attempt counted)."""

    def stalled(self, index: int, silent_s: float, peer_unanswered: bool) -> bool:
        """Whether a connection with slices in flight, silent for `silent_s`, is stalled."""

    def probe_first(self, index: int) -> bool:
        """Whether to reconnect without slices in hand (its path failed, another is healthy)."""

    def probed(self, index: int, ok: bool) -> None:
        """A connection (re)connected (`ok`) or failed to."""


class Connection:
    """One connection of a peer's pool (see the module); its threads start at once."""

    def __init__(self, link: PeerLink, index: int, endpoint: Endpoint, hooks: PoolHooks) -> None:
        self.link = link
        self.index = index
        self.endpoint = endpoint
        self._hooks = hooks
        self.progress_at = 0.0  # when an answer, or any sign of life, last came (the link's clock)
        self._seen: tuple[int, int] = (0, 0)  # (request, bytes of its answer) at the last look
        self._kernel_seen: tuple[int, int] = (0, 0)  # the kernel's (acked, received) bytes then
        self.queue: queue.SimpleQueue[Slice | None] = queue.SimpleQueue()
        self.sock: socket.socket | None = None
        self.gen = 0
        self.stopping = False
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()  # one writer at a time: the sender thread or an inline caller
        self.ready = threading.Condition(self.lock)
        self.inflight: collections.deque[tuple[int, Slice, int, socket.socket]] = collections.deque()
        self.tail_deadline = math.inf  # earliest deadline among `inflight` (not the slice being received)
        self.slots = threading.BoundedSemaphore(link.config.pipeline_depth)
        self.seq = itertools.count(1)
        self._head = bytearray(wire.RESPONSE.size)
        self._head_view = memoryview(self._head)
        name = f"tsukimi-tcp-{link.name}-{index}"
        self.threads = [
            threading.Thread(target=self._send_loop, name=name + "-tx", daemon=True),
            threading.Thread(target=self._receive_loop, name=name + "-rx", daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    # -- sender ------------------------------------------------------------------------

    def _send_loop(self) -> None:
        depth = self.link.config.pipeline_depth
        stop = False
        while not stop and (first := self.queue.get()) is not None:
            pieces: list[Slice] = []
            pending_bytes = 0
            candidate: Slice | None = first
            while candidate is not None:  # coalesce what is queued into one sendmsg
                if self._still_wanted(candidate):
                    pieces.append(candidate)
                    pending_bytes += len(candidate.local)
                # NOTE: large slices stream better one sendmsg each (16 MiB in one call slowed
                # 1-connection writes by 15%).
                if len(pieces) >= depth or pending_bytes >= COALESCE_BYTES:
                    break
                try:
                    candidate = self.queue.get_nowait()
                except queue.Empty:
                    break
                stop = candidate is None
            taken = [p for p in pieces if self._take_slot(p)]
            with self.send_lock:
                self._send(taken, may_connect=True)
        self.fail_queued()

    def _still_wanted(self, piece: Slice) -> bool:
        """False (and the slice ended) when its request is doomed or past its deadline."""
        if piece.record.doomed:
            piece.record.slice_failed("")  # a sibling slice failed; only account for this one
            return False
        if self.link.clock.now() >= piece.record.deadline:
            piece.record.slice_failed("request timed out before it was sent", timed_out=True)
            return False
        return True

    def _take_slot(self, piece: Slice) -> bool:
        while not self.slots.acquire(timeout=TICK_S):
            if self.stopping:
                piece.record.slice_failed(f"connection pool to {self.link.name} closed", ClosedError.code)
                return False
            if not self._still_wanted(piece):
                return False
        return True

    def try_send_inline(self, pieces: list[Slice]) -> bool:
        """Send a small burst from the caller's thread when this connection is connected and
        idle (nothing queued or in flight, nobody writing): saves a thread hand-off. Never
        connects. False means nothing was done and the caller should queue the pieces."""
        if self.sock is None or self.inflight or not self.queue.empty():
            return False
        if not self.send_lock.acquire(blocking=False):
            return False
        try:
            taken = 0
            while taken < len(pieces) and self.slots.acquire(blocking=False):
                taken += 1
            if taken == len(pieces) and self._send(pieces, may_connect=False):
                return True
            for _ in range(taken):
                self.slots.release()
            return False
        finally:
            self.send_lock.release()

    def _send(self, pieces: list[Slice], may_connect: bool) -> bool:
        """Write the requests (and write payloads) of `pieces`, each holding a slot; called
        with `send_lock` held. Returns False, having done nothing, only when not connected
        and `may_connect` is False."""
        if not pieces:
            return True
        parts: list[bytes | memoryview] | None = None
        sock: socket.socket | None = None
        while True:
            with self.lock:
                if self.stopping:
                    break
                sock, gen = self.sock, self.gen
                if sock is not None:
                    parts = self._enqueue(pieces, sock, gen)
                    break
            if not may_connect:
                return False
            if self._hooks.probe_first(self.index):
                for piece in pieces:
                    self.slots.release()
                    self._hooks.reroute(piece, self.index)
                self._reroute_queued()  # NOTE: nothing waits here while the probe connects
                self._probe()
                return True
            try:
                self._connect(min(piece.record.deadline for piece in pieces))
            except AuthError as exc:
                self._hooks.probed(self.index, False)
                for piece in pieces:
                    self.slots.release()
                    where = f"{self.endpoint.host}:{self.endpoint.port}"
                    piece.record.slice_failed(f"authentication with {where} failed: {exc}", exc.code)
                return True
            except (OSError, ValueError) as exc:  # ValueError: e.g. UnicodeError from a bad host name
                for piece in pieces:
                    self.slots.release()
                    self._hooks.retry(piece, self.index, f"cannot connect to {self.endpoint}: {exc}", False)
                return True
            self._hooks.probed(self.index, True)
        if parts is None or sock is None:  # stopping: nothing was appended
            for piece in pieces:
                self.slots.release()
                piece.record.slice_failed(f"connection pool to {self.link.name} closed", ClosedError.code)
            return True
        deadline = min(piece.record.deadline for piece in pieces)
        try:
            wire.send_all(sock, parts, lambda: self.stopping or self.link.clock.now() >= deadline)
        except OSError as exc:
            self._broken(gen, exc)
        return True

    def _enqueue(self, pieces: list[Slice], sock: socket.socket, gen: int) -> list[bytes | memoryview]:
        # Called with self.lock held: number, append and frame the pieces.
        parts: list[bytes | memoryview] = []
        for piece in pieces:
            seq = next(self.seq) & 0xFFFFFFFF
            self.inflight.append((seq, piece, gen, sock))
            self.tail_deadline = min(self.tail_deadline, piece.record.deadline)
            op = wire.Op.WRITE if piece.op is OpCode.WRITE else wire.Op.READ
            parts.append(wire.REQUEST.pack(wire.MAGIC, op, 0, seq, piece.remote_offset, len(piece.local)))
            if piece.op is OpCode.WRITE:
                parts.append(piece.local)
        self.ready.notify()
        return parts

    def _connect(self, deadline: float) -> None:
        """Connect, giving up at `deadline` (the link's clock) or on stop(). Raises OSError, AuthError."""
        clock = self.link.clock

        def stop() -> bool:
            return self.stopping or clock.now() >= deadline

        sock = connect(self.endpoint, self.link.config.connect_timeout_s, self.link.secret, stop)
        with contextlib.suppress(OSError):
            enable_keepalive(sock)
        with self.lock:
            if self.sock is None and not self.stopping:
                self.sock = sock
                return
        sock.close()

    def _reroute_queued(self) -> None:
        """Hand every queued slice back to the pool (a stop request stays queued)."""
        while True:
            try:
                piece = self.queue.get_nowait()
            except queue.Empty:
                return
            if piece is None:
                self.queue.put(None)
                return
            self._hooks.reroute(piece, self.index)

    def _probe(self) -> None:
        """Reconnect with no slice waiting on it, and tell the pool how it went."""
        try:
            self._connect(self.link.clock.now() + self.link.config.connect_timeout_s)
        except (OSError, ValueError, AuthError) as exc:
            logger.debug("connection %d to %s: probe of %s failed: %s", self.index, self.link.name, self.endpoint, exc)
            self._hooks.probed(self.index, False)
        else:
            self._hooks.probed(self.index, True)

    # -- receiver ----------------------------------------------------------------------

    def _receive_loop(self) -> None:
        while True:
            with self.lock:
                while not self.inflight and not self.stopping:
                    self.ready.wait()
                if not self.inflight:
                    return
                seq, piece, gen, sock = self.inflight.popleft()
                self.tail_deadline = min((p.record.deadline for _, p, _, _ in self.inflight), default=math.inf)
            try:
                self._receive(sock, piece, seq)
            except (OSError, PeerError) as exc:  # PeerError: a protocol violation, or a stall
                self._broken(gen, exc, piece)
            else:
                self.slots.release()

    def _receive(self, sock: socket.socket, piece: Slice, seq: int) -> None:
        clock, deadline = self.link.clock, piece.record.deadline

        def expired(received: int) -> bool:
            # NOTE: the earliest deadline in flight, not just the head's: a stalled peer must
            # not hold a later, shorter request past its deadline.
            now = clock.now()
            if self.stopping or now >= min(deadline, self.tail_deadline):
                return True
            self._watch(sock, (seq, received), now)
            return False

        wire.recv_exact(sock, self._head_view, expired)
        magic, status, _flags, got_seq, length = wire.RESPONSE.unpack_from(self._head)
        if magic != wire.MAGIC or got_seq != seq:
            raise ProtocolError(f"bad answer header (magic {magic:#x}, request {got_seq}, expected {seq})")
        if status == wire.Status.OK:
            expected = len(piece.local) if piece.op is OpCode.READ else 0
            if length != expected:
                raise ProtocolError(f"{piece.op.value} answer carries {length} bytes, expected {expected}")
            if expected:
                wire.recv_exact(sock, piece.local, expired, strict=True)
            self.progress_at = clock.now()
            piece.record.slice_done(len(piece.local))
            return
        response = wire.decode_response(self._head)  # raises on an unknown status
        if length > wire.MAX_REASON_BYTES:
            raise ProtocolError(f"error reason of {length} bytes is over the limit")
        reason = bytearray(length)
        wire.recv_exact(sock, memoryview(reason), expired, strict=True)
        code = _STATUS_CODES.get(response.status, PeerError.code)
        self.progress_at = clock.now()
        piece.record.slice_failed(reason.decode(errors="replace"), code)

    def _watch(self, sock: socket.socket, seen: tuple[int, int], now: float) -> None:
        """At a tick (or a partial answer) of the receiver: note progress, or raise when the
        pool judges this connection stalled (tcp_stall.py).

        Raises:
            BrokenConnectionError: stalled.
        """
        if seen != self._seen:  # a new request awaited, or bytes of its answer came: no syscall
            self._seen, self.progress_at = seen, now
            return
        kernel = read_progress(sock)
        if kernel is not None and (kernel.acked_bytes, kernel.received_bytes) != self._kernel_seen:
            self._kernel_seen, self.progress_at = (kernel.acked_bytes, kernel.received_bytes), now
            return
        silent_s = now - self.progress_at
        if self._hooks.stalled(self.index, silent_s, kernel is not None and kernel.peer_unanswered):
            raise BrokenConnectionError(
                f"no progress from {self.endpoint.host}:{self.endpoint.port} for {silent_s:.2f} s (path stalled)"
            )

    # -- failure and shutdown ----------------------------------------------------------

    def _broken(self, gen: int, exc: BaseException, popped: Slice | None = None) -> None:
        """Reset the connection of generation `gen` once; hand its slices back to the pool."""
        pieces = [popped] if popped is not None else []
        sock = None
        with self.lock:
            if gen == self.gen:
                self.gen += 1
                pieces += [p for _, p, _, _ in self.inflight]
                self.inflight.clear()
                self.tail_deadline = math.inf
                sock, self.sock = self.sock, None
        if sock is not None:
            logger.debug("connection %d to %s broke: %s", self.index, self.link.name, exc)
            _close(sock)
        timed_out = isinstance(exc, TimeoutError)
        for piece in pieces:
            self.slots.release()
            self._hooks.retry(piece, self.index, f"{type(exc).__name__}: {exc}", timed_out)

    def stop(self) -> None:
        """Stop accepting work and wake both threads (mutates; returns at once)."""
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
            if thread.is_alive():
                logger.warning("%s did not stop within %.1f s", thread.name, timeout_s)
        with self.lock:
            sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()

    def fail_queued(self) -> None:
        """End every slice still queued (the connection stopped)."""
        while True:
            try:
                late = self.queue.get_nowait()
            except queue.Empty:
                return
            if late is not None:
                late.record.slice_failed(f"connection pool to {self.link.name} closed", ClosedError.code)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
