"""Replica groups: objects that are kept and evicted together (Mooncake's "object groups").

A complete object whose config names a `group` (`ReplicaConfig.group`) is a member of that
group. `ObjectTable`, the master's table of complete objects, keeps each group's members as
rows come and go, on every insert, replace and delete (put end, upsert, remove, eviction,
lost replicas, disk adoption, HA restore), so no caller has to remember it; an emptied group
disappears.

What a group changes (state.py):
- a lease-granting read (GetReplicas) of a member renews every member's read lease and LRU
  position; `Exists` grants no lease, for members as for any object;
- eviction of a member takes along the other members that pass the per-object checks (not
  hard-pinned, not soft-pinned outside the soft-pinned pass, no read lease, still in memory).

Membership is fixed while a key exists: an upsert's new version stays in the old version's
group, whatever group it names. Remove, copy / move and the disk tier stay per object. Best
effort, not transactional: a leased or pinned member stays when the others go, and members
are placed independently.
"""

from __future__ import annotations

import msgspec

from tsukimi.errors import InvalidArgument
from tsukimi.store.master.changes import TrackedDict
from tsukimi.store.master.records import ObjectRecord
from tsukimi.store.protocol import ReplicaConfig

MAX_MEMBERS = 1024  # objects in one replica group (see check_room)


class ObjectTable(TrackedDict[ObjectRecord]):
    """The complete objects by key, with the members of each replica group (`groups`)."""

    def __init__(self) -> None:
        super().__init__()
        self.groups: dict[str, set[str]] = {}

    def __setitem__(self, key: str, value: ObjectRecord) -> None:
        old = self.get(key)
        if old is not None:
            self._leave(key, old)
        super().__setitem__(key, value)
        if value.config.group:
            self.groups.setdefault(value.config.group, set()).add(key)

    def __delitem__(self, key: str) -> None:
        self._leave(key, self[key])
        super().__delitem__(key)

    def pop(self, key: str, default: ObjectRecord | None = None) -> ObjectRecord | None:  # type: ignore[override]
        if key in self:
            self._leave(key, self[key])
        return super().pop(key, default)

    def _leave(self, key: str, record: ObjectRecord) -> None:
        group = record.config.group
        members = self.groups.get(group)
        if members is not None:
            members.discard(key)
            if not members:
                del self.groups[group]

    def others(self, record: ObjectRecord) -> list[ObjectRecord]:
        """The other current members of `record`'s group, in key order; [] when ungrouped (pure)."""
        if not record.config.group:  # NOTE: the common case, on every get: no set, no sort
            return []
        members = self.groups.get(record.config.group, set())
        return [self[key] for key in sorted(members) if key != record.key]

    def check_invariants(self) -> None:
        """Every member exists and names its group; every grouped object is a member; no group is empty."""
        for group, members in self.groups.items():
            assert members, f"group {group!r} is empty"
            for key in members:
                assert key in self and self[key].config.group == group, f"{key!r} is no member of {group!r}"
        grouped = sum(1 for record in self.values() if record.config.group)
        assert grouped == sum(len(m) for m in self.groups.values()), "a grouped object is missing from its group"


def check_room(objects: ObjectTable, key: str, config: ReplicaConfig) -> None:
    """Refuse a put that would grow a group past MAX_MEMBERS (pure).

    NOTE: a read of one member renews every member, and eviction takes them all, under the
    master's lock: a group is for the objects of one logical page (Mooncake's use: a KV
    page's shards), not a namespace for a whole pool.

    Raises:
        InvalidArgument: the group is full and `key` is not a member.
    """
    members = objects.groups.get(config.group) if config.group else None
    if members is not None and len(members) >= MAX_MEMBERS and key not in members:
        raise InvalidArgument(f"replica group {config.group!r} has {MAX_MEMBERS} members already (the most)")


def settle(record: ObjectRecord, old: ObjectRecord | None) -> None:
    """Fix the group of `record`, the version being completed, replacing `old` (None: a new
    key). Mutates `record`: a key stays in the group it is in, so the config logged is the
    membership in force."""
    if old is not None and record.config.group != old.config.group:
        record.config = msgspec.structs.replace(record.config, group=old.config.group)
