"""Time, injected: nothing else in tsukimi calls time.time() or sleep() directly.

`WallClock` is the real clock; `VirtualClock` is advanced by hand (tests) or by the
simulator's event loop, so the same state machines run live and simulated.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """What a component needs from time: a monotonic reading and a way to wait."""

    def now(self) -> float:
        """Seconds on a monotonic scale (not wall-calendar time)."""
        ...

    def sleep(self, seconds: float) -> None:
        """Block the calling thread for `seconds` of this clock's time."""
        ...


class WallClock:
    """The real monotonic clock."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class VirtualClock:
    """A clock that only moves when told to; `sleep` advances it instead of blocking.

    Thread-safe. `advance` never goes backwards.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._now

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> float:
        """Move time forward by `seconds` (>= 0) and return the new reading."""
        if seconds < 0:
            raise ValueError(f"cannot move a clock backwards by {seconds}")
        with self._lock:
            self._now += seconds
            return self._now

    def set(self, when: float) -> None:
        """Jump to `when`, which must not be earlier than now."""
        with self._lock:
            if when < self._now:
                raise ValueError(f"cannot move a clock back from {self._now} to {when}")
            self._now = when
