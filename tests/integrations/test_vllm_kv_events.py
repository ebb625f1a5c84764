"""KV events from a fake vLLM publisher (pyzmq, vLLM's wire format) into the prefix index:
ordered apply, stale duplicates, a gap healed by the replay socket, a gap with no replay
(the instance's entries cleared), removals, AllBlocksCleared, an unknown instance's events."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import msgspec
import pytest
import zmq
import zmq.asyncio

from tsukimi.integrations.vllm.kv_events import (
    EventSource,
    EventSubscriber,
    InstanceEvents,
    KvEventBatch,
    decode_batch,
)
from tsukimi.scheduler.prefix_index import PrefixIndex


# The publisher's side, shaped like vllm/distributed/kv_events.py (with fields we ignore).
class _Stored(msgspec.Struct, tag="BlockStored", omit_defaults=True):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[object] | None = None
    group_idx: int | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved", omit_defaults=True):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


def stored(*hashes: int, medium: str | None = "GPU") -> _Stored:
    return _Stored(list(hashes), None, [1] * 4 * len(hashes), 4, None, medium, None)


def payload(*events: _Stored | _Removed | _Cleared) -> bytes:
    return msgspec.msgpack.encode(_Batch(1.0, list(events), 0))


def batch(*events: _Stored | _Removed | _Cleared) -> KvEventBatch:
    return decode_batch(payload(*events))


def test_decode_ignores_fields_it_does_not_use() -> None:
    out = decode_batch(payload(stored(7, 8), _Removed([8], "GPU"), _Cleared()))
    assert [type(e).__name__ for e in out.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert out.events[0].block_hashes == [7, 8]  # type: ignore[union-attr]


def test_ordered_apply_stale_and_removal() -> None:
    index = PrefixIndex()
    events = InstanceEvents(index, "v0", block_size=4)
    assert events.offer(0, batch(stored(1, 2, 3))) == "applied"
    assert events.offer(1, batch(_Removed([3], "GPU"))) == "applied"
    assert events.offer(1, batch(stored(9))) == "stale"
    assert index.match([1, 2, 3]) == {"v0/hbm": 2}
    assert events.next_seq == 2 and events.stats.stale == 1
    # bytes hashes key the index by their low 64 bits (last 8 bytes), as vLLM's int hashes do
    assert events.offer(2, batch(stored(b"\xff" * 24 + (5).to_bytes(8, "big")))) == "applied"
    assert index.match_at("v0/hbm", [5]) == 1
    index.check_invariants()


def test_gap_then_resync_clears_only_that_instance() -> None:
    index = PrefixIndex()
    a, b = InstanceEvents(index, "a"), InstanceEvents(index, "b")
    a.offer(0, batch(stored(1, 2)))
    b.offer(0, batch(stored(1)))
    assert a.offer(5, batch(stored(3))) == "gap"
    a.resync(5)
    assert a.offer(5, batch(stored(3))) == "applied"
    assert index.match([1, 2]) == {"b/hbm": 1}
    assert index.match([3]) == {"a/hbm": 1}
    assert (a.stats.gaps, a.stats.resyncs, a.next_seq) == (1, 1, 6)


def test_a_restarted_publisher_starts_over() -> None:
    index = PrefixIndex()
    events = InstanceEvents(index, "v0")
    events.offer(0, batch(stored(1, 2)))
    events.offer(1, batch(stored(3)))
    assert events.offer(0, batch(stored(8))) == "applied"  # a new vLLM process: seq 0 again
    assert index.match([1, 2]) == {} and index.match([8]) == {"v0/hbm": 1}
    assert (events.next_seq, events.stats.resyncs) == (1, 1)


def test_all_blocks_cleared_and_cpu_medium() -> None:
    index = PrefixIndex()
    events = InstanceEvents(index, "v0", pool="pool/dram")
    events.offer(0, batch(stored(1, 2), stored(1, medium="CPU")))
    assert index.match([1, 2]) == {"pool/dram": 2, "v0/dram": 1, "v0/hbm": 2}
    events.offer(1, batch(_Cleared()))
    assert index.match([1, 2]) == {"pool/dram": 2}


@pytest.fixture
def ctx() -> Iterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


class _Publisher:
    """vLLM's ZmqEventPublisher in miniature: PUB plus a ROUTER replay over a buffer."""

    def __init__(self, context: zmq.asyncio.Context, topic: bytes = b"kv") -> None:
        self.pub, self.replay = context.socket(zmq.PUB), context.socket(zmq.ROUTER)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        replay_port = self.replay.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint, self.replay_endpoint = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}"
        self.topic, self.buffer = topic, list[tuple[int, bytes]]()

    async def send(self, seq: int, data: bytes, skip: bool = False) -> None:
        self.buffer.append((seq, data))
        if not skip:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), data])

    async def serve_replay_once(self) -> None:
        client, _, start = await self.replay.recv_multipart()
        for seq, data in self.buffer:
            if seq >= int.from_bytes(start, "big"):
                await self.replay.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), data])
        await self.replay.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self.pub.close(linger=0)
        self.replay.close(linger=0)


