"""`mooncake.store.ReplicateConfig` and `SoftPinAction`: how a put stores its object, with
Mooncake's attribute names and type checks, turned into tsukimi's `ReplicaConfig`.

| Mooncake                         | tsukimi ReplicaConfig                                    |
|----------------------------------|----------------------------------------------------------|
| replica_num                      | replicas                                                 |
| soft_pin_action ENABLE           | soft_pin (for soft_pin_ttl_ms, or the master's TTL)      |
| soft_pin_action PRESERVE         | keep_soft_pin: an upsert keeps the old version's pin     |
| soft_pin_action DISABLE          | no soft pin                                              |
| with_hard_pin                    | hard_pin                                                 |
| preferred_segment(s)             | preferred_segments (TE segment names, `get_hostname()`)  |
| prefer_alloc_in_same_node        | this client's own segment first                          |
| group_ids (one per key)          | group, per key ("" none): master/groups.py               |
| session_ids (one per key)        | session, per key: the writer's session, kept as metadata |

Mooncake refuses a TTL without ENABLE (INVALID_PARAMS), and so does tsukimi; so is a
`group_ids` or `session_ids` list whose length is not the number of keys put (every key of
the call fails, nothing is stored). NoF and DFS replicas do not exist here: a put that asks
for them fails with INVALID_PARAMS rather than silently storing something else. `data_type`
(an `ObjectDataType`, type-checked as the wheel does) labels the object for the master's
per-type statistics in Mooncake; tsukimi's master keeps none, so the label changes nothing.
"""

from __future__ import annotations

import enum

import msgspec

from tsukimi.errors import InvalidArgument
from tsukimi.store import protocol as p

_U64 = 1 << 64


