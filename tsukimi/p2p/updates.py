"""Compare-and-set changes to a payload record: add a reader's shards, remove a holder, delete.

Each reads the record with its revision, changes it and writes it back only if nobody wrote
in between (`compare_and_set`); on a conflict it reads again, after a short random pause
(so that readers finishing together do not collide in lockstep), up to `attempts` times.
A record of another registration (the name was unregistered and registered again) counts as
gone: a reader's shards of the old bytes must never be advertised under the new ones.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable

from tsukimi.errors import PayloadNotFound, RevisionConflict
from tsukimi.p2p.holders import live_holders
from tsukimi.p2p.records import Location, PayloadRecord, decode_record, encode, payload_key
from tsukimi.transfer.metadata import MetadataBackend

logger = logging.getLogger(__name__)


def update_record(
    metadata: MetadataBackend, name: str, registration: str, change: Callable[[PayloadRecord], bool], attempts: int
) -> None:
    """Apply `change` (returns False when there is nothing to write) with compare-and-set.

    Raises:
        PayloadNotFound: no record of that registration. RevisionConflict: still losing
        after `attempts` tries. MetadataError.
    """
    key = payload_key(name)
    for attempt in range(attempts):
        entry = metadata.get_versioned(key)
        record = decode_record(entry.value) if entry is not None else None
        if entry is None or record is None or record.registration != registration:
            raise PayloadNotFound(f"P2P payload {name!r} is no longer registered")
        if not change(record):
            return
        try:
            metadata.compare_and_set(key, encode(record), entry.revision)
            return
        except RevisionConflict:
            time.sleep(random.uniform(0, min(0.05, 0.001 * 2**attempt)))
    raise RevisionConflict(f"P2P payload {name!r}: still conflicting after {attempts} compare-and-set attempts")


def add_replicas(
    metadata: MetadataBackend, name: str, registration: str, locations: dict[int, Location], attempts: int
) -> None:
    """Add `locations` (shard index -> this holder's copy); prunes copies of dead holders.

    Raises what `update_record` raises.
    """
    live = set(live_holders(metadata))

    def change(record: PayloadRecord) -> bool:
        for index, location in locations.items():
            shard = record.shards[index]
            kept = [r for r in shard.replicas if r.segment != location.segment and r.segment in live]
            shard.replicas = [*kept, location]
        return True

    update_record(metadata, name, registration, change, attempts)


def remove_replicas(metadata: MetadataBackend, name: str, registration: str, segment: str, attempts: int) -> None:
    """Remove every copy `segment` holds; a payload already gone is fine. Raises MetadataError,
    RevisionConflict."""

    def change(record: PayloadRecord) -> bool:
        changed = False
        for shard in record.shards:
            kept = [r for r in shard.replicas if r.segment != segment]
            changed |= len(kept) != len(shard.replicas)
            shard.replicas = kept
        return changed

    with contextlib.suppress(PayloadNotFound):
        update_record(metadata, name, registration, change, attempts)


def unregister_record(metadata: MetadataBackend, name: str, registration: str, attempts: int) -> None:
    """Delete the record of this registration (gone already: fine). Raises RevisionConflict,
    MetadataError."""
    key = payload_key(name)
    for attempt in range(attempts):
        entry = metadata.get_versioned(key)
        if entry is None or decode_record(entry.value).registration != registration:
            return
        try:
            metadata.compare_and_delete(key, entry.revision)
            return
        except RevisionConflict:
            time.sleep(random.uniform(0, min(0.05, 0.001 * 2**attempt)))
    raise RevisionConflict(f"P2P payload {name!r}: could not delete it in {attempts} attempts")
