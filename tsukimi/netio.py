"""Blocking socket I/O with kernel timeouts and deadline callbacks, shared by the Transfer
Engine (transfer/wire.py, transfer/server.py), the control-plane RPC (rpc/) and the
cluster-secret handshake (auth.py). The server base those build on is tsukimi/netserver.py."""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)


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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago (bind port 0, close).

    NOTE: racy by nature (another process may take it before the caller binds); callers that
    can, bind port 0 themselves, and the others retry on a clash.
    """
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
