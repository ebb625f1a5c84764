"""The master's view of memory: clients, the segments they mount, and replica placement.

Each mounted segment has its own `OffsetAllocator`. A client is healthy while its
heartbeats arrive; one that missed 2.5 heartbeat intervals gets no new replicas, and one
silent for `client_ttl_s` is dropped with its segments (the state machine drops the replicas).
Pure: no sockets, no threads; time is passed in.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from tsukimi.config import MasterConfig
from tsukimi.errors import InvalidArgument, ObjectExists, ObjectNotFound
from tsukimi.store.master.allocator import OffsetAllocator
from tsukimi.store.protocol import MountSegment, ReplicaConfig, SegmentInfo

MISSED_HEARTBEATS = 2.5  # NOTE: was 1.5: a holder busy writing on a loaded host missed it, and puts lost replicas
MIN_SEGMENT_BYTES = 4096


@dataclass(slots=True)
class Segment:
    segment_id: str
    te_segment: str
    client_id: str
    base: int
    allocator: OffsetAllocator
    incarnation: str = ""


@dataclass(slots=True)
class Client:
    client_id: str
    last_seen: float
    segment_ids: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one replica lives: a segment and the offset of its block in it."""

    segment_id: str
    offset: int


class SegmentRegistry:
    def __init__(self, config: MasterConfig) -> None:
        self._config = config
        self._rng = random.Random(config.seed)
        self.segments: dict[str, Segment] = {}
        self.clients: dict[str, Client] = {}
        # NOTE: what changed since the last MasterState.take_changes (None: not tracked):
        # the HA master logs these rows (tsukimi/store/ha/journal.py).
        self.changed_segments: set[str] | None = None
        self.changed_blocks: set[tuple[str, int]] | None = None

    # -- clients ---------------------------------------------------------------------

    def heartbeat(self, client_id: str, now: float) -> bool:
        """Record a heartbeat (mutates); False when the client is unknown (must remount)."""
        client = self.clients.get(client_id)
        if client is None:
            return False
        client.last_seen = now
        return True

    def know(self, client_id: str, now: float) -> None:
        """Start tracking a client's heartbeats (as seen now) unless it is known (mutates)."""
        self.clients.setdefault(client_id, Client(client_id, now))

    def healthy(self, client_id: str, now: float) -> bool:
        client = self.clients.get(client_id)
        limit = min(MISSED_HEARTBEATS * self._config.heartbeat_interval_s, self._config.client_ttl_s)
        return client is not None and now - client.last_seen <= limit

    def expired_clients(self, now: float) -> list[str]:
        return [c.client_id for c in self.clients.values() if now - c.last_seen > self._config.client_ttl_s]

    # -- segments --------------------------------------------------------------------

    def mount(self, op: MountSegment, now: float) -> None:
        """Add a segment (mutates; the client becomes known). Mounting the same segment
        again with the same parameters is a no-op.

        Raises:
            InvalidArgument: bad size or base.
            ObjectExists: the segment id is mounted with other parameters or by another client.
        """
        bad = op.size < MIN_SEGMENT_BYTES or op.base <= 0 or op.base + op.size > 1 << 64
        if bad or not op.segment_id or not op.te_segment:
            raise InvalidArgument(
                f"cannot mount segment {op.segment_id!r}: base {op.base}, size {op.size} (at least "
                f"{MIN_SEGMENT_BYTES} bytes, inside the 64-bit address space)"
            )
        old = self.segments.get(op.segment_id)
        if old is not None:
            rounded = op.size - op.size % old.allocator.alignment
            same = (old.client_id, old.te_segment, old.base, old.allocator.capacity) == (
                op.client_id,
                op.te_segment,
                op.base,
                rounded,
            )
            if same:
                self.clients[op.client_id].last_seen = now
                return
            raise ObjectExists(f"segment {op.segment_id} is already mounted by {old.client_id}")
        client = self.clients.setdefault(op.client_id, Client(op.client_id, now))
        client.last_seen = now
        if self.changed_segments is not None:
            self.changed_segments.add(op.segment_id)
        self.segments[op.segment_id] = Segment(
            op.segment_id, op.te_segment, op.client_id, op.base, OffsetAllocator(op.size), op.incarnation
        )
        client.segment_ids.add(op.segment_id)

    def stale_incarnations(self, op: MountSegment) -> list[str]:
        """Clients whose segments are in `op.te_segment` but from another incarnation of its
        process: that process is gone (pure)."""
        if not op.incarnation:
            return []
        stale = {
            s.client_id
            for s in self.segments.values()
            if s.te_segment == op.te_segment and s.incarnation and s.incarnation != op.incarnation
        }
        return sorted(stale)

    def unmount(self, client_id: str, segment_id: str) -> Segment:
        """Remove a segment (mutates). Raises ObjectNotFound if this client has no such segment."""
        seg = self.segments.get(segment_id)
        if seg is None or seg.client_id != client_id:
            raise ObjectNotFound(f"client {client_id} has no segment {segment_id}")
        if self.changed_segments is not None:
            self.changed_segments.add(segment_id)
        del self.segments[segment_id]
        self.clients[client_id].segment_ids.discard(segment_id)
        return seg

    def drop_client(self, client_id: str) -> list[Segment]:
        """Forget a client and unmount all its segments (mutates)."""
        client = self.clients.pop(client_id, None)
        if client is None:
            return []
        dropped = [self.segments.pop(sid) for sid in sorted(client.segment_ids) if sid in self.segments]
        if self.changed_segments is not None:
            self.changed_segments.update(s.segment_id for s in dropped)
        return dropped

    # -- placement -------------------------------------------------------------------

    def place(self, size: int, config: ReplicaConfig, client_id: str, now: float) -> list[Placement]:
        """Allocate up to `config.replicas` blocks of `size`, each in a distinct healthy
        segment, in placement order (mutates allocators). May return fewer, or none."""
        placed: list[Placement] = []
        holders: set[str] = set()  # NOTE: distinct holders, not just segments: they die together
        for seg in self._candidates(config, client_id, now):
            if seg.te_segment in holders:
                continue
            offset = seg.allocator.allocate(size)
            if offset is not None:
                if self.changed_blocks is not None:
                    self.changed_blocks.add((seg.segment_id, offset))
                placed.append(Placement(seg.segment_id, offset))
                holders.add(seg.te_segment)
                if len(placed) == config.replicas:
                    break
        return placed

    def wanted_replicas(self, config: ReplicaConfig, size: int, now: float) -> int:
        """How many replicas a put should get: as asked, capped by the healthy holders with a
        segment large enough for the object (eviction cannot make room anywhere else)."""
        holders = {
            s.te_segment
            for s in self.segments.values()
            if self.healthy(s.client_id, now) and s.allocator.capacity >= size
        }
        return min(config.replicas, len(holders))

    def _candidates(self, config: ReplicaConfig, client_id: str, now: float) -> list[Segment]:
        healthy = [s for s in self.segments.values() if self.healthy(s.client_id, now)]
        healthy.sort(key=lambda s: s.segment_id)  # deterministic before the strategy's order
        strategy = self._config.placement
        if strategy == "most_free":
            healthy.sort(key=lambda s: -s.allocator.free_bytes)
        else:
            self._rng.shuffle(healthy)
            if strategy == "local_first":
                healthy.sort(key=lambda s: s.client_id != client_id)
        if config.preferred_segments:
            rank = {name: i for i, name in enumerate(config.preferred_segments)}
            healthy.sort(key=lambda s: rank.get(s.te_segment, len(rank)))
        return healthy

    def free(self, placement: Placement) -> None:
        """Return a replica's block (mutates); ignored if its segment is gone."""
        seg = self.segments.get(placement.segment_id)
        if seg is not None:
            seg.allocator.free(placement.offset)
            if self.changed_blocks is not None:
                self.changed_blocks.add((placement.segment_id, placement.offset))

    # -- figures ---------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return sum(s.allocator.capacity for s in self.segments.values())

    @property
    def used(self) -> int:
        return sum(s.allocator.used_bytes for s in self.segments.values())

    def infos(self, now: float) -> list[SegmentInfo]:
        return [
            SegmentInfo(
                s.segment_id,
                s.te_segment,
                s.client_id,
                s.allocator.capacity,
                s.allocator.used_bytes,
                self.healthy(s.client_id, now),
            )
            for s in sorted(self.segments.values(), key=lambda s: s.segment_id)
        ]
