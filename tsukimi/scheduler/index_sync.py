"""KV events applied to the Conductor's prefix index, in order, resynchronised after a gap:
the pure part (no sockets), shared by tsukimi's own workers (tsukimi/serving/kv_events.py)
and vLLM instances (tsukimi/integrations/vllm/kv_events.py).

Wire format: vLLM's (vllm/distributed/kv_events.py, 0.32), which tsukimi's workers publish
too. A PUB socket sends multipart `(topic, seq as 8 bytes big-endian, msgpack(KVEventBatch))`;
a batch is an array `[ts, events, data_parallel_rank]` and each event a map tagged by
`"type"`: `BlockStored` (block_hashes, parent_block_hash, token_ids, block_size, medium, ...),
`BlockRemoved` (block_hashes, medium), `AllBlocksCleared`. An empty batch is a heartbeat: it
takes a seq, so a lost last batch shows as a gap at the next heartbeat.

    publisher --seq n--> InstanceEvents.offer(n, batch)
                           n == next      -> apply, next = n + 1            ("applied")
                           n <  next      -> drop (a duplicate or replayed) ("stale"),
                                             but 0: the instance restarted -> resync, apply
                           n >  next      -> "gap": the subscriber heals it, by replaying the
                                             missed batches (vLLM's replay socket), or by a
                                             `Snapshot` (tsukimi's workers: their whole block
                                             set as of a seq, `restore`), or else clears the
                                             instance (`resync`) and starts again at n

Every method mutates the index; not thread-safe (the router applies events on its loop).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import msgspec

from tsukimi.scheduler.prefix_index import PrefixIndex, Tier, location

logger = logging.getLogger(__name__)

MEDIUM_TIERS: dict[str | None, Tier] = {None: "hbm", "GPU": "hbm", "CPU": "dram", "STORAGE": "ssd"}
_KEY_MASK = (1 << 64) - 1


def event_key(block_hash: bytes | int) -> int:
    """The index key of a hash as an event carries it (bytes or int): its low 64 bits, bytes
    read big-endian (vLLM's convention); pure."""
    if isinstance(block_hash, int):
        return block_hash & _KEY_MASK
    return int.from_bytes(block_hash, "big") & _KEY_MASK


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None = None
    token_ids: list[int] = []
    block_size: int = 0
    medium: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[bytes | int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


class Snapshot(msgspec.Struct, frozen=True):
    """An instance's whole block set (per medium) once it published every batch before `next_seq`."""

    next_seq: int
    media: dict[str, list[int]] = {}


_DECODER = msgspec.msgpack.Decoder(KvEventBatch)
_SNAPSHOT_DECODER = msgspec.msgpack.Decoder(Snapshot)


def decode_batch(payload: bytes) -> KvEventBatch:
    """One published payload as a batch. Raises msgspec.DecodeError / ValidationError."""
    return _DECODER.decode(payload)


def decode_snapshot(payload: bytes) -> Snapshot:
    """A snapshot reply. Raises msgspec.DecodeError / ValidationError."""
    return _SNAPSHOT_DECODER.decode(payload)


Outcome = Literal["applied", "stale", "gap"]


@dataclass(slots=True)
class EventStats:
    """Counts of what happened to one instance's batches."""

    applied: int = 0
    stale: int = 0
    gaps: int = 0
    resyncs: int = 0
    snapshots: int = 0
    undecodable: int = 0


class InstanceEvents:
    """One instance's events applied to `index` at `location(instance, tier of the medium)`
    (see the module). `pool`: a location where stored blocks are also recorded (the shared KV
    pool, when the instance saves every block it stores there); removals and snapshots never
    touch it (the pool evicts on its own, unreported: the index over-approximates it).
    `key`: a published hash -> the index's key. Mutates `index`.
    """

    def __init__(
        self,
        index: PrefixIndex,
        instance: str,
        block_size: int = 0,
        pool: str | None = None,
        key: Callable[[bytes | int], int] = event_key,
    ) -> None:
        self.index, self.instance, self.block_size, self.pool, self.key = index, instance, block_size, pool, key
        self.next_seq: int | None = None  # None until the first batch or snapshot
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
        self._clear()
        self.next_seq = seq
        self.stats.resyncs += 1
        logger.warning("instance %s: KV events lost; its index entries were cleared", self.instance)

    def restore(self, snapshot: Snapshot) -> None:
        """Makes the index hold exactly `snapshot` for this instance; expects its `next_seq`
        next, so batches published before it are stale, those after it apply (mutates)."""
        self._clear()
        for medium, blocks in snapshot.media.items():
            self.index.stored(self._location(medium), [self.key(h) for h in blocks])
        self.next_seq = snapshot.next_seq
        self.stats.snapshots += 1

    def _clear(self) -> None:
        for tier in set(MEDIUM_TIERS.values()):
            self.index.drop_location(location(self.instance, tier))

    def _apply(self, batch: KvEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._check_block_size(event.block_size)
                keys = [self.key(h) for h in event.block_hashes]
                self.index.stored(self._location(event.medium), keys)
                if self.pool is not None:
                    self.index.stored(self.pool, keys)
            elif isinstance(event, BlockRemoved):
                self.index.evicted(self._location(event.medium), [self.key(h) for h in event.block_hashes])
            else:
                self._clear()

    def _location(self, medium: str | None) -> str:
        return location(self.instance, MEDIUM_TIERS.get(medium, "hbm"))

    def _check_block_size(self, block_size: int) -> None:
        if self.block_size and block_size and block_size != self.block_size and not self._warned_block_size:
            self._warned_block_size = True
            logger.warning(
                "instance %s stores %d-token blocks but the router hashes %d-token ones: "
                "its prefix hits will not be seen",
                self.instance,
                block_size,
                self.block_size,
            )
