"""One pooled TCP connection to a peer's segment server, driven full duplex.

The sender thread takes slices from `queue` (coalescing small ones into one sendmsg),
appends them to `inflight` and writes their requests and write payloads; the receiver
thread reads the answers in order and lands read data in place with recv_into. At most
`pipeline_depth` slices are in flight (`free_slots`). A small burst may instead be written by the
submitting thread (`try_send_inline`) when the connection is connected and idle; a caller
that waits for the burst next (`transfer()`) then also reads its answers itself, saving the
two thread hand-offs (to the receiver and back) that cost a 64 KiB round trip about half
its time.

Invariants (all under `lock`): `inflight` order is wire order (every write holds
`send_lock` from append to sendmsg); nothing is appended once `stopping` is set; every slot
is released exactly once, when its slice leaves `inflight` or fails before entering it.
Whoever reads answers (the receiver thread, or a waiting caller reading its own) holds
`recv_lock` from taking the head of `inflight` until its answer is read, so answers are read
in wire order by one thread at a time; a caller reads only while the head is one of its own
slices, and wakes the receiver thread for whatever it leaves in flight.
When either thread hits an error, `_broken` bumps the generation, closes the socket and
hands every in-flight slice to the pool's `retry` (tcp.py), which retries it on another
connection or ends it. Waits are bounded by the earliest deadline among the in-flight slices.

A path that dies silently (no reset) is caught by the receiver: at each I/O tick it spends
waiting for an answer it asks whether the connection progressed (tcp_stall.py); when the pool
judges it stalled, the connection breaks with `BrokenConnectionError`, not a timeout, so its
slices move to another path. A connection whose path failed does not reconnect with slices in
hand while another path is healthy: it hands them back to the pool (`reroute`, no attempt
counted) and reconnects on its own thread, as a probe of the path (`probe_first`, `probed`).

A prepared call (`run_prepared`, from TcpTransport.prepare: a small list that `transfer()`
was given before) skips even those objects: it takes an idle connection whole (both locks,
nothing in flight), writes the requests and reads the answers straight into the caller's
memory on the caller's thread, with no Slice, record or deque entry; anything unexpected
ends it False and the engine redoes the list the ordinary way.

Every connection runs the cluster-secret handshake (tsukimi/auth.py) right after connecting,
within `connect_timeout_s`. An `AuthError` is final: the slices that wanted the connection
fail at once with code "auth" (no retry: another attempt cannot fix a secret).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import itertools
import logging
import math
import os
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
SPIN_S = 200e-6  # a waiting caller polls this long for each answer before it sleeps in recv (`_poll`)
RESPONSE_BYTES = wire.RESPONSE.size
# NOTE: plain ints: an enum member read through its class costs ~0.5 us on the hot path
_MAGIC, _OK, _READ, _WRITE = wire.MAGIC, int(wire.Status.OK), int(wire.Op.READ), int(wire.Op.WRITE)
_OP_READ, _OP_WRITE = OpCode.READ, OpCode.WRITE
# one request of a prepared call: reading, the ctypes array type of its length, the local
# address, the remote offset (addresses only: a remembered call keeps no caller's memory alive)
PreparedCall = tuple[bool, type[ctypes.Array[ctypes.c_char]], int, int]


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
        self.recv_lock = threading.Lock()  # one reader at a time: the receiver thread or a waiting caller
        self.ready = threading.Condition(self.lock)
        self.inflight: collections.deque[tuple[int, Slice, int, socket.socket]] = collections.deque()
        # NOTE: a counter under `lock`, not a threading.Semaphore (pure Python: ~2 us a call,
        # twice per slice); only the sender thread ever waits for a slot
        self.free_slots = link.config.pipeline_depth
        self.slot_freed = threading.Condition(self.lock)
        self._slot_wanted = False
        self.seq = itertools.count(1)
        self._head = bytearray(wire.RESPONSE.size)
        self._head_view = memoryview(self._head)
        self._heads = memoryview(bytearray(RESPONSE_BYTES * link.config.pipeline_depth))  # a prepared call's answers
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
        """Wait for a free slot (the sender thread), ending the slice instead when the
        connection stops or the slice is no longer wanted."""
        while True:
            with self.lock:
                if not self.free_slots and not self.stopping:
                    self._slot_wanted = True
                    self.slot_freed.wait(TICK_S)
                    self._slot_wanted = False
                if self.free_slots:
                    self.free_slots -= 1
                    return True
                stopping = self.stopping
            if stopping:
                piece.record.slice_failed(f"connection pool to {self.link.name} closed", ClosedError.code)
                return False
            if not self._still_wanted(piece):
                return False

    def _give_slots(self, count: int) -> None:
        with self.lock:
            self.free_slots += count
            if self._slot_wanted:
                self.slot_freed.notify()

    def try_send_inline(self, pieces: list[Slice], receive: bool = False) -> bool:
        """Send a small burst from the caller's thread when this connection is connected and
        idle (nothing queued or in flight, nobody writing): saves a thread hand-off. Never
        connects. `receive`: the caller waits for the burst next, so it reads the answers
        too (returning when they are read, or when what is left is the receiver thread's).
        False means nothing was done and the caller should queue the pieces."""
        if self.sock is None or self.inflight or not self.queue.empty():
            return False
        if not self.send_lock.acquire(blocking=False):
            return False
        try:
            with self.lock:
                if self.free_slots < len(pieces):
                    return False
                self.free_slots -= len(pieces)
            sent = self._send(pieces, may_connect=False, wake=not receive)
            if not sent:
                self._give_slots(len(pieces))
                return False
        finally:
            self.send_lock.release()
        if receive and sent:
            self._receive_own(pieces)
        return True

    def _receive_own(self, pieces: list[Slice]) -> None:
        """Read the answers to `pieces` on the caller's thread while the head in flight is one
        of them; then wake the receiver thread for anything still in flight (see the module)."""
        mine = {id(piece) for piece in pieces}
        try:
            with self.recv_lock:
                while self._receive_head(mine, spin=True):
                    pass
        finally:
            with self.lock:
                if self.inflight or self.stopping:
                    self.ready.notify()

    def _send(self, pieces: list[Slice], may_connect: bool, wake: bool = True) -> bool:
        """Write the requests (and write payloads) of `pieces`, each holding a slot; called
        with `send_lock` held. Returns False, having done nothing, only when not connected
        and `may_connect` is False. `wake`: wake the receiver thread (False: the caller reads
        the answers, `_receive_own`)."""
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
                    parts = self._enqueue(pieces, sock, gen, wake)
                    break
            if not may_connect:
                return False
            if self._hooks.probe_first(self.index):
                self._give_slots(len(pieces))
                for piece in pieces:
                    self._hooks.reroute(piece, self.index)
                self._reroute_queued()  # NOTE: nothing waits here while the probe connects
                self._probe()
                return True
            try:
                self._connect(min(piece.record.deadline for piece in pieces))
            except AuthError as exc:
                self._hooks.probed(self.index, False)
                self._give_slots(len(pieces))
                for piece in pieces:
                    where = f"{self.endpoint.host}:{self.endpoint.port}"
                    piece.record.slice_failed(f"authentication with {where} failed: {exc}", exc.code)
                return True
            except (OSError, ValueError) as exc:  # ValueError: e.g. UnicodeError from a bad host name
                self._give_slots(len(pieces))
                for piece in pieces:
                    self._hooks.retry(piece, self.index, f"cannot connect to {self.endpoint}: {exc}", False)
                return True
            self._hooks.probed(self.index, True)
        if parts is None or sock is None:  # stopping: nothing was appended
            self._give_slots(len(pieces))
            for piece in pieces:
                piece.record.slice_failed(f"connection pool to {self.link.name} closed", ClosedError.code)
            return True
        deadline = min(piece.record.deadline for piece in pieces)
        try:
            wire.send_all(sock, parts, lambda: self.stopping or self.link.clock.now() >= deadline)
        except OSError as exc:
            self._broken(gen, exc)
        return True

    def _enqueue(self, pieces: list[Slice], sock: socket.socket, gen: int, wake: bool) -> list[bytes | memoryview]:
        # Called with self.lock held: number, append and frame the pieces.
        parts: list[bytes | memoryview] = []
        for piece in pieces:
            seq = next(self.seq) & 0xFFFFFFFF
            self.inflight.append((seq, piece, gen, sock))
            writing = piece.op is _OP_WRITE
            parts.append(
                wire.REQUEST.pack(_MAGIC, _WRITE if writing else _READ, 0, seq, piece.remote_offset, len(piece.local))
            )
            if writing:
                parts.append(piece.local)
        if wake:
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
            with self.recv_lock:  # NOTE: a waiting caller may be reading its own answers
                self._receive_head(None)

    def _receive_head(self, mine: set[int] | None, spin: bool = False) -> bool:
        """Read the answer to the head in flight (only if it is one of `mine`, when given;
        polling for its header first with `spin`: `_poll`); called with `recv_lock` held.
        False when there was none to read."""
        with self.lock:
            if not self.inflight or (mine is not None and id(self.inflight[0][1]) not in mine):
                return False
            seq, piece, gen, sock = self.inflight.popleft()
        try:
            self._receive(sock, piece, seq, time.perf_counter() + SPIN_S if spin else 0.0)
        except (OSError, PeerError) as exc:  # PeerError: a protocol violation, or a stall
            self._broken(gen, exc, piece)
        else:
            self._give_slots(1)
        return True

    def _receive(self, sock: socket.socket, piece: Slice, seq: int, spin_until: float = 0.0) -> None:
        """Read the answer to `piece` (request `seq`). The common case, an answer that is
        already here, costs one recv_into for the header and one for a read's data; a wait
        goes through wire.recv_exact, which watches deadlines and stalls (`_expiry`)."""
        head = self._head_view
        got = _recv_now(sock, head, spin_until)
        if got < RESPONSE_BYTES:
            _recv_rest(sock, head, got, self._expiry(sock, piece.record.deadline, seq, 0), strict=False)
        magic, status, _flags, got_seq, length = wire.RESPONSE.unpack_from(self._head)
        if magic != _MAGIC or got_seq != seq:
            raise ProtocolError(f"bad answer header (magic {magic:#x}, request {got_seq}, expected {seq})")
        if status == _OK:
            local = piece.local
            expected = len(local) if piece.op is _OP_READ else 0
            if length != expected:
                raise ProtocolError(f"{piece.op.value} answer carries {length} bytes, expected {expected}")
            if expected:
                got = _recv_now(sock, local)
                if got < expected:
                    _recv_rest(
                        sock, local, got, self._expiry(sock, piece.record.deadline, seq, RESPONSE_BYTES), strict=True
                    )
            self.progress_at = self.link.clock.now()
            piece.record.slice_done(len(local))
            return
        response = wire.decode_response(self._head)  # raises on an unknown status
        if length > wire.MAX_REASON_BYTES:
            raise ProtocolError(f"error reason of {length} bytes is over the limit")
        reason = bytearray(length)
        wire.recv_exact(
            sock, memoryview(reason), self._expiry(sock, piece.record.deadline, seq, RESPONSE_BYTES), strict=True
        )
        code = _STATUS_CODES.get(response.status, PeerError.code)
        self.progress_at = self.link.clock.now()
        piece.record.slice_failed(reason.decode(errors="replace"), code)

    def run_prepared(self, calls: list[PreparedCall], deadline: float) -> bool | None:
        """Move `calls` on this thread if the connection is connected and idle (None, having
        done nothing, if not): requests in one sendmsg, answers scattered in place by as few
        recvmsg_into calls as the kernel allows. True when every one completed; False when any
        did not, or the deadline (the link's clock) passed: the connection is then reset (its
        stream is not where the next request expects it; nothing else was in flight on it),
        and the caller's read buffers may hold part of an answer (a one-sided read that fails
        leaves its destination undefined)."""
        if self.sock is None or self.inflight or not self.send_lock.acquire(blocking=False):
            return None
        try:
            if not self.recv_lock.acquire(blocking=False):
                return None
            try:
                with self.lock:
                    sock, gen = self.sock, self.gen
                    if sock is None or self.stopping or self.inflight:
                        return None
                    first = next(self.seq)
                    self.seq = itertools.count(first + len(calls))
                return self._run_prepared(sock, gen, calls, first, deadline)
            finally:
                self.recv_lock.release()
        finally:
            self.send_lock.release()

    def _run_prepared(
        self, sock: socket.socket, gen: int, calls: list[PreparedCall], first: int, deadline: float
    ) -> bool:
        clock, heads = self.link.clock, self._heads
        parts: list[bytes | memoryview] = []  # the requests (and write payloads), one sendmsg
        # NOTE: every answer lands with as few recvmsg_into calls as the kernel allows: headers
        # in `_heads`, read data straight into the caller's memory, all in one scatter list
        buffers: list[memoryview] = []
        head_at: list[int] = []  # the index in `buffers` of each answer's header
        views = []
        for n, (reading, array, address, remote_offset) in enumerate(calls):
            view = memoryview(array.from_address(address)).cast("B")
            views.append(view)
            op = _READ if reading else _WRITE
            parts.append(wire.REQUEST.pack(_MAGIC, op, 0, (first + n) & 0xFFFFFFFF, remote_offset, len(view)))
            head_at.append(len(buffers))
            buffers.append(heads[n * RESPONSE_BYTES : (n + 1) * RESPONSE_BYTES])
            if reading:
                buffers.append(view)
            else:
                parts.append(view)
        try:
            wire.send_all(sock, parts, lambda: self.stopping or clock.now() >= deadline)
            expired = self._expiry(sock, deadline, first & 0xFFFFFFFF, 0)
            done = checked = received = 0
            spin_until = time.perf_counter() + SPIN_S
            while done < len(buffers):
                rest = buffers[done:] if done else buffers
                try:
                    got = _poll(functools.partial(_scatter, sock, rest), spin_until)
                except (BlockingIOError, TimeoutError):
                    if expired(received):
                        raise TimeoutError(f"timed out after receiving {received} bytes of answers") from None
                    continue
                if not got:
                    raise ConnectionResetError("peer closed the connection")
                received += got
                while got:
                    size = len(buffers[done])
                    if got < size:
                        buffers[done] = buffers[done][got:]
                        break
                    got -= size
                    done += 1
                while checked < len(calls) and head_at[checked] < done:  # a whole header came: check it
                    reading = calls[checked][0]
                    _check_answer(heads, checked, (first + checked) & 0xFFFFFFFF, len(views[checked]) if reading else 0)
                    checked += 1
                if done < len(buffers) and clock.now() >= deadline:  # NOTE: a peer that trickles
                    raise TimeoutError(f"timed out after receiving {received} bytes of answers")
        except (OSError, PeerError) as exc:  # NOTE: the stream's state is unknown: reset it
            self._broken(gen, exc)
            return False
        self.progress_at = clock.now()
        return True

    def _expiry(self, sock: socket.socket, deadline: float, seq: int, base: int) -> Callable[[int], bool]:
        """recv_exact's `expired` for the answer to request `seq` due by `deadline` (the
        link's clock), `base` bytes of it already read."""
        clock = self.link.clock

        def expired(received: int) -> bool:
            # NOTE: the earliest deadline in flight, not just the head's: a stalled peer must
            # not hold a later, shorter request past its deadline.
            now = clock.now()
            with self.lock:
                tail = min((p.record.deadline for _, p, _, _ in self.inflight), default=math.inf)
            if self.stopping or now >= min(deadline, tail):
                return True
            self._watch(sock, (seq, base + received), now)
            return False

        return expired

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
                sock, self.sock = self.sock, None
        if sock is not None:
            logger.debug("connection %d to %s broke: %s", self.index, self.link.name, exc)
            _close(sock)
        timed_out = isinstance(exc, TimeoutError)
        self._give_slots(len(pieces))
        for piece in pieces:
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


