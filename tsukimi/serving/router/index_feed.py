"""The router's prefix index fed by its workers' KV events, and what the index expects a
prefill worker to reuse, to check it against what the worker did reuse.

    worker p: its publisher --PUB--> EventSubscriber (one per worker, on the router's event
        loop) --> InstanceEvents(p) --> index: "p/TIER" (its own cache: "dram" for a tsukimi
        worker's block pool, "hbm" for a vLLM instance's) and, when the backend's workers pool
        every block they store, "pool/dram"

Which workers publish, and where, is the backend's to say (`CacheKeys.events`, read at each
worker's discovery: tsukimi's prefill workers from their /health, vLLM instances from the
config); a worker without a source feeds nothing. The index learns only from events: the
router records nothing itself when a prefill finishes.

NOTE: the pool's own evictions are not published (the store master evicts on its own), so
"pool/dram" over-approximates the pool once it fills. After a live update the workers salt
their block hashes with the new weights version (tsukimi/engine/block_manager.py); the router
salts its own the same way once every worker reported that version (Router.update_weights).

Applying a batch costs microseconds per block and runs between decisions on the same loop
(the index and the Conductor are not thread-safe), never during one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import zmq.asyncio

from tsukimi.scheduler.index_sync import InstanceEvents
from tsukimi.scheduler.prefix_index import PrefixIndex, Tier, location
from tsukimi.serving.kv_events import EventSource, EventSubscriber, stop_subscribers
from tsukimi.serving.router.workers import POOL, WorkerHandle

logger = logging.getLogger(__name__)

POOL_LOCATION = location(POOL, "dram")
_FOLLOW_INTERVAL_S = 0.5  # how often the feed looks for a prefill worker that restarted


@dataclass(frozen=True, slots=True)
class ExpectedReuse:
    """The prompt tokens the index expects the prefill worker to reuse: from its own cache
    first, then from the KV pool (`pool_tokens`, the run of pooled blocks after the local ones),
    as the worker's BlockManager.admit does. `concurrent`: other prefills were running on that
    worker at placement; they may store or evict blocks before this one is admitted, so a miss is
    then no fault of the index (with none running, the worker's cache stood still: a miss means
    the index was behind)."""

    cached_tokens: int
    pool_tokens: int
    concurrent: bool = False


def expected_reuse(
    index: PrefixIndex,
    prefill: str,
    blocks: Sequence[int],
    prompt_tokens: int,
    block_tokens: int,
    in_flight: Sequence[Sequence[int]] = (),
    tier: Tier = "dram",
    pooled: bool = True,
) -> ExpectedReuse:
    """What `prefill` would reuse of a prompt of `prompt_tokens` tokens with these full-block
    hashes, by the index now and the prefills already running on that worker (`in_flight`: their
    full-block hashes), pure. A running prefill finishes, caches and pools its blocks before the
    worker admits a later one (its scheduler admits in arrival order), so its chain counts as
    held both locally and in the pool. The last prompt token is always computed, so a prompt of
    whole blocks reuses at most all but its last block. `tier`: the worker's own cache's in the
    index; `pooled`: whether blocks can come from the KV pool at all."""
    usable = blocks[: (prompt_tokens - 1) // block_tokens]
    running = max((_common_prefix(usable, chain) for chain in in_flight), default=0)
    local = max(index.match_at(location(prefill, tier), usable), running)
    pool = max(index.match_at(POOL_LOCATION, usable[local:]), running - local) if pooled else 0
    return ExpectedReuse((local + pool) * block_tokens, pool * block_tokens, bool(in_flight))


def _common_prefix(blocks: Sequence[int], other: Sequence[int]) -> int:
    """How many leading block hashes agree (chained hashes: the first difference ends it)."""
    count = 0
    for mine, theirs in zip(blocks, other, strict=False):
        if mine != theirs:
            break
        count += 1
    return count


class IndexFeed:
    """Subscribes to the workers' KV events and applies them to `index` (see the module).

    Args:
        index: the router's prefix index (mutated by the subscribers).
        block_tokens: the workers' block size (a worker publishing another is warned about).
        pooled: the workers' stored blocks are in the KV pool too ("pool/dram").
        timeout_s: how long a snapshot or replay request waits.
    """

    def __init__(self, index: PrefixIndex, block_tokens: int, pooled: bool = True, timeout_s: float = 2.0) -> None:
        self.index, self.block_tokens, self.timeout_s = index, block_tokens, timeout_s
        self.pool = POOL_LOCATION if pooled else None
        self.instances: dict[str, InstanceEvents] = {}
        self._subscribers: dict[str, tuple[EventSource, asyncio.Task[None]]] = {}  # by worker: source, task
        self._follower: asyncio.Task[None] | None = None
        self._context: zmq.asyncio.Context | None = None

    def start(self, workers: Sequence[WorkerHandle]) -> None:
        """Subscribes to every worker that publishes KV events (`WorkerHandle.events`), and
        follows a restarted one to its new endpoints. Mutates; call on the router's loop."""
        self._context = self._context or zmq.asyncio.Context()
        for worker in workers:
            if worker.events is not None:
                self._subscribe(worker, worker.events)
        self._follower = asyncio.create_task(self._follow(workers), name="kv-events-follow")
        logger.info("prefix index fed by the KV events of %d workers", len(self.instances))

    def _subscribe(self, worker: WorkerHandle, source: EventSource) -> None:
        assert self._context is not None
        name = worker.spec.name
        if name not in self.instances:
            self.instances[name] = InstanceEvents(self.index, name, self.block_tokens, self.pool)
        timed = dataclasses.replace(source, replay_timeout_s=self.timeout_s)
        subscriber = EventSubscriber(self.instances[name], timed, self._context)
        self._subscribers[name] = (source, asyncio.create_task(subscriber.run(), name=f"kv-events-{name}"))

    async def _follow(self, workers: Sequence[WorkerHandle]) -> None:
        """A restarted worker may publish elsewhere (a tsukimi worker's /health, read again when
        it comes back up, names new ports): subscribe there, forgetting what the index held for
        its old cache."""
        while True:
            await asyncio.sleep(_FOLLOW_INTERVAL_S)
            for worker in workers:
                name, source = worker.spec.name, worker.events
                if source is None or (name in self._subscribers and self._subscribers[name][0] == source):
                    continue
                if name not in self._subscribers:  # NOTE: silent at discovery, heard from now
                    self._subscribe(worker, source)
                    continue
                logger.warning("worker %s restarted: following its KV events to %s", name, source.endpoint)
                await stop_subscribers([self._subscribers.pop(name)[1]], None)
                self.instances[name].resync(0)
                self._subscribe(worker, source)

    async def close(self) -> None:
        """Stops the subscribers (idempotent; mutates)."""
        tasks = [task for _, task in self._subscribers.values()] + ([self._follower] if self._follower else [])
        await stop_subscribers(tasks, self._context)
        self._subscribers.clear()
        self._follower, self._context = None, None
