"""The Conductor's global prefix index: which KV blocks are cached at which location.

`PrefixIndex` owns the Conductor's view of every cache in the cluster. A *location* is one
cache of one tier of one instance, named "instance/tier" ("prefill-0/hbm", "pool/ssd").
The index is updated from events (`stored`, `evicted`, `drop_location`, or `IndexEvent`s
through `apply`) and answers, for a request's chained block hashes, how long a prefix of
them each location holds. Blocks are plain ints: `BlockHash`es from `hash_blocks`, or a
trace's `hash_ids` as they are.

Layout. Each location owns one bit; a dict maps every indexed block to the bitmask of the
locations holding it, and each location keeps the set of its blocks (for counts and for
`drop_location`). Bits of dropped locations are recycled, lowest first, so masks stay as
narrow as the number of live locations.

Matching walks the request's blocks once, ANDing their masks into a running mask:

    block:          b0      b1      b2      b3
    mask(block):    1011    0011    0111    0001      (bit 0 = location A, ... bit 3 = D)
    running mask:   1011    0011    0011    0001  ->  D: 1, B: 3, A: 4

A location's bit drops out of the running mask at the first block it lacks, and that
position is its prefix length: a block counts only if every block before it is also there.
The walk stops once the running mask is 0, so a miss costs one lookup. It is one plain
loop, a dict lookup and an AND per block (about 50 ns); a version built from
`map`/`accumulate`/`takewhile` measured slower, because it must also find where the mask
changes. Only those changes (at most one per location) do more work.

Not thread-safe: the live servers call it from one thread, the simulator from its loop.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import Literal, get_args

import msgspec

from tsukimi.errors import InvalidArgument

Tier = Literal["hbm", "dram", "ssd"]
TIERS: tuple[Tier, ...] = get_args(Tier)


def location(instance: str, tier: Tier) -> str:
    """Names the cache of tier `tier` of `instance`, e.g. location("prefill-0", "hbm") == "prefill-0/hbm".

    Raises:
        InvalidArgument: `instance` is empty or contains "/", or `tier` is not one of TIERS.
    """
    if not instance or "/" in instance:
        raise InvalidArgument(f"an instance name must be non-empty and contain no '/', got {instance!r}")
    if tier not in TIERS:
        raise InvalidArgument(f"tier must be one of {TIERS}, got {tier!r}")
    return f"{instance}/{tier}"


class IndexEvent(msgspec.Struct, frozen=True):
    """One change to the index, as a live instance publishes it; `blocks` is empty for "dropped"."""

    kind: Literal["stored", "evicted", "dropped"]
    location: str
    blocks: list[int] = []


class PrefixIndex:
    """Which blocks are cached where, and how long a prefix of a request each location holds."""

    def __init__(self) -> None:
        """Starts empty: no location, no block."""
        self._masks: dict[int, int] = {}  # block -> bitmask of the locations holding it (never 0)
        self._bits: dict[str, int] = {}  # location -> its bit (1 << index)
        self._names: dict[int, str] = {}  # bit -> location
        self._blocks: dict[str, set[int]] = {}  # location -> its blocks
        self._free: list[int] = []  # heap of bit indexes released by drop_location
        self._next_index = 0

    # ---- updates -----------------------------------------------------------------

    def stored(self, location: str, blocks: Iterable[int]) -> int:
        """Records that `location` now holds `blocks`; registers the location if new. Mutates.

        Returns:
            How many of `blocks` were not already indexed at `location`.

        Raises:
            InvalidArgument: `location` is not a non-empty str.
        """
        bit = self._bits.get(location)
        if bit is None:
            bit = self._register(location)
        have = self._blocks[location]
        masks = self._masks
        before = len(have)
        for block in blocks:
            if block not in have:
                have.add(block)
                masks[block] = masks.get(block, 0) | bit
        return len(have) - before

    def evicted(self, location: str, blocks: Iterable[int]) -> int:
        """Records that `location` no longer holds `blocks`. Mutates.

        Blocks not indexed there, and unknown locations, are ignored (an eviction may race
        with a drop). The location stays registered even when it has no block left.

        Returns:
            How many blocks were removed.
        """
        have = self._blocks.get(location)
        if have is None:
            return 0
        before = len(have)
        keep = ~self._bits[location]
        masks = self._masks
        for block in blocks:
            if block in have:
                have.discard(block)
                mask = masks[block] & keep
                if mask:
                    masks[block] = mask
                else:
                    del masks[block]
        return before - len(have)

    def drop_location(self, location: str) -> int:
        """Forgets `location` and every block it held (its instance died); frees its bit. Mutates.

        Returns:
            How many blocks the location held; 0 for an unknown location.
        """
        have = self._blocks.pop(location, None)
        if have is None:
            return 0
        bit = self._bits.pop(location)
        del self._names[bit]
        keep = ~bit
        masks = self._masks
        for block in have:
            mask = masks[block] & keep
            if mask:
                masks[block] = mask
            else:
                del masks[block]
        heapq.heappush(self._free, bit.bit_length() - 1)
        return len(have)

    def apply(self, event: IndexEvent) -> int:
        """Applies one published event; see `stored`, `evicted` and `drop_location`. Mutates.

        Returns:
            What the matching method returns.
        """
        blocks = event.blocks
        if event.kind == "stored":
            return self.stored(event.location, blocks)
        if event.kind == "evicted":
            return self.evicted(event.location, blocks)
        return self.drop_location(event.location)

    def _register(self, location: str) -> int:
        if not isinstance(location, str) or not location:
            raise InvalidArgument(f"a location must be a non-empty str, got {location!r}")
        if self._free:
            index = heapq.heappop(self._free)
        else:
            index = self._next_index
            self._next_index += 1
        bit = 1 << index
        self._bits[location] = bit
        self._names[bit] = location
        self._blocks[location] = set()
        return bit

    # ---- queries (none of them mutates) --------------------------------------------

    def match(self, blocks: Sequence[int]) -> dict[str, int]:
        """How long a prefix of `blocks` each location holds.

        Returns:
            For every location holding blocks[0], the length of the longest prefix of
            `blocks` all of whose blocks it holds; locations holding blocks[0] but nothing
            further map to 1. Keys are in ascending name order. {} when none holds blocks[0].
        """
        out: dict[str, int] = {}
        names = self._names
        for mask, length in self._runs(blocks, -1):
            while mask:
                low = mask & -mask
                out[names[low]] = length
                mask ^= low
        return dict(sorted(out.items()))

    def match_at(self, location: str, blocks: Sequence[int]) -> int:
        """The length of the longest prefix of `blocks` held at `location`; 0 if unknown."""
        bit = self._bits.get(location)
        if bit is None:
            return 0
        get = self._masks.get
        for i, block in enumerate(blocks):
            if not get(block, 0) & bit:
                return i
        return len(blocks)

    def best(self, blocks: Sequence[int], among: Iterable[str] | None = None) -> tuple[str | None, int]:
        """The location holding the longest prefix of `blocks`.

        Args:
            blocks: the request's chained block hashes.
            among: only consider these locations (unknown names are ignored); None for all.

        Returns:
            (location, prefix length), ties going to the smallest location name;
            (None, 0) when no considered location holds blocks[0].
        """
        if among is None:
            allowed = -1
        else:
            bits = self._bits
            allowed = 0
            for name in among:
                allowed |= bits.get(name, 0)
        runs = self._runs(blocks, allowed)
        if not runs:
            return None, 0
        last_mask, length = runs[-1]
        names = self._names
        winner = min(names[1 << i] for i in range(last_mask.bit_length()) if last_mask >> i & 1)
        return winner, length

    def _runs(self, blocks: Sequence[int], allowed: int) -> list[tuple[int, int]]:
        """Walks `blocks` once; returns (bits dropping out of the running mask, their prefix length) pairs.

        The running mask starts as `allowed` (-1 for every location) and only shrinks, so
        there is at most one pair per location, in increasing length order; the last pair
        holds the bits that survive the longest. The walk stops when the mask reaches 0.
        """
        if not blocks or not allowed:
            return []
        get = self._masks.get
        runs: list[tuple[int, int]] = []
        running = allowed
        for i, block in enumerate(blocks):
            mask = running & get(block, 0)
            if mask != running:
                if i:  # NOTE: bits lacking block 0 have no prefix at all: they are not reported
                    runs.append((running & ~mask, i))
                if not mask:
                    return runs
                running = mask
        runs.append((running, len(blocks)))
        return runs

    def locations(self) -> list[str]:
        """Every registered location (stored to at least once, not dropped since), sorted."""
        return sorted(self._bits)

    def num_blocks(self, location: str | None = None) -> int:
        """Blocks indexed at `location` (0 if unknown), or distinct blocks indexed anywhere if None."""
        if location is None:
            return len(self._masks)
        have = self._blocks.get(location)
        return 0 if have is None else len(have)

    def check_invariants(self) -> None:
        """Raises AssertionError if the masks, bits, names and per-location sets disagree."""
        assert set(self._bits) == set(self._blocks), "bits and block sets name different locations"
        assert {bit: name for name, bit in self._bits.items()} == self._names, "bit -> name map is stale"
        used = {bit.bit_length() - 1 for bit in self._bits.values()}
        assert all(bit.bit_count() == 1 for bit in self._bits.values()), "a location owns more than one bit"
        assert len(used) == len(self._bits), "two locations share a bit"
        assert not used & set(self._free), "a free bit is in use"
        assert len(set(self._free)) == len(self._free), "a bit is freed twice"
        assert used | set(self._free) == set(range(self._next_index)), "a bit leaked"
        all_bits = sum(self._bits.values())
        total = 0
        for block, mask in self._masks.items():
            assert mask and not mask & ~all_bits, f"block {block} has mask {mask:#x} with free bits"
            total += mask.bit_count()
        assert total == sum(len(have) for have in self._blocks.values()), "masks and sets disagree on counts"
        for name, have in self._blocks.items():
            bit = self._bits[name]
            for block in have:
                assert self._masks.get(block, 0) & bit, f"block {block} of {name} is missing its bit"
