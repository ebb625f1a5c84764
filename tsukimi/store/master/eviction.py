"""Eviction policies: which objects to give up first when memory runs short.

A policy only orders keys; the master decides which of them may go (not leased, not
hard-pinned, soft-pinned last). The same small protocol will serve the scheduler's prefix
index (LRU, LFU, length-aware) in a later issue.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol


class EvictionPolicy(Protocol):
    def insert(self, key: str) -> None:
        """A new object became visible (most recently used)."""
        ...

    def touch(self, key: str) -> None:
        """The object was read."""
        ...

    def remove(self, key: str) -> None:
        """The object is gone; unknown keys are ignored."""
        ...

    def victims(self) -> Iterator[str]:
        """Keys in the order they should be evicted (a snapshot: callers may remove while iterating)."""
        ...

    def keys(self) -> set[str]: ...


class LruPolicy:
    """Least recently used first. O(1) per operation."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()

    def insert(self, key: str) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: str) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[str]:
        return iter(list(self._order))

    def keys(self) -> set[str]:
        return set(self._order)
