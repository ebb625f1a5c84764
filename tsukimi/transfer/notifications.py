"""Notifications: small messages one engine delivers into a peer's inbox (Mooncake's
TransferNotify / get_notifies).

The sender calls `TransferEngine.notify(segment, Notification(name, message))`; the peer's
segment server puts it in that engine's `NotificationInbox`, and the peer's application takes
it with `TransferEngine.notifications()`. A notification sent after `transfer()` returned
arrives after the data it announces is in place: the transfer completed first.

The inbox is bounded twice, by count and by bytes; when full, a NOTIFY is answered BUSY and the
sender gets a PeerError (the receiver is not draining): nothing is dropped silently.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass

from tsukimi.errors import ConfigError

MAX_QUEUED = 4096
MAX_QUEUED_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class Notification:
    """`name` says what it is about (a request id, say), `message` carries the rest; both are
    the application's. Encoded, they take at most wire.MAX_NOTIFY_BYTES."""

    name: str
    message: bytes = b""

    @property
    def nbytes(self) -> int:
        return len(self.name.encode()) + len(self.message)


class NotificationInbox:
    """The notifications peers delivered to this engine, oldest first. Thread-safe."""

    def __init__(self, max_count: int = MAX_QUEUED, max_bytes: int = MAX_QUEUED_BYTES) -> None:
        if max_count <= 0 or max_bytes <= 0:
            raise ConfigError(f"an inbox needs room: max_count={max_count}, max_bytes={max_bytes}")
        self._max_count = max_count
        self._max_bytes = max_bytes
        self._queued: collections.deque[Notification] = collections.deque()
        self._bytes = 0
        self._arrived = threading.Condition()

    def put(self, notification: Notification) -> bool:
        """Queue `notification` (mutates); False, queuing nothing, when the inbox is full."""
        with self._arrived:
            size = notification.nbytes
            if len(self._queued) >= self._max_count or self._bytes + size > self._max_bytes:
                return False
            self._queued.append(notification)
            self._bytes += size
            self._arrived.notify_all()
        return True

    def take(self, max_count: int | None = None, timeout_s: float = 0.0) -> list[Notification]:
        """Remove and return up to `max_count` (all when None) queued notifications, oldest
        first; when none is queued, wait up to `timeout_s` for one (mutates)."""
        if max_count is not None and max_count <= 0:
            raise ConfigError(f"max_count must be positive, got {max_count}")
        # NOTE: real time: this waits on threads that real sockets wake
        deadline = time.monotonic() + timeout_s
        with self._arrived:
            while not self._queued and (left := deadline - time.monotonic()) > 0:
                self._arrived.wait(left)
            count = len(self._queued) if max_count is None else min(max_count, len(self._queued))
            taken = [self._queued.popleft() for _ in range(count)]
            self._bytes -= sum(n.nbytes for n in taken)
        return taken

    def __len__(self) -> int:
        return len(self._queued)
