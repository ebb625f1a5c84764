"""What the P2P store keeps in the metadata service: payload records and holder keys.

    tsukimi/p2p/payloads/{name}   PayloadRecord (msgpack), rewritten only by compare-and-set
    tsukimi/p2p/holders/{segment} HolderRecord (msgpack), ephemeral: gone holder_ttl_s after
                                  its holder stopped refreshing it (died, or closed)

A record lists the payload's shards in payload order. Each shard has its **gold** location
(the origin's memory), the crc32c of its bytes, and the replicas readers added after
verifying their copy. A location is a segment and the extents (address, length) that hold
the shard there, in order: a reader's buffers need not line up with the origin's.
`registration` tells one registration of a name from a later one of the same name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from tsukimi.errors import InvalidArgument

PAYLOAD_PREFIX = "tsukimi/p2p/payloads/"
HOLDER_PREFIX = "tsukimi/p2p/holders/"
MAX_NAME_BYTES = 512
RECORD_FORMAT = 1


class Extent(msgspec.Struct, array_like=True, frozen=True):
    """`length` bytes at `address` of a segment."""

    address: int
    length: int


class Location(msgspec.Struct, array_like=True, frozen=True):
    """Where one copy of a shard lies: a segment and its extents, in payload order."""

    segment: str
    extents: tuple[Extent, ...]


class Shard(msgspec.Struct, array_like=True):
    """One shard: payload bytes [offset, offset + size), their crc32c, the origin's copy and
    the readers' verified copies."""

    offset: int
    size: int
    crc32c: int
    gold: Location
    replicas: list[Location] = msgspec.field(default_factory=list)


class PayloadRecord(msgspec.Struct, kw_only=True):
    """A registered payload (the value under PAYLOAD_PREFIX + name)."""

    name: str
    registration: str
    origin: str
    total_bytes: int
    shards: list[Shard]
    meta: bytes = b""
    format: int = RECORD_FORMAT


class HolderRecord(msgspec.Struct, kw_only=True):
    """A live holder: the payloads it holds and those it is fetching (so a reader knows
    whether it is alone with the origin)."""

    pid: int
    holding: list[str] = msgspec.field(default_factory=list)
    fetching: list[str] = msgspec.field(default_factory=list)


@dataclass(frozen=True, slots=True)
class PayloadInfo:
    """What `P2PStore.list` and friends report: `replica_counts[i]` is shard i's number of
    live copies, gold included."""

    name: str
    total_bytes: int
    shard_sizes: list[int]
    replica_counts: list[int]
    meta: bytes = b""


_record_decoder = msgspec.msgpack.Decoder(PayloadRecord)
_holder_decoder = msgspec.msgpack.Decoder(HolderRecord)
_encoder = msgspec.msgpack.Encoder()


def encode(record: PayloadRecord | HolderRecord) -> bytes:
    """msgpack bytes of a record."""
    return _encoder.encode(record)


def decode_record(raw: bytes) -> PayloadRecord:
    """The payload record in `raw`. Raises msgspec.DecodeError on malformed bytes."""
    return _record_decoder.decode(raw)


def decode_holder(raw: bytes) -> HolderRecord | None:
    """The holder record in `raw`, or None when malformed (another version's, say)."""
    try:
        return _holder_decoder.decode(raw)
    except msgspec.DecodeError:
        return None


def payload_key(name: str) -> str:
    """The record's metadata key. Raises InvalidArgument: not a valid payload name."""
    check_name(name)
    return PAYLOAD_PREFIX + name


def check_name(name: str) -> None:
    """Raises InvalidArgument: `name` is not a non-empty str of at most MAX_NAME_BYTES UTF-8
    bytes without control characters."""
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"a payload name must be a non-empty str, got {name!r}")
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise InvalidArgument(f"payload name is over {MAX_NAME_BYTES} bytes")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
        raise InvalidArgument(f"payload name has control characters: {name!r}")


def cut_shards(buffers: Sequence[Extent], segment: str, max_shard_bytes: int) -> list[tuple[int, Location]]:
    """The origin's buffers cut into shards of at most `max_shard_bytes`, none spanning two
    buffers: (payload offset, gold location) per shard, in payload order."""
    shards: list[tuple[int, Location]] = []
    offset = 0
    for buf in buffers:
        for start in range(0, buf.length, max_shard_bytes):
            size = min(max_shard_bytes, buf.length - start)
            shards.append((offset, Location(segment, (Extent(buf.address + start, size),))))
            offset += size
    return shards


def map_range(buffers: Sequence[Extent], offset: int, size: int) -> tuple[Extent, ...]:
    """The extents of `buffers` (concatenated in order) that hold payload bytes
    [offset, offset + size). The caller checked that the buffers cover it."""
    found: list[Extent] = []
    base = 0
    end = offset + size
    for buf in buffers:
        lo, hi = max(offset, base), min(end, base + buf.length)
        if lo < hi:
            found.append(Extent(buf.address + lo - base, hi - lo))
        base += buf.length
        if base >= end:
            break
    return tuple(found)


def pieces(remote: Sequence[Extent], local: Sequence[Extent]) -> list[tuple[int, int, int]]:
    """Pair two extent lists of the same total length: (remote address, local address,
    length) per piece, cut wherever either side's extent ends."""
    out: list[tuple[int, int, int]] = []
    r_index = l_index = r_used = l_used = 0
    while r_index < len(remote) and l_index < len(local):
        r, loc = remote[r_index], local[l_index]
        length = min(r.length - r_used, loc.length - l_used)
        out.append((r.address + r_used, loc.address + l_used, length))
        r_used += length
        l_used += length
        if r_used == r.length:
            r_index, r_used = r_index + 1, 0
        if l_used == loc.length:
            l_index, l_used = l_index + 1, 0
    return out


def info_of(record: PayloadRecord, live: set[str]) -> PayloadInfo:
    """The record as `PayloadInfo`, counting only copies on live segments."""
    counts = [
        int(shard.gold.segment in live) + sum(1 for r in shard.replicas if r.segment in live) for shard in record.shards
    ]
    return PayloadInfo(record.name, record.total_bytes, [s.size for s in record.shards], counts, record.meta)
