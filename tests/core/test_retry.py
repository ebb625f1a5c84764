"""The one retry policy (tsukimi/retry.py), under a VirtualClock."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tsukimi.clock import VirtualClock
from tsukimi.errors import ConfigError, NotLeader, OutOfSpace, RpcTimeout
from tsukimi.retry import Retry


def test_tries_stop_after_the_attempts_and_backoff_grows_up_to_its_cap() -> None:
    clock = VirtualClock()
    attempts = Retry(attempts=5, backoff_s=0.1, multiplier=2.0, max_backoff_s=0.3).start(clock)
    waits = []
    while True:
        before = clock.now()
        if not attempts.wait(RpcTimeout("late")):
            break
        waits.append(round(clock.now() - before, 9))
    assert waits == [0.1, 0.2, 0.3, 0.3]  # five tries, four waits between them
    assert attempts.failures == 5


def test_the_deadline_bounds_both_the_tries_and_the_last_wait() -> None:
    clock = VirtualClock()
    attempts = Retry(attempts=None, deadline_s=1.0, backoff_s=0.4).start(clock)
    assert attempts.remaining_s() == 1.0
    assert attempts.wait() and attempts.wait()  # t = 0.8
    assert attempts.next_delay() == pytest.approx(0.2)  # cut to the deadline
    clock.set(1.0)
    assert not attempts.wait() and attempts.remaining_s() == 0.0
    # an absolute deadline given to start() wins when earlier
    assert Retry(attempts=None, deadline_s=5.0).start(clock, deadline=1.5).remaining_s() == 0.5


def test_only_the_named_errors_are_retried() -> None:
    policy = Retry(attempts=3, on=(NotLeader, RpcTimeout))
    assert policy.allows(1, NotLeader("x")) and policy.allows(2, RpcTimeout("y"))
    assert not policy.allows(1, OutOfSpace("full")) and not policy.allows(3, NotLeader("x"))
    assert policy.allows(1, None)  # a failure that is no exception (a silent peer) counts as retriable


def test_a_stop_event_ends_the_wait_and_the_operation() -> None:
    stop = threading.Event()
    attempts = Retry(attempts=None, deadline_s=60.0, backoff_s=30.0, max_backoff_s=30.0).start(VirtualClock())
    threading.Timer(0.05, stop.set).start()
    assert not attempts.wait(None, stop)  # returns when stopped, not after 30 s
    assert not attempts.wait(None, stop)  # and at once once stopped


def test_async_waits_use_the_event_loop() -> None:
    attempts = Retry(attempts=2, backoff_s=0.01).start(VirtualClock())

    async def go() -> list[bool]:
        return [await attempts.wait_async(), await attempts.wait_async()]

    assert asyncio.run(go()) == [True, False]


@pytest.mark.parametrize(
    "kwargs", [{"attempts": 0}, {"deadline_s": 0.0}, {"backoff_s": 2.0, "max_backoff_s": 1.0}, {"multiplier": 0.5}]
)
def test_bad_policies_are_config_errors(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        Retry(**kwargs)  # type: ignore[arg-type]
