"""KV events from workers' block pools to the router's prefix index: the journal, the
publisher's log, ordered application and snapshot resync (Hypothesis: random store / evict /
drop-all interleavings on real `BlockPool`s, batches dropped, duplicated and reordered on the
way), then the real sockets: snapshot on subscribe, a lost batch healed by a snapshot."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import zmq
import zmq.asyncio
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tsukimi.engine.kv_cache import BlockPool
from tsukimi.scheduler.block_hash import BlockHash
from tsukimi.scheduler.index_sync import InstanceEvents, decode_batch
from tsukimi.scheduler.prefix_index import PrefixIndex
from tsukimi.serving.kv_events import EventLog, EventSource, EventSubscriber, KvEventPublisher, request_snapshot

WORKERS = ("w0", "w1")
hashes = st.integers(1, 12).map(BlockHash)


class _Worker:
    def __init__(self, index: PrefixIndex, name: str) -> None:
        self.name, self.pool, self.log = name, BlockPool(5), EventLog()
        self.pool.journal = []
        self.events = InstanceEvents(index, name)

    def flush(self) -> tuple[int, bytes]:
        assert self.pool.journal is not None
        out = self.log.batch(self.pool.journal)
        self.pool.journal = []
        return out

    def handle(self, seq: int, payload: bytes) -> None:
        """EventSubscriber.handle without sockets: a gap is healed by a snapshot taken now."""
        batch = decode_batch(payload)
        if self.events.offer(seq, batch) == "gap":
            self.events.restore(self.log.snapshot())
            assert self.events.offer(seq, batch) == "stale"


class EventsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex()
        self.workers = {name: _Worker(self.index, name) for name in WORKERS}
        self.in_flight: list[tuple[str, int, bytes]] = []

    @rule(worker=st.sampled_from(WORKERS), block_hash=hashes)
    def store(self, worker: str, block_hash: BlockHash) -> None:
        pool = self.workers[worker].pool
        if block_hash in pool.cached_hashes():
            pool.release(pool.lookup([block_hash]))  # NOTE: a hit: most recently used now
            return
        block = pool.allocate()  # NOTE: may evict the least recently used idle block
        if block is not None:
            pool.cache(block, block_hash)
            pool.release([block])

    @rule(worker=st.sampled_from(WORKERS))
    def drop_all(self, worker: str) -> None:
        self.workers[worker].pool.drop_cached()

    @rule(worker=st.sampled_from(WORKERS), heartbeat=st.booleans())
    def publish(self, worker: str, heartbeat: bool) -> None:
        w = self.workers[worker]
        if heartbeat or w.pool.journal:
            self.in_flight.append((worker, *w.flush()))

    @rule(pick=st.integers(0, 50), keep=st.booleans())
    def deliver(self, pick: int, keep: bool) -> None:
        """Any batch in flight, not only the oldest (reordered); `keep`: it comes again later."""
        if self.in_flight:
            worker, seq, payload = self.in_flight[pick % len(self.in_flight)]
            if not keep:
                del self.in_flight[pick % len(self.in_flight)]
            self.workers[worker].handle(seq, payload)

    @rule(pick=st.integers(0, 50))
    def lose(self, pick: int) -> None:
        if self.in_flight:
            del self.in_flight[pick % len(self.in_flight)]

    @rule(worker=st.sampled_from(WORKERS))
    def heartbeat_delivered(self, worker: str) -> None:
        """A batch that arrives resynchronises the index to the worker's true state."""
        w = self.workers[worker]
        w.handle(*w.flush())
        assert self.index.num_blocks(f"{worker}/dram") == len(w.pool.cached_hashes())
        assert {b for b in range(1, 13) if self.index.match_at(f"{worker}/dram", [b])} == w.pool.cached_hashes()

    @invariant()
    def consistent(self) -> None:
        self.index.check_invariants()
        for w in self.workers.values():
            w.pool.check_invariants()
            if not w.pool.journal:
                assert w.log.blocks == w.pool.cached_hashes()  # the journal misses nothing
            if w.events.next_seq == w.log.next_seq:  # caught up: exact
                assert self.index.num_blocks(f"{w.name}/dram") == len(w.log.blocks)
                assert all(self.index.match_at(f"{w.name}/dram", [b]) for b in w.log.blocks)


EventsMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestEvents = EventsMachine.TestCase


# -- the sockets ---------------------------------------------------------------------------------


@pytest.fixture
def publisher() -> Iterator[KvEventPublisher]:
    pub = KvEventPublisher(heartbeat_s=0.1).start()
    yield pub
    pub.close()


async def _until(condition: object, timeout_s: float = 5.0) -> None:
    assert callable(condition)
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def test_snapshot_on_subscribe_then_a_lost_batch_healed_by_a_snapshot(publisher: KvEventPublisher) -> None:
    stored = [(True, BlockHash(h)) for h in (1, 2, 3)]

    async def main() -> None:
        publisher.publish(stored)  # before anyone listens: only a snapshot can tell
        index, context = PrefixIndex(), zmq.asyncio.Context()
        events = InstanceEvents(index, "p0")
        source = EventSource(
            f"tcp://127.0.0.1:{publisher.port}", snapshot_endpoint=f"tcp://127.0.0.1:{publisher.snapshot_port}"
        )
        task = asyncio.create_task(EventSubscriber(events, source, context).run())
        try:
            await _until(lambda: events.stats.snapshots >= 1 and events.stats.applied > 0)  # heartbeats flow
            assert index.match([1, 2, 3]) == {"p0/dram": 3}
            gaps, snapshots = events.stats.gaps, events.stats.snapshots  # NOTE: PUB drops until SUB joins
            with publisher._lock:  # a batch lost on the way: its seq is spent, nothing sent
                publisher._log.batch([(False, BlockHash(2))])
            publisher.publish([(True, BlockHash(4))])
            await _until(lambda: events.stats.gaps == gaps + 1 and events.next_seq == publisher.snapshot().next_seq)
            assert index.match([1, 2]) == {"p0/dram": 1} and index.match([4]) == {"p0/dram": 1}
            assert events.stats.snapshots == snapshots + 1 and events.stats.resyncs == 0
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            context.term()

    asyncio.run(main())


def test_snapshot_socket_answers_directly(publisher: KvEventPublisher) -> None:
    publisher.publish([(True, BlockHash(7)), (True, BlockHash(8)), (False, BlockHash(7))])
    snapshot = request_snapshot(f"tcp://127.0.0.1:{publisher.snapshot_port}")
    assert snapshot.media == {"CPU": [8]} and snapshot.next_seq >= 1
