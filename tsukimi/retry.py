"""One retry policy for every place that tries something again.

A `Retry` says how many tries an operation gets, within how long, how long to wait between
them, and which errors are worth another try. Each caller builds its policy once (from its
settings) and runs every operation's tries through `Attempts`; none writes its own loop:

    | who                          | attempts           | deadline           | backoff | on                         |
    |------------------------------|--------------------|--------------------|---------|----------------------------|
    | RpcClient, unsent request    | until the deadline | the call's         | 20 ms   | not sent (nothing left)    |
    | MasterLink (etcd:// masters) | until the deadline | failover_timeout_s | 50 ms   | NotLeader, timeouts, drops |
    | TCP transport, one slice     | max_retries + 1    | the request's      | none    | a broken connection        |
    | router: prefill / colocated  | one per worker     | -                  | none    | WorkerUnavailable          |
    | router: discovering workers  | until the deadline | startup_timeout_s  | 50 ms   | a silent worker            |
    | router: connect to /generate | 3                  | -                  | none    | ConnectTimeout             |

    attempts = policy.start(clock)
    while True:
        try:
            return operation(timeout_s=attempts.remaining_s())
        except Exception as exc:
            if not attempts.wait(exc):   # not retriable, out of tries or past the deadline
                raise

Waits go through the injected `Clock` (or an interruptible `threading.Event`), so the
policy runs unchanged under a VirtualClock.
"""

from __future__ import annotations

import asyncio
import math
import threading
from dataclasses import dataclass

from tsukimi.clock import Clock
from tsukimi.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Retry:
    """How an operation is tried again (frozen; build once per caller).

    attempts: tries in all, the first included (1: never retry); None: until the deadline.
    deadline_s: time allowed from the first try (None: no limit of its own; `start` may
        still be given an absolute deadline).
    backoff_s: the wait before the second try; each later wait is `multiplier` times the
        one before, at most `max_backoff_s`, and never past the deadline.
    on: the error types worth another try; an error of another type ends the operation.
    """

    attempts: int | None = 3
    deadline_s: float | None = None
    backoff_s: float = 0.0
    multiplier: float = 1.0
    max_backoff_s: float = 1.0
    on: tuple[type[BaseException], ...] = (Exception,)

    def __post_init__(self) -> None:
        if self.attempts is not None and self.attempts < 1:
            raise ConfigError(f"retry attempts must be >= 1 (or None), got {self.attempts}")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ConfigError(f"retry deadline_s must be > 0, got {self.deadline_s}")
        if not (0 <= self.backoff_s <= self.max_backoff_s) or self.multiplier < 1:
            raise ConfigError("retry backoff must satisfy 0 <= backoff_s <= max_backoff_s and multiplier >= 1")

    def allows(self, failures: int, error: BaseException | None = None) -> bool:
        """Whether another try may follow `failures` failed ones, the last failing with
        `error` (None: a failure that is no exception, e.g. a peer still silent). Pure."""
        if error is not None and not isinstance(error, self.on):
            return False
        return self.attempts is None or failures < self.attempts

    def delay_s(self, failures: int) -> float:
        """The wait after `failures` (>= 1) failed tries (pure)."""
        return min(self.max_backoff_s, self.backoff_s * self.multiplier ** max(0, failures - 1))

    def start(self, clock: Clock, deadline: float = math.inf) -> Attempts:
        """The tries of one operation starting now; `deadline` (on `clock`) caps `deadline_s`."""
        if self.deadline_s is not None:
            deadline = min(deadline, clock.now() + self.deadline_s)
        return Attempts(self, clock, deadline)


class Attempts:
    """The tries of one operation under a `Retry` (mutable; one thread or one task)."""

    __slots__ = ("clock", "deadline", "failures", "policy")

    def __init__(self, policy: Retry, clock: Clock, deadline: float) -> None:
        self.policy, self.clock, self.deadline = policy, clock, deadline
        self.failures = 0

    def remaining_s(self) -> float:
        """Seconds left before the deadline (inf when there is none; never negative)."""
        return max(0.0, self.deadline - self.clock.now())

    def next_delay(self, error: BaseException | None = None) -> float | None:
        """Record a failed try; the wait before the next one, or None when there is none
        (the error is not retriable, the tries are used up, or the deadline passed)."""
        self.failures += 1
        if not self.policy.allows(self.failures, error) or self.clock.now() >= self.deadline:
            return None
        return min(self.policy.delay_s(self.failures), self.remaining_s())

    def wait(self, error: BaseException | None = None, stop: threading.Event | None = None) -> bool:
        """Record a failed try and wait out the backoff: True to try again, False when the
        operation must end (also when `stop` is set before or during the wait)."""
        delay = self.next_delay(error)
        if delay is None or (stop is not None and stop.is_set()):
            return False
        if stop is not None:
            return not stop.wait(delay)
        self.clock.sleep(delay)
        return True

    async def wait_async(self, error: BaseException | None = None) -> bool:
        """`wait` for asyncio code (the backoff is an asyncio sleep on the event loop's time)."""
        delay = self.next_delay(error)
        if delay is None:
            return False
        if delay > 0:
            await asyncio.sleep(delay)
        return True
