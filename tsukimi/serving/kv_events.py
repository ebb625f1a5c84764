"""KV events over pyzmq, both ends: a worker's `KvEventPublisher` and the router's
`EventSubscriber` (which vLLM instances' events use too; the ordering is
tsukimi/scheduler/index_sync.py's).

    worker engine thread: BlockPool journal --publish(entries)--> KvEventPublisher
        PUB  (topic, seq, msgpack batch)   one batch per engine iteration that changed the
                                           cache; an empty one (a heartbeat) every
                                           `heartbeat_s` when idle
        ROUTER  b"" -> msgpack(Snapshot)   the blocks it published so far, as of a seq
    router event loop: EventSubscriber.run()
        snapshot on start (the worker may have run before the router subscribed), then
        batches in order; past a gap: replay (vLLM) or a snapshot (tsukimi's workers), else
        clear the instance (InstanceEvents.resync)

The publisher's state (seq, the block set it announced) changes only under its lock, and the
snapshot is taken under the same lock, so a snapshot and the batches agree exactly. The PUB
socket never blocks: a batch it cannot queue is dropped and the subscriber sees the gap.
Every receive waits at most `timeout_s`; sockets close with linger 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from tsukimi.scheduler.block_hash import BlockHash
from tsukimi.scheduler.index_sync import (
    BlockRemoved,
    BlockStored,
    InstanceEvents,
    KvEvent,
    KvEventBatch,
    Snapshot,
    decode_batch,
    decode_snapshot,
)

logger = logging.getLogger(__name__)

END_SEQ = -1
JournalEntry = tuple[bool, BlockHash]
"""(stored, hash): a block cached under `hash` (True) or evicted from the cache (False)."""


async def stop_subscribers(tasks: list[asyncio.Task[None]], context: zmq.asyncio.Context | None) -> None:
    """Cancel `tasks` (subscribers, pollers), wait for each to end, then close `context` (mutates:
    empties `tasks`)."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    tasks.clear()
    if context is not None:
        context.term()


def _seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


class EventLog:
    """The publisher's state, without sockets: the seq of the next batch and the set of blocks
    announced so far (what a snapshot holds). Not thread-safe (`KvEventPublisher` locks it)."""

    def __init__(self, medium: str = "CPU", block_tokens: int = 0) -> None:
        self.medium, self.block_tokens = medium, block_tokens
        self.next_seq, self.blocks = 0, set[int]()

    def batch(self, entries: Sequence[JournalEntry]) -> tuple[int, bytes]:
        """The next batch's seq and payload for `entries`, in order (consecutive stores or
        evictions grouped into one event each); an empty batch is a heartbeat. Mutates."""
        events: list[KvEvent] = []
        run: list[bytes | int] = []
        for n, (stored, block_hash) in enumerate(entries):
            run.append(block_hash)
            if n + 1 == len(entries) or entries[n + 1][0] != stored:
                events.append(
                    BlockStored(run, block_size=self.block_tokens, medium=self.medium)
                    if stored
                    else BlockRemoved(run, medium=self.medium)
                )
                run = []
            if stored:
                self.blocks.add(block_hash)
            else:
                self.blocks.discard(block_hash)
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        return seq, msgspec.msgpack.encode(KvEventBatch(time.time(), events))

    def snapshot(self) -> Snapshot:
        """The blocks announced so far and the seq of the next batch (pure)."""
        return Snapshot(self.next_seq, {self.medium: sorted(self.blocks)})