class SoftPinAction(enum.IntEnum):
    """What a put does to the object's soft pin (Mooncake's values)."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ObjectDataType(enum.IntEnum):
    """`mooncake.store.ObjectDataType`: what an object holds (Mooncake's values)."""

    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


class ReplicateConfig:
    """Mooncake's put options; attributes are type-checked on assignment (TypeError), as
    Mooncake's bindings do, and unknown attributes are refused (AttributeError)."""

    __slots__ = (
        "_data_type",
        "_group_ids",
        "_preferred_segment",
        "_preferred_segments",
        "_replica_num",
        "_session_ids",
        "_soft_pin_action",
        "_soft_pin_ttl_ms",
        "_with_hard_pin",
        "dfs_replica_num",
        "nof_replica_num",
        "prefer_alloc_in_same_node",
        "preferred_nof_segments",
    )

    def __init__(self) -> None:
        self._replica_num = 1
        self._soft_pin_action = SoftPinAction.PRESERVE
        self._soft_pin_ttl_ms: int | None = None
        self._with_hard_pin = False
        self._preferred_segment = ""
        self._preferred_segments: list[str] = []
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.prefer_alloc_in_same_node = False
        self.preferred_nof_segments: list[str] = []
        self._group_ids: list[str] | None = None
        self._session_ids: list[str] = []
        self._data_type = ObjectDataType.UNKNOWN

    @property
    def replica_num(self) -> int:
        return self._replica_num

    @replica_num.setter
    def replica_num(self, value: int) -> None:
        self._replica_num = _uint("replica_num", value)

    @property
    def soft_pin_action(self) -> SoftPinAction:
        return self._soft_pin_action

    @soft_pin_action.setter
    def soft_pin_action(self, value: SoftPinAction) -> None:
        if not isinstance(value, SoftPinAction):
            raise TypeError(f"soft_pin_action must be a SoftPinAction, got {value!r}")
        self._soft_pin_action = value

    @property
    def soft_pin_ttl_ms(self) -> int | None:
        return self._soft_pin_ttl_ms

    @soft_pin_ttl_ms.setter
    def soft_pin_ttl_ms(self, value: int | None) -> None:
        self._soft_pin_ttl_ms = None if value is None else _uint("soft_pin_ttl_ms", value)

    @property
    def with_hard_pin(self) -> bool:
        return self._with_hard_pin

    @with_hard_pin.setter
    def with_hard_pin(self, value: bool) -> None:
        if not isinstance(value, bool | int):
            raise TypeError(f"with_hard_pin must be a bool, got {value!r}")
        self._with_hard_pin = bool(value)

    @property
    def with_soft_pin(self) -> bool:
        """Mooncake before SoftPinAction: True is ENABLE, False PRESERVE."""
        return self._soft_pin_action is SoftPinAction.ENABLE

    @with_soft_pin.setter
    def with_soft_pin(self, value: bool) -> None:
        self._soft_pin_action = SoftPinAction.ENABLE if value else SoftPinAction.PRESERVE

    @property
    def preferred_segment(self) -> str:
        return self._preferred_segment

    @preferred_segment.setter
    def preferred_segment(self, value: str) -> None:
        if not isinstance(value, str):
            raise TypeError(f"preferred_segment must be a str, got {value!r}")
        self._preferred_segment = value

    @property
    def preferred_segments(self) -> list[str]:
        return list(self._preferred_segments)

    @preferred_segments.setter
    def preferred_segments(self, value: list[str]) -> None:
        if isinstance(value, str | bytes) or not all(isinstance(v, str) for v in value):
            raise TypeError(f"preferred_segments must be a list of str, got {value!r}")
        self._preferred_segments = list(value)

    @property
    def group_ids(self) -> list[str] | None:
        """The replica group of each key put ("" none); None (the default) or [] groups none."""
        return None if self._group_ids is None else list(self._group_ids)

    @group_ids.setter
    def group_ids(self, value: list[str] | None) -> None:
        self._group_ids = None if value is None else _strings("group_ids", value)

    @property
    def session_ids(self) -> list[str]:
        """The writing session of each key put (newer Mooncake builds); [] names none."""
        return list(self._session_ids)

    @session_ids.setter
    def session_ids(self, value: list[str] | None) -> None:
        self._session_ids = [] if value is None else _strings("session_ids", value)

    @property
    def data_type(self) -> ObjectDataType:
        return self._data_type

    @data_type.setter
    def data_type(self, value: ObjectDataType) -> None:
        if not isinstance(value, ObjectDataType):
            raise TypeError(f"data_type must be a mooncake.store.ObjectDataType, got {value!r}")
        self._data_type = value

    def __str__(self) -> str:
        ttl = "default" if self._soft_pin_ttl_ms is None else str(self._soft_pin_ttl_ms)
        return (
            f"ReplicateConfig: {{ replica_num: {self._replica_num}, soft_pin_action: {self._soft_pin_action.name}, "
            f"soft_pin_ttl_ms: {ttl}, with_hard_pin: {int(self._with_hard_pin)}, "
            f"preferred_segments: [{', '.join(self._preferred_segments)}], "
            f"preferred_segment: {self._preferred_segment}, "
            f"prefer_alloc_in_same_node: {int(self.prefer_alloc_in_same_node)} }}"
        )

    def per_key(self, num_keys: int, own_segment: str = "") -> list[p.ReplicaConfig]:
        """tsukimi's config for each of `num_keys` keys put in one call: `group_ids` and
        `session_ids` give one entry per key. Pure.

        Raises:
            InvalidArgument: a list of per-key ids whose length is not `num_keys`, or what
                `to_tsukimi` refuses.
        """
        groups, sessions = self._ids(num_keys)
        base = self.to_tsukimi(own_segment, per_key=False)
        if not groups and not sessions:
            return [base] * num_keys
        return [
            msgspec.structs.replace(base, group=groups[i] if groups else "", session=sessions[i] if sessions else "")
            for i in range(num_keys)
        ]

    def _ids(self, num_keys: int) -> tuple[list[str], list[str]]:
        groups, sessions = self._group_ids or [], self._session_ids
        for name, ids in (("group_ids", groups), ("session_ids", sessions)):
            if ids and len(ids) != num_keys:
                raise InvalidArgument(f"{name} has {len(ids)} entries for {num_keys} keys: it needs one per key")
        return groups, sessions

    def to_tsukimi(self, own_segment: str = "", *, per_key: bool = True) -> p.ReplicaConfig:
        """tsukimi's config, for every object of the put; `own_segment` (this client's TE
        segment) serves prefer_alloc_in_same_node. A single `group_ids` / `session_ids` entry
        applies to every object (`per_key` False: they are left to `per_key`). Pure.

        Raises:
            InvalidArgument: what tsukimi cannot store, or several per-key ids (use `per_key`).
        """
        if self.nof_replica_num or self.dfs_replica_num or self.preferred_nof_segments:
            raise InvalidArgument("NoF / DFS replicas are not supported by tsukimi")
        groups, sessions = (self._group_ids or [], self._session_ids) if per_key else ([], [])
        if len(groups) > 1 or len(sessions) > 1:
            raise InvalidArgument("this put takes at most one group_ids / session_ids entry, for all its objects")
        preferred = [self._preferred_segment] if self._preferred_segment else []
        preferred += [s for s in self._preferred_segments if s not in preferred]
        if self.prefer_alloc_in_same_node and own_segment:
            preferred.insert(0, own_segment)
        ttl_ms = self._soft_pin_ttl_ms
        return p.ReplicaConfig(
            self._replica_num,
            soft_pin=self._soft_pin_action is SoftPinAction.ENABLE,
            hard_pin=self._with_hard_pin,
            preferred_segments=tuple(dict.fromkeys(preferred)),
            soft_pin_ttl_s=None if ttl_ms is None else ttl_ms / 1000,
            keep_soft_pin=self._soft_pin_action is SoftPinAction.PRESERVE,
            group=groups[0] if groups else "",
            session=sessions[0] if sessions else "",
        )


def _strings(name: str, value: list[str]) -> list[str]:
    """Mooncake's `Optional[list[str]]` attributes (a tuple is taken too): TypeError for anything else."""
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{name} must be a list of str, got {value!r}")
    return list(value)


def _uint(name: str, value: int) -> int:
    """Mooncake's unsigned integer attributes: TypeError for anything else."""
    if not isinstance(value, int) or not 0 <= value < _U64:
        raise TypeError(f"{name} must be an integer in [0, 2**64), got {value!r}")
    return int(value)
