"""The RPC's bytes on TCP: endpoint strings, the frame header, and a buffered frame reader.

One frame each way per call; a reply echoes its request's id::

    0                4                                12
    | length (u32 LE)| request id (u64 LE)            | payload (length bytes: the codec's msgpack)

A length over the codec's `max_frame_bytes` is refused before anything is allocated; the
connection it arrived on cannot be resynchronized and is closed (by the caller).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Callable

from tsukimi import netio
from tsukimi.errors import ConfigError, ProtocolError

HEADER = struct.Struct("<IQ")
_BUFFER_BYTES = 64 << 10  # frames up to this size arrive with one recv; larger ones get their own buffer

# Asked on each socket tick (and after each partial chunk) with whether part of a frame has
# arrived: True gives up (the reader raises TimeoutError).
Expired = Callable[[bool], bool]


def send_frame(sock: socket.socket, request_id: int, payload: bytes, expired: Callable[[], bool]) -> None:
    """Send one frame: one sendmsg in the common case, then `netio.send_all` for any rest.

    Raises:
        TimeoutError: `expired()` said so at a socket tick or after a partial send.
        OSError: from the socket.
    """
    head = HEADER.pack(len(payload), request_id)
    try:
        sent = sock.sendmsg((head, payload))
    except (BlockingIOError, TimeoutError):  # a tick with nothing sent: send_all asks `expired`
        sent = 0
    if sent < HEADER.size + len(payload):
        netio.send_all(sock, (head[sent:], memoryview(payload)[max(0, sent - HEADER.size) :]), expired)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split "tcp://HOST:PORT" ("*" = every interface, IPv6 in brackets) into (host, port); pure.

    Raises:
        ConfigError: not a tcp endpoint with a port in 0..65535.
    """
    scheme, sep, rest = endpoint.partition("://")
    host, colon, port_text = rest.rpartition(":")
    if scheme != "tcp" or not sep or not colon or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ConfigError(f"invalid rpc endpoint {endpoint!r}: expected tcp://HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return ("0.0.0.0" if host == "*" else host), int(port_text)


def format_endpoint(host: str, port: int) -> str:
    """The inverse of `parse_endpoint`; pure."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class FrameReader:
    """Reads frames from one connected socket through a reusable buffer (not thread-safe).

    A small frame usually costs one recv; bytes of a following frame stay buffered (a peer
    may pipeline). The socket must carry an I/O timeout (`netio.set_io_timeout`): its ticks
    are when `expired` is asked.
    """

    def __init__(self, sock: socket.socket, max_payload_bytes: int) -> None:
        self._sock = sock
        self._max_payload_bytes = max_payload_bytes
        self._buf = bytearray(_BUFFER_BYTES)
        self._view = memoryview(self._buf)
        self._start = 0  # buffered bytes are _buf[_start:_end]
        self._end = 0

    @property
    def buffered_bytes(self) -> int:
        """Bytes received beyond the frames returned so far."""
        return self._end - self._start

    def read(self, expired: Expired) -> tuple[int, memoryview]:
        """Receive the next frame (blocks; mutates the buffer).

        Returns:
            (request id, payload); the payload view is valid until the next `read`.

        Raises:
            ProtocolError: the length prefix is over the limit (nothing of the payload is read).
            TimeoutError: `expired` said so.
            ConnectionResetError: the peer closed the connection.
            OSError: from the socket.
        """
        self._fill(HEADER.size, expired)
        length, request_id = HEADER.unpack_from(self._buf, self._start)
        if length > self._max_payload_bytes:
            raise ProtocolError(f"frame of {length} bytes exceeds the {self._max_payload_bytes}-byte limit")
        total = HEADER.size + length
        if total <= len(self._buf):
            self._fill(total, expired)
            start, self._start = self._start, self._start + total
            return request_id, self._view[start + HEADER.size : start + total]
        body = bytearray(length)
        have = self._end - self._start - HEADER.size  # < length: the buffer is smaller than the frame
        body[:have] = self._view[self._start + HEADER.size : self._end]
        self._start = self._end = 0
        netio.recv_exact(self._sock, memoryview(body)[have:], lambda _: expired(True), strict=True)
        return request_id, memoryview(body)

    def spin(self, seconds: float) -> None:
        """Poll the socket without blocking for up to `seconds`, until some bytes arrive (mutates).

        NOTE: a thread blocked in recv is woken by the kernel when the reply lands, which on a
        virtual machine costs ~50 us when the sender ran on another CPU (an inter-processor
        interrupt); a thread that is still running when the reply lands pays nothing. A caller
        that expects an answer within microseconds spins here first, then `read` blocks as usual.
        Each round yields the CPU, so a peer scheduled on the same CPU is not held up.

        Raises:
            OSError: from the socket (the connection failed).
        """
        if seconds <= 0 or self._end > self._start or self._end == len(self._buf):
            return
        sock, view = self._sock, self._view[self._end :]
        clock = time.perf_counter
        deadline = clock() + seconds
        while True:
            try:
                got = sock.recv_into(view, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if clock() >= deadline:
                    return
                os.sched_yield()
                continue
            self._end += got  # 0 = the peer closed: `read` finds out on its next recv
            return

    def _fill(self, size: int, expired: Expired) -> None:
        """Receive until at least `size` bytes are buffered (`size` <= the buffer's size)."""
        if self._end - self._start >= size:
            return
        if self._start + size > len(self._buf):  # compact: the frame must fit after _start
            held = self._end - self._start
            self._buf[:held] = bytes(self._view[self._start : self._end])  # the ranges may overlap
            self._start, self._end = 0, held
        sock, view = self._sock, self._view
        while self._end - self._start < size:
            try:
                got = sock.recv_into(view[self._end :])
            except (BlockingIOError, TimeoutError):
                if expired(self._end > self._start):
                    raise TimeoutError(f"timed out with {self._end - self._start} of {size} bytes") from None
                continue
            if got == 0:
                raise ConnectionResetError("peer closed the connection")
            self._end += got
            if self._end - self._start < size and expired(True):
                raise TimeoutError(f"timed out with {self._end - self._start} of {size} bytes")