def _scatter(sock: socket.socket, buffers: list[memoryview], flags: int) -> int:
    return sock.recvmsg_into(buffers, 0, flags)[0]


def _poll(receive: Callable[[int], int], until: float) -> int:
    """`receive(flags)` without blocking, yielding the CPU between tries, until some bytes
    come or `until` (time.perf_counter) passes; then once blocking (the socket's I/O tick).

    NOTE: as the RPC client's spin (tsukimi/rpc/frame.py): a thread asleep in recv is woken
    by an inter-processor interrupt when the answer lands, ~50 us on a VM; a caller that
    expects its answer within microseconds polls first. Only a waiting caller polls: the
    connection's own threads block at once.

    Raises:
        BlockingIOError: nothing came within the blocking call's I/O tick either.
        OSError: from the socket.
    """
    while True:
        try:
            return receive(socket.MSG_DONTWAIT)
        except BlockingIOError:
            if time.perf_counter() >= until:
                return receive(0)
            os.sched_yield()


def _check_answer(heads: memoryview, n: int, seq: int, length: int) -> None:
    """Check the header of a prepared call's answer `n` (in `heads`): request `seq`, OK,
    carrying `length` bytes.

    Raises:
        PeerError: the peer refused the request (its reason is left unread: the caller resets
            the connection and the ordinary path asks again).
        ProtocolError: not the answer expected.
    """
    magic, status, _flags, got_seq, got_length = wire.RESPONSE.unpack_from(heads, n * RESPONSE_BYTES)
    if magic != _MAGIC or got_seq != seq:
        raise ProtocolError(f"bad answer header (magic {magic:#x}, request {got_seq}, expected {seq})")
    if status != _OK:
        raise PeerError(f"the peer refused request {seq} (status {status})")
    if got_length != length:
        raise ProtocolError(f"answer carries {got_length} bytes, expected {length}")