async def _until(condition: object, timeout_s: float = 5.0) -> None:
    assert callable(condition)
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


async def _connected(pub: _Publisher, events: InstanceEvents) -> None:
    """PUB drops messages until the subscription arrives: probe with seq 0 until it lands."""
    async with asyncio.timeout(5):
        while events.next_seq is None:
            await pub.pub.send_multipart([pub.topic, (0).to_bytes(8, "big"), payload(stored(100))])
            await asyncio.sleep(0.02)
    pub.buffer.append((0, payload(stored(100))))


def test_subscriber_replays_a_gap(ctx: zmq.asyncio.Context) -> None:
    async def main() -> None:
        pub, index = _Publisher(ctx), PrefixIndex()
        events = InstanceEvents(index, "v0")
        sub = EventSubscriber(events, EventSource(pub.endpoint, "kv", pub.replay_endpoint), ctx)
        task = asyncio.create_task(sub.run())
        try:
            await _connected(pub, events)
            await pub.send(1, payload(stored(1)), skip=True)  # lost on the way
            await pub.send(2, payload(stored(1, 2)))
            await pub.serve_replay_once()
            await _until(lambda: events.next_seq == 3)
            assert index.match([1, 2]) == {"v0/hbm": 2}
            assert (events.stats.gaps, events.stats.resyncs) == (1, 0)
        finally:
            task.cancel()
            pub.close()

    asyncio.run(main())


def test_subscriber_without_replay_resyncs(ctx: zmq.asyncio.Context) -> None:
    async def main() -> None:
        pub, index = _Publisher(ctx), PrefixIndex()
        events = InstanceEvents(index, "v0")
        task = asyncio.create_task(EventSubscriber(events, EventSource(pub.endpoint, "kv"), ctx).run())
        try:
            await _connected(pub, events)
            await pub.send(1, payload(stored(1, 2)))
            await pub.send(2, payload(_Removed([2], "GPU")), skip=True)  # lost: the index would be wrong
            await pub.send(3, payload(stored(7)))
            await _until(lambda: events.next_seq == 4)
            assert index.match([1, 2]) == {}  # cleared rather than trusted
            assert index.match([7]) == {"v0/hbm": 1}
            assert events.stats.resyncs == 1
        finally:
            task.cancel()
            pub.close()

    asyncio.run(main())


def test_unknown_instance_and_other_topic_are_ignored(ctx: zmq.asyncio.Context) -> None:
    async def main() -> None:
        ours, other, index = _Publisher(ctx), _Publisher(ctx, topic=b"other"), PrefixIndex()
        events = InstanceEvents(index, "v0")
        sub = EventSubscriber(events, EventSource(ours.endpoint, "kv"), ctx)
        sub._sub.connect(other.endpoint)  # a publisher that is not this instance, another topic
        task = asyncio.create_task(sub.run())
        try:
            await _connected(ours, events)
            for seq in range(1, 4):
                await other.send(seq, payload(stored(55)))
            await ours.send(1, payload(stored(1)))
            await _until(lambda: events.next_seq == 2)
            assert index.match([55]) == {} and index.match([1]) == {"v0/hbm": 1}
        finally:
            task.cancel()
            ours.close()
            other.close()

    asyncio.run(main())
