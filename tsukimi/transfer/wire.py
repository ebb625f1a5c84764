"""The TCP transport's frame format, shared by the client (transports/tcp.py) and the
segment server (server.py). Fixed-size little-endian headers; payloads follow raw.

Request (24 bytes), then `length` payload bytes for WRITE, HANDSHAKE and NOTIFY::

    0      2    3      4        8                16               24
    | magic| op | flags| seq    | offset (u64)   | length (u64)   |

Response (16 bytes), then `length` payload bytes: the data of a READ, the descriptor of a
HANDSHAKE, nothing for NOTIFY and PING, or a UTF-8 reason when status != OK::

    0      2        3      4        8                16
    | magic| status | flags| seq    | length (u64)   |

A NOTIFY payload is one notification (at most MAX_NOTIFY_BYTES in all)::

    0             2                      2 + n
    | n (u16)     | name (n bytes UTF-8) | message (the rest) |

Every length is bounded before anything is allocated or read (`decode_request`).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from tsukimi.errors import InvalidArgument, ProtocolError
from tsukimi.netio import recv_exact, send_all, set_io_timeout

__all__ = ["recv_exact", "send_all", "set_io_timeout"]  # re-exported: the data path uses them via wire

MAGIC = 0x6D74  # "tm"
REQUEST = struct.Struct("<HBBIQQ")
RESPONSE = struct.Struct("<HBBIQ")
MAX_REASON_BYTES = 4096
MAX_DESCRIPTOR_BYTES = 1 << 20
MAX_NOTIFY_BYTES = 64 << 10
NOTIFY_NAME = struct.Struct("<H")


class Op(enum.IntEnum):
    """What a request frame asks the segment server to do."""

    READ = 1
    WRITE = 2
    HANDSHAKE = 3  # payload: the caller's descriptor (may be empty); reply: the server's
    NOTIFY = 4  # payload: a notification (see the module); reply: empty (BUSY: the queue is full)
    PING = 5  # no payload; reply: empty (the peer is alive and serving)


class Status(enum.IntEnum):
    """How the segment server answered a request."""

    OK = 0
    OUT_OF_BOUNDS = 1
    BAD_REQUEST = 2
    SERVER_ERROR = 3
    BUSY = 4  # the server cannot take this now (its notification queue is full): try later


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


_LIMITS = {Op.HANDSHAKE: MAX_DESCRIPTOR_BYTES, Op.NOTIFY: MAX_NOTIFY_BYTES, Op.PING: 0}


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
    limit = _LIMITS.get(kind, max_slice_bytes)
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


def encode_notification(name: str, message: bytes) -> bytes:
    """A NOTIFY payload (pure).

    Raises:
        InvalidArgument: the name is over 65535 bytes or the whole over MAX_NOTIFY_BYTES.
    """
    raw = name.encode()
    size = NOTIFY_NAME.size + len(raw) + len(message)
    if len(raw) > 0xFFFF or size > MAX_NOTIFY_BYTES:
        raise InvalidArgument(f"a notification holds at most {MAX_NOTIFY_BYTES} bytes in all, got {size}")
    return NOTIFY_NAME.pack(len(raw)) + raw + message


def decode_notification(payload: bytes | bytearray | memoryview) -> tuple[str, bytes]:
    """(name, message) of a NOTIFY payload (pure).

    Raises:
        ProtocolError: shorter than its name length says, or a name that is not UTF-8.
    """
    if len(payload) < NOTIFY_NAME.size:
        raise ProtocolError(f"a notification of {len(payload)} bytes has no name length")
    (size,) = NOTIFY_NAME.unpack_from(payload)
    end = NOTIFY_NAME.size + size
    if end > len(payload):
        raise ProtocolError(f"a notification's name of {size} bytes overruns its {len(payload)} bytes")
    try:
        name = bytes(payload[NOTIFY_NAME.size : end]).decode()
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"a notification's name is not UTF-8: {exc}") from None
    return name, bytes(payload[end:])