def _recv_now(sock: socket.socket, view: memoryview, spin_until: float = 0.0) -> int:
    """One recv_into of `view`: the bytes it got, or -1 when none came within the socket's
    I/O tick (after polling until `spin_until`, time.perf_counter, if given: `_poll`).

    Raises:
        ConnectionResetError: the peer closed the connection.
    """
    try:
        got = _poll(lambda flags: sock.recv_into(view, 0, flags), spin_until) if spin_until else sock.recv_into(view)
    except (BlockingIOError, TimeoutError):
        return -1
    if not got:
        raise ConnectionResetError("peer closed the connection")
    return got


def _recv_rest(sock: socket.socket, view: memoryview, got: int, expired: Callable[[int], bool], strict: bool) -> None:
    """Fill `view` past its first `got` bytes (-1: `_recv_now`'s tick, asked of `expired` as
    recv_exact asks it of its own ticks; else its `strict` check of a partial read).

    Raises:
        TimeoutError: `expired` said so. What wire.recv_exact raises.
    """
    if got < 0:
        got = 0
        if expired(0):
            raise TimeoutError(f"timed out after receiving 0 of {len(view)} bytes")
    elif strict and expired(got):
        raise TimeoutError(f"timed out after receiving {got} of {len(view)} bytes")
    wire.recv_exact(sock, view[got:], lambda received: expired(got + received), strict=strict)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
