"""The TCP transport's frame format, shared by the client (transports/tcp.py) and the
segment server (server.py). Fixed-size little-endian headers; payloads follow raw.

Request (24 bytes), then `length` payload bytes for WRITE and HANDSHAKE::

    0      2    3      4        8                16               24
    | magic| op | flags| seq    | offset (u64)   | length (u64)   |

Response (16 bytes), then `length` payload bytes: the data of a READ, the descriptor of a
HANDSHAKE, or a UTF-8 reason when status != OK::

    0      2        3      4        8                16
    | magic| status | flags| seq    | length (u64)   |

Every length is bounded before anything is allocated or read (`FrameLimits`).
"""

from __future__ import annotations

import enum
import socket
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tsukimi.errors import ProtocolError

MAGIC = 0x6D74  # "tm"
REQUEST = struct.Struct("<HBBIQQ")
RESPONSE = struct.Struct("<HBBIQ")
MAX_REASON_BYTES = 4096
MAX_DESCRIPTOR_BYTES = 1 << 20


class Op(enum.IntEnum):
    """What a request frame asks the segment server to do."""

    READ = 1
    WRITE = 2
    HANDSHAKE = 3  # payload: the caller's descriptor (may be empty); reply: the server's


class Status(enum.IntEnum):
    """How the segment server answered a request."""

    OK = 0
    OUT_OF_BOUNDS = 1
    BAD_REQUEST = 2
    SERVER_ERROR = 3


@dataclass(frozen=True, slots=True)
class RequestHeader:
    op: Op
    seq: int
    offset: int
    length: int

    def pack(self) -> bytes:
        return REQUEST.pack(MAGIC, self.op, 0, self.seq, self.offset, self.length)


@dataclass(frozen=True, slots=True)
class ResponseHeader:
    status: Status
    seq: int
    length: int

    def pack(self) -> bytes:
        return RESPONSE.pack(MAGIC, self.status, 0, self.seq, self.length)


def decode_request(frame: bytes | bytearray | memoryview, max_slice_bytes: int) -> RequestHeader:
    """Parse and bound-check a request header.

    Raises:
        ProtocolError: bad magic, unknown op, or a length over its bound.
    """
    magic, op, _flags, seq, offset, length = REQUEST.unpack(frame)
    if magic != MAGIC:
        raise ProtocolError(f"bad request magic {magic:#x}")
    try:
        kind = Op(op)
    except ValueError:
        raise ProtocolError(f"unknown op {op}") from None
    limit = MAX_DESCRIPTOR_BYTES if kind is Op.HANDSHAKE else max_slice_bytes
    if length > limit:
        raise ProtocolError(f"{kind.name} length {length} exceeds the limit {limit}")
    if offset + length >= 1 << 64:
        raise ProtocolError("offset + length overflows 64 bits")
    return RequestHeader(kind, seq, offset, length)


def decode_response(frame: bytes | bytearray | memoryview) -> ResponseHeader:
    """Parse a response header (payload bounds are checked by the caller, who knows them).

    Raises:
        ProtocolError: bad magic or unknown status.
    """
    magic, status, _flags, seq, length = RESPONSE.unpack(frame)
    if magic != MAGIC:
        raise ProtocolError(f"bad response magic {magic:#x}")
    try:
        return ResponseHeader(Status(status), seq, length)
    except ValueError:
        raise ProtocolError(f"unknown status {status}") from None


def set_io_timeout(sock: socket.socket, seconds: float) -> None:
    """Bound every blocking send/recv on `sock` in the kernel (SO_RCVTIMEO/SO_SNDTIMEO).

    NOTE: unlike sock.settimeout(), this keeps the socket in blocking mode, so Python does not
    poll() before each recv: the data path costs one syscall per chunk, as a raw stream does.
    An expired wait raises BlockingIOError, which callers treat as a tick (see recv_exact).
    """
    whole = int(seconds)
    tv = struct.pack("ll", whole, int((seconds - whole) * 1e6) or (0 if whole else 1000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def recv_exact(
    sock: socket.socket, view: memoryview, expired: Callable[[int], bool] | None = None, strict: bool = False
) -> None:
    """Fill `view` completely from `sock` (zero-copy recv_into).

    Each time the socket's I/O timeout ticks, `expired(bytes_received_so_far)` decides
    whether to give up (True) or keep waiting; without it a tick is a timeout. With
    `strict`, it is also asked after every partial chunk, so a peer that trickles bytes
    cannot stretch a deadline.

    Raises:
        ConnectionResetError: the peer closed the connection first.
        TimeoutError: the wait expired.
        OSError: from the socket.
    """
    pos, size = 0, len(view)
    while pos < size:
        try:
            got = sock.recv_into(view[pos:], size - pos)
        except (BlockingIOError, TimeoutError):
            if expired is None or expired(pos):
                raise TimeoutError(f"timed out after receiving {pos} of {size} bytes") from None
            continue
        if got == 0:
            raise ConnectionResetError("peer closed the connection")
        pos += got
        if strict and pos < size and expired is not None and expired(pos):
            raise TimeoutError(f"timed out after receiving {pos} of {size} bytes")


def send_all(
    sock: socket.socket, parts: Sequence[bytes | memoryview], expired: Callable[[], bool] | None = None
) -> None:
    """Send every byte of `parts` with as few syscalls as possible (sendmsg, no joining).

    Raises TimeoutError when `expired()` is True (or absent) at an I/O-timeout tick or after
    a partial send.
    """
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        try:
            sent = sock.sendmsg(views)
        except (BlockingIOError, TimeoutError):
            if expired is None or expired():
                raise TimeoutError("timed out while sending") from None
            continue
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]
        if views and expired is not None and expired():
            raise TimeoutError("timed out while sending")
