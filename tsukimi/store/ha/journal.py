"""The HA master's log records: row images of the master's durable tables, and replay.

The durable state of a master is four tables: mounted segments, allocated blocks (per
segment, offset -> rounded size), complete objects and pending puts. After each operation the
leader turns `MasterState.take_changes()` into records holding each changed row's *final*
image (`SegmentUp`/`SegmentDown`, `BlockUp`/`BlockDown`, `ObjectUp`/`ObjectDown`) and logs
them. Replaying records in order rebuilds the tables exactly; a snapshot is just the records of
every row at one point. No clock, no placement decision and no eviction is re-run on replay:
the log records what they decided.

What is not logged, by design: heartbeats, read leases, LRU order, counters, holders' disks
and their tasks. An object's disk copies are logged (`ObjectUp.disks`) and become *lost*
copies in a new leader: the holders register their disks with it again (it answers their
next DiskSync with "unknown disk") and the copies come back; an object that was only on disk
is absent until then, and a file of a version the log does not have is never adopted. A new leader
restarts them conservatively (see `restore`): every client is alive as of the takeover, every
object leased for `lease_ttl_s` (readers that the old leader served may still be reading),
every allocated block that no object owns retired for max(lease_ttl_s, write_grace_s) (an
old reader or a failed writer may still touch it), every pending put gets a fresh put_timeout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from tsukimi.clock import Clock
from tsukimi.config import MasterConfig
from tsukimi.errors import ProtocolError
from tsukimi.store.master.allocator import OffsetAllocator
from tsukimi.store.master.segments import Client, Placement, Segment
from tsukimi.store.master.state import Changes, MasterState, ObjectRecord
from tsukimi.store.protocol import ReplicaConfig

COMPLETE, PENDING = "c", "p"


class SegmentUp(msgspec.Struct, frozen=True, tag=True, array_like=True):
    segment_id: str
    te_segment: str
    client_id: str
    base: int
    size: int
    incarnation: str


class SegmentDown(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The segment is gone, and with it every block in it."""

    segment_id: str


class BlockUp(msgspec.Struct, frozen=True, tag=True, array_like=True):
    segment_id: str
    offset: int
    size: int


class BlockDown(msgspec.Struct, frozen=True, tag=True, array_like=True):
    segment_id: str
    offset: int


class ObjectUp(msgspec.Struct, frozen=True, tag=True, array_like=True):
    slot: str  # COMPLETE or PENDING
    key: str
    size: int
    config: ReplicaConfig
    placements: list[tuple[str, int]]
    writer: str
    put_id: int
    checksum: int | None
    disks: list[str] = []


class ObjectDown(msgspec.Struct, frozen=True, tag=True, array_like=True):
    slot: str
    key: str


Record = SegmentUp | SegmentDown | BlockUp | BlockDown | ObjectUp | ObjectDown
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(list[Record])


def encode(records: list[Record]) -> bytes:
    return _ENCODER.encode(records)


def decode(data: bytes) -> list[Record]:
    """Raises ProtocolError: the bytes are not a list of records (a corrupt log entry)."""
    try:
        return _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError) as exc:
        raise ProtocolError(f"corrupt HA log entry: {exc}") from exc


def records_of(state: MasterState, changes: Changes) -> list[Record]:
    """The final images of the rows in `changes` (pure). Segments come first: a segment
    (re)mounted is logged as Down then Up, so blocks of an earlier mount never come back."""
    out: list[Record] = []
    segments = state.registry.segments
    for sid in sorted(changes.segments):
        out.append(SegmentDown(sid))
        seg = segments.get(sid)
        if seg is not None:
            out.append(SegmentUp(sid, seg.te_segment, seg.client_id, seg.base, seg.allocator.capacity, seg.incarnation))
    for sid, offset in sorted(changes.blocks):
        seg = segments.get(sid)
        size = seg.allocator.size_of(offset) if seg is not None else None
        out.append(BlockUp(sid, offset, size) if size is not None else BlockDown(sid, offset))
    for slot, table, keys in ((COMPLETE, state.objects, changes.objects), (PENDING, state.pending, changes.pending)):
        for key in sorted(keys):
            record = table.get(key)
            out.append(_object_up(slot, record) if record is not None else ObjectDown(slot, key))
    return out


