"""Which workers are up, whatever their backend: discovery at start, then a poll of every worker
every `poll_interval_s`, marking each up or down.

    discover  health + poll every worker until all answer or startup_timeout_s passes (a Retry);
              those still silent are marked down
    refresh   poll (after health, whose role must match, when discovering or the worker was
              down: one back up may have restarted, with new KV event ports) -> up or down
    poll      refresh every worker every poll_interval_s, for ever

A worker is marked down at once when a poll fails outright (refused, broken, garbage), but only
after `DOWN_AFTER_MISSES` polls in a row that were late (`RpcTimeout`): under overload the
router's own event loop lags, and one late answer marked every worker down at the same moment
(503 bursts, found by `tsukimi bench serve --workload overload`). A worker marked down is marked
up again as soon as it answers a poll (a restarted one: tsukimi/serving/cluster/supervisor.py).
A stream that finds its worker unreachable marks it down too (the backends do).

Runs on the router's event loop (the handles are plain mutable records).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from tsukimi.clock import Clock
from tsukimi.errors import ConfigError, RpcTimeout, WorkerError
from tsukimi.retry import Retry
from tsukimi.serving.router.backend import RouterBackend
from tsukimi.serving.router.workers import WorkerHandle

logger = logging.getLogger(__name__)

DOWN_AFTER_MISSES = 3  # polls in a row that were late before a worker is marked down
_DISCOVER_BACKOFF_S = 0.05


class Liveness:
    """Discovers and polls the workers through `backend` (see the module).

    Args:
        backend: reaches the workers. clock: bounds discovery.
        poll_interval_s: how often `poll_forever` refreshes the workers.
    """

    def __init__(self, backend: RouterBackend, clock: Clock, poll_interval_s: float) -> None:
        self.backend, self.clock, self.poll_interval_s = backend, clock, poll_interval_s

    async def discover(self, workers: Sequence[WorkerHandle], timeout_s: float) -> None:
        """Refreshes with health until every worker answered or `timeout_s` passed; those still
        silent stay marked down (mutates). Raises ConfigError on a role mismatch."""
        attempts = Retry(attempts=None, deadline_s=timeout_s, backoff_s=_DISCOVER_BACKOFF_S).start(self.clock)
        pending = list(workers)
        while True:
            answered = await asyncio.gather(*(self.refresh(w, health=True) for w in pending))
            pending = [w for w, ok in zip(pending, answered, strict=True) if not ok]
            if not pending or not await attempts.wait_async():
                break
        if pending:
            for worker in pending:
                worker.healthy = False
            names = ", ".join(w.spec.name for w in pending)
            logger.warning("workers %s did not answer within %s s; marked down", names, timeout_s)

    async def refresh(self, worker: WorkerHandle, health: bool = False) -> bool:
        """Polls `worker` (after its health when `health` or it was down) and marks it up or
        down (mutates). Returns whether it answered. Raises ConfigError on a role mismatch."""
        health = health or not worker.healthy
        try:
            info = await self.backend.health(worker) if health else None
            load = await self.backend.poll(worker)
        except (RpcTimeout, WorkerError) as exc:
            worker.misses += 1
            late = isinstance(exc, RpcTimeout) and worker.misses < DOWN_AFTER_MISSES
            if worker.healthy and not late:
                logger.warning("worker %s is down: %s", worker.spec.name, exc)
                worker.healthy = False
            return False
        if info is not None and info.role != worker.spec.role:
            raise ConfigError(f"worker {worker.spec.name} is declared {worker.spec.role} but reports {info.role}")
        if not worker.healthy:
            logger.info("worker %s is up", worker.spec.name)
        if info is not None:
            worker.block_tokens = info.block_tokens
            worker.events = self.backend.events(worker, info)
            worker.cpp, worker.cost = info.cpp, info.cost
        worker.load, worker.healthy, worker.misses = load, True, 0
        return True

    async def poll_forever(self, workers: Sequence[WorkerHandle], on_poll: Callable[[], None] | None = None) -> None:
        """Refreshes every worker every `poll_interval_s` until cancelled, calling `on_poll`
        after each round (mutates)."""
        while True:
            await asyncio.sleep(self.poll_interval_s)
            await asyncio.gather(*(self.refresh(w) for w in workers))
            if on_poll is not None:
                on_poll()
