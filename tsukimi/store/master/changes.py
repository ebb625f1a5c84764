"""Change tracking for the HA log: which rows of the master's tables one or more operations
changed (`Changes`), and `TrackedDict`, the object tables that remember it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")


class TrackedDict(dict[str, V], Generic[V]):
    """A dict that remembers which keys were set or deleted (when `changed` is a set)."""

    changed: set[str] | None = None

    def __setitem__(self, key: str, value: V) -> None:
        if self.changed is not None:
            self.changed.add(key)
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        if self.changed is not None:
            self.changed.add(key)
        super().__delitem__(key)

    def pop(self, key: str, default: V | None = None) -> V | None:  # type: ignore[override]
        if self.changed is not None:
            self.changed.add(key)
        return super().pop(key, default)


@dataclass(frozen=True, slots=True)
class Changes:
    """What one or more operations changed: the rows the HA master logs (pure data)."""

    segments: set[str]
    blocks: set[tuple[str, int]]
    objects: set[str]
    pending: set[str]

    def __bool__(self) -> bool:
        return bool(self.segments or self.blocks or self.objects or self.pending)