def snapshot_of(state: MasterState) -> list[Record]:
    """Every row of the state as records: replayed into empty tables, they rebuild it (pure)."""
    out: list[Record] = []
    for seg in state.registry.segments.values():
        out.append(
            SegmentUp(seg.segment_id, seg.te_segment, seg.client_id, seg.base, seg.allocator.capacity, seg.incarnation)
        )
        out.extend(BlockUp(seg.segment_id, offset, size) for offset, size in seg.allocator.blocks())
    out.extend(_object_up(COMPLETE, r) for r in state.objects.values())
    out.extend(_object_up(PENDING, r) for r in state.pending.values())
    return out


def _object_up(slot: str, r: ObjectRecord) -> ObjectUp:
    placements = [(p.segment_id, p.offset) for p in r.replicas]
    return ObjectUp(slot, r.key, r.size, r.config, placements, r.writer, r.put_id, r.checksum, list(r.disks))


@dataclass
class Tables:
    """The durable tables, as replay builds them (insertion order kept: it seeds the LRU)."""

    segments: dict[str, SegmentUp] = field(default_factory=dict)
    blocks: dict[tuple[str, int], int] = field(default_factory=dict)
    objects: dict[tuple[str, str], ObjectUp] = field(default_factory=dict)
    num_records: int = 0

    def apply(self, records: list[Record]) -> None:
        """Replay records in order (mutates)."""
        for rec in records:
            if isinstance(rec, SegmentUp):
                self.segments[rec.segment_id] = rec
            elif isinstance(rec, SegmentDown):
                if self.segments.pop(rec.segment_id, None) is not None:
                    self.blocks = {k: v for k, v in self.blocks.items() if k[0] != rec.segment_id}
            elif isinstance(rec, BlockUp):
                self.blocks[(rec.segment_id, rec.offset)] = rec.size
            elif isinstance(rec, BlockDown):
                self.blocks.pop((rec.segment_id, rec.offset), None)
            elif isinstance(rec, ObjectUp):
                self.objects.pop((rec.slot, rec.key), None)  # NOTE: re-inserted last: most recent
                self.objects[(rec.slot, rec.key)] = rec
            else:
                self.objects.pop((rec.slot, rec.key), None)
        self.num_records += len(records)


def restore(tables: Tables, config: MasterConfig, clock: Clock, epoch: int) -> MasterState:
    """A master state holding exactly the tables, with what is not logged restarted
    conservatively (see the module). Raises ProtocolError if the tables are inconsistent."""
    state = MasterState(config, clock, epoch=epoch)
    now = clock.now()
    state.recovering_until = now + config.client_ttl_s
    state.tiers.adopt_unknown = False
    registry = state.registry
    by_segment: dict[str, list[tuple[int, int]]] = {}
    for (sid, offset), size in tables.blocks.items():
        by_segment.setdefault(sid, []).append((offset, size))
    try:
        for up in tables.segments.values():
            allocator = OffsetAllocator(up.size)
            allocator.restore(by_segment.get(up.segment_id, []))
            registry.segments[up.segment_id] = Segment(
                up.segment_id, up.te_segment, up.client_id, up.base, allocator, up.incarnation
            )
            registry.clients.setdefault(up.client_id, Client(up.client_id, now)).segment_ids.add(up.segment_id)
    except Exception as exc:  # OutOfBounds, ConfigError: a log that does not add up
        raise ProtocolError(f"the HA log does not rebuild a consistent state: {exc}") from exc
    owned: set[tuple[str, int]] = set()
    for (slot, key), obj in tables.objects.items():
        placements = [Placement(sid, offset) for sid, offset in obj.placements if (sid, offset) in tables.blocks]
        for disk_id in obj.disks if slot == COMPLETE else ():
            state.tiers.registry.lost.setdefault(disk_id, {})[key] = (obj.put_id, obj.config)
        if not placements:
            continue
        owned.update((p.segment_id, p.offset) for p in placements)
        record = ObjectRecord(
            key,
            obj.size,
            obj.config,
            placements,
            obj.writer,
            now + config.put_timeout_s,
            now + config.lease_ttl_s,
            obj.put_id,
            obj.checksum,
        )
        if slot == COMPLETE:
            state.objects[key] = record
            state.policy.insert(key)
        else:
            state.pending[key] = record
            registry.know(obj.writer, now)
    hold = now + max(config.lease_ttl_s, config.write_grace_s)
    state.retired = [(hold, Placement(sid, off)) for (sid, off) in tables.blocks if (sid, off) not in owned]
    state.retired = [(at, p) for at, p in state.retired if p.segment_id in registry.segments]
    return state
