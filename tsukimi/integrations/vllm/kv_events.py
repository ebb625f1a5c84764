"""vLLM's KV cache events (its ZMQ publisher, `--kv-events-config`) applied to the Conductor's
prefix index, in order, resynchronised after a gap.

Wire format (vllm/distributed/kv_events.py, 0.32): the PUB socket sends multipart
`(topic, seq as 8 bytes big-endian, msgpack(KVEventBatch))`; a batch is an array
`[ts, events, data_parallel_rank]` and each event a map tagged by `"type"`: `BlockStored`
(block_hashes, parent_block_hash, token_ids, block_size, medium, ...), `BlockRemoved`
(block_hashes, medium), `AllBlocksCleared`. The optional ROUTER replay socket answers
`(b"", start seq)` with every buffered `(b"", topic, seq, payload)` from that seq on, then
`(b"", b"", -1, b"")`.

    publisher --seq n--> InstanceEvents.offer(n, batch)
                           n == next      -> apply, next = n + 1            ("applied")
                           n <  next      -> drop (a duplicate or replayed) ("stale"),
                                             but 0: the instance restarted -> resync, apply
                           n >  next      -> "gap": the subscriber asks the replay socket
                                             for next.., offers what comes back, and if
                                             the gap is still open clears the instance
                                             (`resync`) and starts again at n

`InstanceEvents` is the pure part (no sockets): tests and the router drive the same object.
`EventSubscriber` owns the sockets (pyzmq asyncio) for one instance and runs on the
router's event loop, since the index is not thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Literal

import msgspec
import zmq
import zmq.asyncio

from tsukimi.integrations.vllm.block_hash import event_key
from tsukimi.scheduler.prefix_index import PrefixIndex, Tier, location

logger = logging.getLogger(__name__)

END_SEQ = -1
_MEDIUM_TIERS: dict[str | None, Tier] = {None: "hbm", "GPU": "hbm", "CPU": "dram", "STORAGE": "ssd"}


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None = None
    token_ids: list[int] = []
    block_size: int = 0
    medium: str | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[bytes | int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(KvEventBatch)


def decode_batch(payload: bytes) -> KvEventBatch:
    """One published payload as a batch. Raises msgspec.DecodeError / ValidationError."""
    return _DECODER.decode(payload)


Outcome = Literal["applied", "stale", "gap"]


@dataclass(slots=True)
class EventStats:
    """Counts of what happened to one instance's batches."""

    applied: int = 0
    stale: int = 0
    gaps: int = 0
    resyncs: int = 0
    undecodable: int = 0


class InstanceEvents:
    """One vLLM instance's events applied to `index` at `location(instance, tier)` (see the
    module). `pool`: a location where stored blocks are also recorded (the shared KV pool,
    when the instances save every full block there); removals never reach it (the pool
    evicts on its own, unreported: the index over-approximates it). Mutates `index`.
    """

    def __init__(self, index: PrefixIndex, instance: str, block_size: int = 0, pool: str | None = None) -> None:
        self.index, self.instance, self.block_size, self.pool = index, instance, block_size, pool
        self.next_seq: int | None = None  # None until the first batch
        self.stats = EventStats()
        self._warned_block_size = False

    def offer(self, seq: int, batch: KvEventBatch) -> Outcome:
        """Applies `batch` if it is the next one; says whether it was, or stale, or past a gap."""
        if self.next_seq is not None and seq < self.next_seq:
            if seq != 0:
                self.stats.stale += 1
                return "stale"
            # NOTE: a publisher starts at 0, and never sends a seq twice: a new process (the
            # instance restarted) whose cache is empty; what the index held for it is gone
            self.resync(0)
        expected = 0 if self.next_seq is None else self.next_seq
        if seq > expected:
            self.stats.gaps += 1
            return "gap"
        self._apply(batch)
        self.next_seq = seq + 1
        self.stats.applied += 1
        return "applied"

    def resync(self, seq: int) -> None:
        """Forgets what the index holds for this instance and expects `seq` next (mutates)."""
        for tier in set(_MEDIUM_TIERS.values()):
            self.index.drop_location(location(self.instance, tier))
        self.next_seq = seq
        self.stats.resyncs += 1
        logger.warning("vLLM instance %s: KV events lost; its index entries were cleared", self.instance)

    def _apply(self, batch: KvEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._check_block_size(event.block_size)
                keys = [event_key(h) for h in event.block_hashes]
                self.index.stored(self._location(event.medium), keys)
                if self.pool is not None:
                    self.index.stored(self.pool, keys)
            elif isinstance(event, BlockRemoved):
                self.index.evicted(self._location(event.medium), [event_key(h) for h in event.block_hashes])
            else:
                for tier in set(_MEDIUM_TIERS.values()):
                    self.index.drop_location(location(self.instance, tier))

    def _location(self, medium: str | None) -> str:
        return location(self.instance, _MEDIUM_TIERS.get(medium, "hbm"))

    def _check_block_size(self, block_size: int) -> None:
        if self.block_size and block_size and block_size != self.block_size and not self._warned_block_size:
            self._warned_block_size = True
            logger.warning("vLLM instance %s stores %d-token blocks but the router hashes %d-token ones: "
                           "its prefix hits will not be seen", self.instance, block_size, self.block_size)  # fmt: skip


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where one instance publishes: its PUB endpoint, topic and optional replay endpoint."""

    endpoint: str
    topic: str = ""
    replay_endpoint: str | None = None
    replay_timeout_s: float = 2.0


class EventSubscriber:
    """Subscribes to one instance's publisher and feeds `InstanceEvents` (see the module)."""

    def __init__(self, events: InstanceEvents, source: EventSource, context: zmq.asyncio.Context) -> None:
        self.events, self.source = events, source
        self._sub = context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt_string(zmq.SUBSCRIBE, source.topic)
        self._sub.connect(source.endpoint)
        self._context = context

    async def run(self) -> None:
        """Receives and applies batches until cancelled; closes the socket on the way out."""
        try:
            while True:
                frames = await self._sub.recv_multipart()
                if len(frames) != 3:
                    self.events.stats.undecodable += 1
                    continue
                await self.handle(int.from_bytes(frames[1], "big", signed=True), frames[2])
        finally:
            self._sub.close(linger=0)

    async def handle(self, seq: int, payload: bytes) -> None:
        """One published batch: applied, dropped, or (past a gap) replayed or resynced."""
        try:
            batch = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.events.stats.undecodable += 1
            logger.warning("vLLM instance %s: undecodable KV event batch %d", self.events.instance, seq)
            return
        if self.events.offer(seq, batch) != "gap":
            return
        if self.source.replay_endpoint is not None:
            await self._replay()
        if self.events.offer(seq, batch) == "gap":
            self.events.resync(seq)
            self.events.offer(seq, batch)

    async def _replay(self) -> None:
        """Asks the replay socket for the batches from `next_seq` on and offers them in order."""
        assert self.source.replay_endpoint is not None
        start = self.events.next_seq or 0
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.source.replay_endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), self.source.replay_timeout_s)
                seq = int.from_bytes(frames[-2], "big", signed=True) if len(frames) >= 4 else END_SEQ
                if seq == END_SEQ:
                    return
                with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                    self.events.offer(seq, decode_batch(frames[-1]))
        except TimeoutError:
            logger.warning("vLLM instance %s: the replay socket did not answer", self.events.instance)
        finally:
            sock.close(linger=0)