class KvEventPublisher:
    """A worker's KV events (see the module). `publish` is thread-safe; `start` binds both
    sockets on `host` (ephemeral ports: `port` and `snapshot_port`) and starts the thread
    that answers snapshots and sends heartbeats; `close` stops it."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        medium: str = "CPU",
        block_tokens: int = 0,
        heartbeat_s: float = 0.5,
        topic: str = "",
    ) -> None:
        self.heartbeat_s, self._topic = heartbeat_s, topic.encode()
        self._log = EventLog(medium, block_tokens)
        self._context = zmq.Context()
        self._pub, self._snap = self._context.socket(zmq.PUB), self._context.socket(zmq.ROUTER)
        for sock in (self._pub, self._snap):
            sock.setsockopt(zmq.LINGER, 0)
        self.port = self._pub.bind_to_random_port(f"tcp://{host}")
        self.snapshot_port = self._snap.bind_to_random_port(f"tcp://{host}")
        self._lock = threading.Lock()
        self._last_send = time.monotonic()
        self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-events", daemon=True)

    def start(self) -> KvEventPublisher:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stops the thread, closes the sockets (idempotent)."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(5.0)
        with self._lock:
            self._pub.close(linger=0)
            self._snap.close(linger=0)
        self._context.term()

    def publish(self, entries: Sequence[JournalEntry]) -> None:
        """One batch of cache changes, in order (see `EventLog.batch`); thread-safe."""
        with self._lock:
            self._send(entries)

    def clear(self) -> None:
        """Every block announced so far is gone (the engine was replaced; thread-safe)."""
        with self._lock:
            self._send([(False, BlockHash(h)) for h in sorted(self._log.blocks)])

    def snapshot(self) -> Snapshot:
        """The blocks announced so far and the seq of the next batch (thread-safe, pure)."""
        with self._lock:
            return self._log.snapshot()

    def _send(self, entries: Sequence[JournalEntry]) -> None:
        """Sends one batch under the lock; a full queue drops it (the seq is spent: a gap)."""
        seq, payload = self._log.batch(entries)
        self._last_send = time.monotonic()
        try:
            self._pub.send_multipart([self._topic, _seq_bytes(seq), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._snap, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(int(self.heartbeat_s * 500)):
                frames = self._snap.recv_multipart(zmq.NOBLOCK)
                payload = msgspec.msgpack.encode(self.snapshot())
                self._snap.send_multipart([frames[0], b"", payload], flags=zmq.NOBLOCK)
            with self._lock:
                if time.monotonic() - self._last_send >= self.heartbeat_s and not self._stop.is_set():
                    self._send([])


def request_snapshot(endpoint: str, timeout_s: float = 5.0) -> Snapshot:
    """Asks a publisher's snapshot socket (blocking, for tools and tests) for its block set.

    Raises:
        zmq.Again: no answer within `timeout_s`.
    """
    with zmq.Context() as context, context.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        sock.connect(endpoint)
        sock.send_multipart([b"", b""])
        return decode_snapshot(sock.recv_multipart()[-1])


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where one instance publishes: its PUB endpoint, topic, and the optional endpoints that
    heal a gap: a replay socket (vLLM's) or a snapshot socket (tsukimi's workers)."""

    endpoint: str
    topic: str = ""
    replay_endpoint: str | None = None
    replay_timeout_s: float = 2.0
    snapshot_endpoint: str | None = None


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
            if self.source.snapshot_endpoint is not None:
                await self._snapshot()
            while True:
                frames = await self._sub.recv_multipart()
                if len(frames) != 3:
                    self.events.stats.undecodable += 1
                    continue
                await self.handle(int.from_bytes(frames[1], "big", signed=True), frames[2])
        finally:
            self._sub.close(linger=0)

    async def handle(self, seq: int, payload: bytes) -> None:
        """One published batch: applied, dropped, or (past a gap) replayed, restored or resynced."""
        try:
            batch = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.events.stats.undecodable += 1
            logger.warning("instance %s: undecodable KV event batch %d", self.events.instance, seq)
            return
        if self.events.offer(seq, batch) != "gap":
            return
        if self.source.replay_endpoint is not None:
            await self._replay()
        if self.source.snapshot_endpoint is not None and self._still_gap(seq):
            await self._snapshot()
        if self._still_gap(seq):
            self.events.resync(seq)
        self.events.offer(seq, batch)  # NOTE: applied, or stale when the snapshot covers it

    def _still_gap(self, seq: int) -> bool:
        next_seq = self.events.next_seq
        return (next_seq or 0) < seq

    async def _ask(self, endpoint: str, request: list[bytes]) -> zmq.asyncio.Socket:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        await sock.send_multipart(request)
        return sock

    async def _snapshot(self) -> None:
        """Asks the snapshot socket for the instance's blocks and restores them (mutates)."""
        assert self.source.snapshot_endpoint is not None
        sock = await self._ask(self.source.snapshot_endpoint, [b"", b""])
        try:
            frames = await asyncio.wait_for(sock.recv_multipart(), self.source.replay_timeout_s)
            self.events.restore(decode_snapshot(frames[-1]))
        except TimeoutError:
            logger.warning("instance %s: the snapshot socket did not answer", self.events.instance)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.events.stats.undecodable += 1
        finally:
            sock.close(linger=0)

    async def _replay(self) -> None:
        """Asks the replay socket for the batches from `next_seq` on and offers them in order."""
        assert self.source.replay_endpoint is not None
        sock = await self._ask(self.source.replay_endpoint, [b"", _seq_bytes(self.events.next_seq or 0)])
        try:
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), self.source.replay_timeout_s)
                seq = int.from_bytes(frames[-2], "big", signed=True) if len(frames) >= 4 else END_SEQ
                if seq == END_SEQ:
                    return
                with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                    self.events.offer(seq, decode_batch(frames[-1]))
        except TimeoutError:
            logger.warning("instance %s: the replay socket did not answer", self.events.instance)
        finally:
            sock.close(linger=0)
