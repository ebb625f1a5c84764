"""Offset allocation inside one mounted memory segment.

`OffsetAllocator` owns the byte range [0, capacity) of a segment a client mounted: which
blocks are handed out to replicas and which are free. It never touches the bytes; the
master records offsets and the client moves data there with the Transfer Engine.

Best fit over a coalesced free list. Free blocks are kept twice, sorted by offset (to
find neighbours when freeing) and sorted by (size, offset) (to find the smallest hole that
fits); both lookups are bisections. A block is carved from the front of its hole:

    before:  |##used##|<----------- hole (size h) ----------->|##used##|
             0        o                                        o+h
    after:   |##used##|<- rounded ->|<-- hole (h - rounded) -->|##used##|
                      o             o+rounded

Sizes are rounded up to `alignment` and every offset is a multiple of it, so the capacity
is rounded down to `alignment` at construction: free and allocated bytes always add up to
exactly `capacity`.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from tsukimi.errors import ConfigError, OutOfBounds


class OffsetAllocator:
    """Best-fit allocator of aligned byte ranges in [0, capacity); not thread-safe."""

    def __init__(self, capacity: int, alignment: int = 64) -> None:
        """Start with one free block spanning the whole (aligned) capacity.

        Args:
            capacity: bytes in the segment; rounded down to a multiple of `alignment`.
            alignment: a positive power of two; every offset and size is a multiple of it.

        Raises:
            ConfigError: alignment is not a positive power of two, or the capacity is
                smaller than one alignment unit.
        """
        if alignment <= 0 or alignment & (alignment - 1):
            raise ConfigError(f"alignment must be a positive power of two, got {alignment}")
        if capacity <= 0:
            raise ConfigError(f"capacity must be positive, got {capacity}")
        aligned = capacity - capacity % alignment
        if aligned == 0:
            raise ConfigError(f"capacity {capacity} is smaller than the alignment {alignment}")
        self._alignment = alignment
        self._capacity = aligned
        self._free_offsets: list[int] = []  # sorted offsets of free blocks
        self._free_sizes: dict[int, int] = {}  # free block offset -> size
        self._by_size: list[tuple[int, int]] = []  # sorted (size, offset) of free blocks
        self._allocated: dict[int, int] = {}  # allocated block offset -> rounded size
        self._used_bytes = 0
        self._add_free(0, aligned)

    @property
    def capacity(self) -> int:
        """Usable bytes: the constructor's capacity rounded down to `alignment`."""
        return self._capacity

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def free_bytes(self) -> int:
        return self._capacity - self._used_bytes

    @property
    def largest_free_bytes(self) -> int:
        """Size of the largest free block; an allocation of more than this returns None."""
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def num_allocations(self) -> int:
        return len(self._allocated)

    @property
    def usage(self) -> float:
        """Fraction of the capacity allocated, in [0, 1]."""
        return self._used_bytes / self._capacity

    def allocate(self, size: int) -> int | None:
        """Hand out the front of the smallest free block that fits `size` (mutates).

        Ties between equally sized holes go to the lowest offset, so results are
        deterministic.

        Args:
            size: bytes wanted; rounded up to a multiple of `alignment`.

        Returns:
            The offset of the new block, or None when no free block is large enough
            (an expected outcome: the caller evicts or tries another segment).

        Raises:
            ConfigError: size is not positive.
        """
        if size <= 0:
            raise ConfigError(f"allocation size must be positive, got {size}")
        rounded = -(-size // self._alignment) * self._alignment
        i = bisect_left(self._by_size, (rounded, -1))
        if i == len(self._by_size):
            return None
        hole_size, offset = self._by_size[i]
        self._remove_free(offset)
        if hole_size > rounded:
            # NOTE: the remainder cannot touch another free block: the list was coalesced
            # and its left neighbour is the block just allocated.
            self._add_free(offset + rounded, hole_size - rounded)
        self._allocated[offset] = rounded
        self._used_bytes += rounded
        return offset

    def free(self, offset: int) -> int:
        """Return the block at `offset` to the free list, merging free neighbours (mutates).

        Args:
            offset: an offset previously returned by `allocate` and not yet freed.

        Returns:
            The rounded size of the freed block.

        Raises:
            OutOfBounds: no live allocation starts at `offset` (unknown or double free).
        """
        size = self._allocated.pop(offset, None)
        if size is None:
            raise OutOfBounds(f"no allocated block starts at offset {offset} (unknown offset or double free)")
        self._used_bytes -= size
        start, end = offset, offset + size
        i = bisect_left(self._free_offsets, offset)
        if i > 0:
            left = self._free_offsets[i - 1]
            if left + self._free_sizes[left] == start:
                self._remove_free(left)
                start = left
        right_size = self._free_sizes.get(end)
        if right_size is not None:
            self._remove_free(end)
            end += right_size
        self._add_free(start, end - start)
        return size

    def size_of(self, offset: int) -> int | None:
        """The rounded size of the live block at `offset`, or None (pure)."""
        return self._allocated.get(offset)

    def blocks(self) -> list[tuple[int, int]]:
        """Every live block as (offset, rounded size), by offset (pure)."""
        return sorted(self._allocated.items())

    def restore(self, blocks: list[tuple[int, int]]) -> None:
        """Make exactly `blocks` (offset, rounded size) the live allocations of this empty
        allocator, the rest free (mutates; rebuilding a master's state from its log).

        Raises:
            OutOfBounds: the allocator is not empty, or a block is misaligned, overlaps
                another or lies outside the capacity.
        """
        if self._allocated:
            raise OutOfBounds("restore needs an empty allocator")
        cursor = 0
        for offset, size in sorted(blocks):
            if offset < cursor or size <= 0 or offset % self._alignment or size % self._alignment:
                raise OutOfBounds(f"block ({offset}, {size}) is misaligned or overlaps the one before")
            cursor = offset + size
        if cursor > self._capacity:
            raise OutOfBounds(f"blocks end at {cursor}, past the capacity {self._capacity}")
        self._free_offsets, self._free_sizes, self._by_size = [], {}, []
        self._allocated = dict(blocks)
        self._used_bytes = sum(self._allocated.values())
        cursor = 0
        for offset, size in sorted(blocks):
            if offset > cursor:
                self._add_free(cursor, offset - cursor)
            cursor = offset + size
        if cursor < self._capacity:
            self._add_free(cursor, self._capacity - cursor)

    def check_invariants(self) -> None:
        """Assert the internal invariants; for tests, O(n log n), does not mutate."""
        align = self._alignment
        assert len(self._free_offsets) == len(self._free_sizes) == len(self._by_size)
        assert self._free_offsets == sorted(self._free_sizes)
        assert self._by_size == sorted((s, o) for o, s in self._free_sizes.items())
        prev_end = -1
        for offset in self._free_offsets:
            size = self._free_sizes[offset]
            assert size > 0 and offset % align == 0 and size % align == 0, (offset, size)
            assert offset > prev_end, f"free block at {offset} overlaps or touches the previous one"
            prev_end = offset + size
        for offset, size in self._allocated.items():
            assert size > 0 and offset % align == 0 and size % align == 0, (offset, size)
        assert sum(self._allocated.values()) == self._used_bytes
        blocks = sorted([*self._free_sizes.items(), *self._allocated.items()])
        cursor = 0
        for offset, size in blocks:
            assert offset == cursor, f"gap or overlap at offset {cursor}: next block starts at {offset}"
            cursor = offset + size
        assert cursor == self._capacity, f"blocks end at {cursor}, capacity is {self._capacity}"

    def _add_free(self, offset: int, size: int) -> None:
        insort(self._free_offsets, offset)
        self._free_sizes[offset] = size
        insort(self._by_size, (size, offset))

    def _remove_free(self, offset: int) -> None:
        size = self._free_sizes.pop(offset)
        del self._free_offsets[bisect_left(self._free_offsets, offset)]
        del self._by_size[bisect_left(self._by_size, (size, offset))]
