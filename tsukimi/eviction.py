"""Eviction policies: which resident keys to give up first. Shared by the store's master and
the scheduler's caches (the simulator's pool and instance caches).

A policy only orders keys; its owner decides which of them may actually go (the master
skips leased and pinned objects, a cache never evicts the blocks of the request it is
serving). Every operation is O(1) or O(log n):

- `lru`: least recently used first.
- `lfu`: least frequently used first (accesses counted while resident; a key evicted and
  inserted again starts from one), ties broken least recently used first.
- `length_aware`: LFU that, among keys of equal frequency, keeps the blocks that occur later
  in their request and gives up the earliest first (then least recently used first). This
  is the issue's reading of the paper's "LengthAwareCache". With prefix matching it evicts
  the heads of chains before their tails, and a tail without its head can no longer be
  hit, which is why it ranks last in hit ratio (docs/reproduction.md).

`position` is the key's index in the request that touched it last (block k of a prompt);
the store, whose objects have no position, passes 0.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Container, Hashable, Iterator
from typing import Generic, Literal, Protocol, TypeVar, get_args

from tsukimi.errors import ConfigError

K = TypeVar("K", bound=Hashable)

PolicyName = Literal["lru", "lfu", "length_aware"]
POLICY_NAMES: tuple[str, ...] = get_args(PolicyName)


class EvictionPolicy(Protocol[K]):
    """Orders resident keys for eviction. Not thread-safe; the owner serializes calls."""

    name: str

    def insert(self, key: K, position: int = 0) -> None:
        """`key` became resident (counts as its first access); re-inserting touches it."""
        ...

    def touch(self, key: K, position: int = 0) -> None:
        """`key` was accessed again; unknown keys are ignored."""
        ...

    def remove(self, key: K) -> None:
        """`key` is gone; unknown keys are ignored."""
        ...

    def pop_victim(self, keep: Container[K] = ()) -> K | None:
        """Remove and return the first key in eviction order that is not in `keep`; None
        when every resident key is kept."""
        ...

    def victims(self) -> Iterator[K]:
        """All keys in eviction order (a snapshot: the caller may remove while iterating)."""
        ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...


class LruPolicy(Generic[K]):
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()

    def insert(self, key: K, position: int = 0) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: K, position: int = 0) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: K) -> None:
        self._order.pop(key, None)

    def pop_victim(self, keep: Container[K] = ()) -> K | None:
        for key in self._order:
            if key not in keep:
                del self._order[key]
                return key
        return None

    def victims(self) -> Iterator[K]:
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class LfuPolicy(Generic[K]):
    """Least frequently used first, then least recently used. A heap of (priority, tick,
    key) entries; an entry whose tick is no longer the key's current one is stale and
    skipped (lazy deletion), and the heap is rebuilt when stale entries dominate."""

    name = "lfu"

    def __init__(self) -> None:
        self._entries: dict[K, tuple[int, int, int]] = {}  # key -> (frequency, position, tick)
        self._heap: list[tuple[tuple[int, ...], int, K]] = []
        self._ticks = itertools.count()

    def _priority(self, frequency: int, position: int) -> tuple[int, ...]:
        return (frequency,)

    def insert(self, key: K, position: int = 0) -> None:
        old = self._entries.get(key)
        self._push(key, (old[0] + 1) if old else 1, position)

    def touch(self, key: K, position: int = 0) -> None:
        old = self._entries.get(key)
        if old is not None:
            self._push(key, old[0] + 1, position)

    def _push(self, key: K, frequency: int, position: int) -> None:
        tick = next(self._ticks)
        self._entries[key] = (frequency, position, tick)
        heapq.heappush(self._heap, (self._priority(frequency, position), tick, key))
        if len(self._heap) > 4 * len(self._entries) + 64:
            self._heap = [(self._priority(f, p), t, k) for k, (f, p, t) in self._entries.items()]
            heapq.heapify(self._heap)

    def remove(self, key: K) -> None:
        self._entries.pop(key, None)

    def pop_victim(self, keep: Container[K] = ()) -> K | None:
        kept: list[tuple[tuple[int, ...], int, K]] = []
        victim: K | None = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            _, tick, key = entry
            current = self._entries.get(key)
            if current is None or current[2] != tick:
                continue  # stale
            if key in keep:
                kept.append(entry)
                continue
            del self._entries[key]
            victim = key
            break
        for entry in kept:
            heapq.heappush(self._heap, entry)
        return victim

    def victims(self) -> Iterator[K]:
        ranked = sorted((self._priority(f, p), t, k) for k, (f, p, t) in self._entries.items())
        return iter([key for _, _, key in ranked])

    def frequency(self, key: K) -> int:
        """Accesses since `key` became resident; 0 when it is not."""
        entry = self._entries.get(key)
        return entry[0] if entry else 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries


class LengthAwarePolicy(LfuPolicy[K]):
    """LFU; among equal frequencies the earliest position in the request goes first."""

    name = "length_aware"

    def _priority(self, frequency: int, position: int) -> tuple[int, ...]:
        return (frequency, position)


def make_policy(name: str) -> EvictionPolicy[K]:
    """A new, empty policy by name ("lru", "lfu", "length_aware"; "length-aware" too).

    Raises:
        ConfigError: an unknown name (the message lists the valid ones).
    """
    normalized = name.replace("-", "_")
    if normalized == "lru":
        return LruPolicy()
    if normalized == "lfu":
        return LfuPolicy()
    if normalized == "length_aware":
        return LengthAwarePolicy()
    raise ConfigError(f"unknown eviction policy {name!r}: expected one of {', '.join(POLICY_NAMES)}")
