"""The link between neighbouring stages of a prefill group (tsukimi/serving/prefill_group/stage.py):
one TCP connection carrying length-framed messages both ways.

    downstream (stage i -> i + 1)   BEGIN  request, payload: the prompt's token ids (int64)
                                    CHUNK  request, start, count, payload: hidden [count, hidden]
    upstream   (stage i + 1 -> i)   RESULT request, start = the first token
                                    ERROR  request, payload: a (code, message) pair, UTF-8 JSON

    frame = | magic "TSCP" | kind u8 | pad 3 | request u64 | start u32 | count u32 | payload u64 | payload |

A reader thread per link receives frames as they come and puts them in the owner's inbox, so
a sender never waits for its neighbour to finish computing (stage i sends chunk c + 1 while
stage i + 1 still computes chunk c). Sends come from one thread at a time (a lock).

NOTE: a plain framed socket, not the Transfer Engine: a chunk's hidden states are small
(512 tokens x 256 floats = 512 KiB on the tiny model) and follow a control message anyway.
"""

from __future__ import annotations

import logging
import queue
import socket
import struct
import threading
from dataclasses import dataclass
from enum import IntEnum

from tsukimi import netio
from tsukimi.clock import WallClock
from tsukimi.errors import BrokenConnectionError, ProtocolError

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<4sB3xQIIQ")
_MAGIC = b"TSCP"
_TICK_S = 0.5
MAX_PAYLOAD_BYTES = 1 << 30


Payload = bytes | bytearray | memoryview


class FrameKind(IntEnum):
    BEGIN = 1
    CHUNK = 2
    RESULT = 3
    ERROR = 4


@dataclass(frozen=True, slots=True)
class Frame:
    """One message; `link` names the link it came in on ("up" or "down"); a None kind means
    the link broke (`payload` then holds the reason)."""

    kind: FrameKind | None
    request: int
    start: int = 0
    count: int = 0
    payload: bytes | bytearray = b""
    link: str = ""


class StageLink:
    """One connected socket to a neighbour stage; frames read go to `inbox` (see the module)."""

    def __init__(self, sock: socket.socket, inbox: queue.Queue[Frame], name: str) -> None:
        self.sock, self.inbox, self.name = sock, inbox, name
        self._closed = threading.Event()
        self._send_lock = threading.Lock()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        netio.set_io_timeout(sock, _TICK_S)
        self._reader = threading.Thread(target=self._read_forever, name=f"tsukimi-cpp-{name}", daemon=True)
        self._reader.start()

    def send(
        self,
        kind: FrameKind,
        request: int,
        start: int = 0,
        count: int = 0,
        payload: Payload = b"",
    ) -> None:
        """Send one frame (thread-safe). Raises BrokenConnectionError when the link is down."""
        header = _HEADER.pack(_MAGIC, kind, request, start, count, len(payload))
        try:
            with self._send_lock:
                netio.send_all(self.sock, [header, memoryview(payload)], lambda: self._closed.is_set())
        except OSError as exc:
            raise BrokenConnectionError(f"CPP link {self.name}: {exc}") from exc

    def close(self) -> None:
        """Close the socket and stop the reader (idempotent; waits for it at most a tick)."""
        self._closed.set()
        self.sock.close()
        if self._reader is not threading.current_thread():
            self._reader.join(timeout=2 * _TICK_S)

    def _read_forever(self) -> None:
        header = bytearray(_HEADER.size)
        try:
            while not self._closed.is_set():
                netio.recv_exact(self.sock, memoryview(header), lambda _: self._closed.is_set())
                magic, kind, request, start, count, size = _HEADER.unpack(header)
                if magic != _MAGIC or size > MAX_PAYLOAD_BYTES or kind not in FrameKind._value2member_map_:
                    raise ProtocolError(f"CPP link {self.name}: a bad frame header")
                payload = bytearray(size)
                netio.recv_exact(self.sock, memoryview(payload), lambda _: self._closed.is_set())
                self.inbox.put(Frame(FrameKind(kind), request, start, count, payload, self.name))
        except (OSError, ProtocolError) as exc:
            if not self._closed.is_set():
                logger.warning("CPP link %s broke: %s", self.name, exc)
                self.inbox.put(Frame(None, 0, payload=str(exc).encode(), link=self.name))


def connect(address: str, inbox: queue.Queue[Frame], name: str, timeout_s: float) -> StageLink:
    """A link to HOST:PORT, retried until `timeout_s` (the neighbour may still be starting).

    Raises:
        BrokenConnectionError: it could not connect in time.
    """
    host, _, port = address.rpartition(":")
    clock = WallClock()
    deadline = clock.now() + timeout_s
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=max(0.1, deadline - clock.now()))
        except OSError as exc:
            if clock.now() > deadline:
                raise BrokenConnectionError(f"could not reach CPP stage {address}: {exc}") from exc
            clock.sleep(0.05)
            continue
        return StageLink(sock, inbox, name)
