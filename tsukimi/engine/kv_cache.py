"""The paged KV cache: fixed-size token blocks in one tensor, a block pool with local prefix
caching, and the attention that reads a batch of sequences' KV from their block tables.

Layout: each (block, layer) is one contiguous slot, its K/V followed by a 64-byte trailer
that the KV pool fills with the slot's identity, so a slot moves to and from the pool as one
buffer, in place (tsukimi/engine/kv_pool.py)::

    slot(block, layer) = | k|v, token in block, kv head, head dim (layer_bytes) | trailer (64 B) |
    kv[block, layer, k|v, token, kv head, head dim]: a strided tensor view over the slots

A block holding a full, hashed run of tokens stays cached after its sequence ends and is reused
by any later sequence with the same prefix (chained block hashes, tsukimi/scheduler/block_hash.py);
unreferenced cached blocks are recycled least recently used first.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tsukimi.engine.model import attention, end_aligned_causal
from tsukimi.engine.stream_order import StreamOrder
from tsukimi.errors import ConfigError, InvalidArgument
from tsukimi.eviction import LruPolicy
from tsukimi.scheduler.block_hash import BlockHash

SLOT_TRAILER_BYTES = 64


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: torch.dtype = torch.float32

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_tokens, self.num_kv_heads, self.head_dim)

    @property
    def layer_bytes(self) -> int:
        return 2 * self.block_tokens * self.num_kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def slot_bytes(self) -> int:
        """One (block, layer) slot: its K/V and the trailer."""
        return self.layer_bytes + SLOT_TRAILER_BYTES


class BlockPool:
    """Block ids 0..num_blocks-1 with reference counts and a local prefix cache. Not thread-safe."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ConfigError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() gives the lowest id first
        self._refs = [0] * num_blocks
        self._by_hash: dict[BlockHash, int] = {}  # chained hash -> the block caching it
        self._hash_of: dict[int, BlockHash] = {}  # block -> its hash (cached blocks only)
        self._idle: LruPolicy[int] = LruPolicy()  # cached blocks nobody references
        # NOTE: when a list, every change to the cached set in order: (True, hash) cached,
        # (False, hash) evicted; the worker publishes it as KV events (tsukimi/serving/kv_events.py)
        self.journal: list[tuple[bool, BlockHash]] | None = None

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free or idle cached)."""
        return len(self._free) + len(self._idle)

    def allocate(self) -> int | None:
        """A block with one reference, or None when every block is in use (mutates)."""
        if self._free:
            block = self._free.pop()
        else:
            victim = self._idle.pop_victim()
            if victim is None:
                return None
            block = victim
            evicted = self._hash_of.pop(block)
            del self._by_hash[evicted]
            if self.journal is not None:
                self.journal.append((False, evicted))
        self._refs[block] = 1
        return block

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes`, each with one more reference."""
        found: list[int] = []
        for block_hash in hashes:
            block = self._by_hash.get(block_hash)
            if block is None:
                break
            if self._refs[block] == 0:
                self._idle.remove(block)
            self._refs[block] += 1
            found.append(block)
        return found

    def cache(self, block: int, block_hash: BlockHash) -> None:
        """`block` now holds the full block whose chained hash is `block_hash` (mutates; a hash
        already cached elsewhere keeps its first block)."""
        if block_hash not in self._by_hash and block not in self._hash_of:
            self._by_hash[block_hash] = block
            self._hash_of[block] = block_hash
            if self.journal is not None:
                self.journal.append((True, block_hash))

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; cached ones stay reusable until recycled."""
        for block in blocks:
            assert self._refs[block] > 0, f"block {block} released more often than taken"
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._idle.insert(block)
                else:
                    self._free.append(block)

    def drop_cached(self) -> int:
        """Forget every cached block (the weights changed: their KV is stale): idle ones become
        free, referenced ones stay with their holders but are never found again (mutates).
        Returns how many blocks were cached."""
        dropped = len(self._hash_of)
        if self.journal is not None:
            self.journal += [(False, block_hash) for block_hash in self._by_hash]
        for block in self._hash_of:
            if self._refs[block] == 0:
                self._idle.remove(block)
                self._free.append(block)
        self._by_hash.clear()
        self._hash_of.clear()
        return dropped

    def cached_hashes(self) -> set[BlockHash]:
        """The hashes of every block cached now (pure)."""
        return set(self._by_hash)

    def check_invariants(self) -> None:
        free, idle = set(self._free), {b for b in range(self.num_blocks) if b in self._idle}
        assert len(free) == len(self._free) and not free & idle
        for block in range(self.num_blocks):
            in_use = self._refs[block] > 0
            assert in_use + (block in free) + (block in idle) == 1, f"block {block} in several states"
            assert block not in free or block not in self._hash_of
        assert all(self._by_hash[h] == b for b, h in self._hash_of.items())
        assert len(self._by_hash) == len(self._hash_of)


@dataclass(slots=True)
class SequenceKV:
    """One sequence's blocks, and how many of its tokens have KV in them."""

    block_table: list[int] = field(default_factory=list)
    num_tokens: int = 0


class PagedKVCache:
    """The KV tensor and its block pool, on `device`. On the CPU, `storage`, when given, is the
    memory to use (e.g. registered shared memory, so that the KV pool reads and writes blocks
    in place); on a GPU the cache is one device allocation with the same slot layout, and the
    KV pool moves slots through pinned staging (tsukimi/engine/kv_staging.py)."""

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        storage: memoryview | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.layout, self.pool, self.device = layout, BlockPool(num_blocks), torch.device(device)
        total = num_blocks * layout.num_layers * layout.slot_bytes
        if self.device.type != "cpu":
            if storage is not None:
                raise ConfigError(f"KV storage in host memory cannot back a cache on {self.device}")
            raw = torch.zeros(total, dtype=torch.uint8, device=self.device)  # NOTE: reads as zeros, as mmap
        elif storage is None:
            # NOTE: anonymous memory reads as zeros and is committed page by page as blocks are
            # first written, so a large budget (tsukimi/engine/kv_budget.py) costs what is used
            self._memory = mmap.mmap(-1, total)
            raw = torch.frombuffer(self._memory, dtype=torch.uint8, count=total)
        elif len(storage) < total:
            raise ConfigError(f"KV storage of {len(storage)} bytes < {num_blocks} blocks of {total // num_blocks}")
        else:
            raw = torch.frombuffer(storage, dtype=torch.uint8, count=total)
        self.order = StreamOrder(self.device, layout.num_layers)
        """The side stream of the copies into and out of this cache, and their markers."""
        self.slots = raw.view(num_blocks, layout.num_layers, layout.slot_bytes)
        """slots[block, layer]: one slot's bytes (K/V then trailer), on the cache's device."""
        elements = raw.view(layout.dtype)  # NOTE: slot_bytes is a multiple of the element size
        slot, token = layout.slot_bytes // _size(layout), layout.num_kv_heads * layout.head_dim
        self.kv = elements.as_strided(
            (num_blocks, *layout.block_shape),
            (layout.num_layers * slot, slot, layout.block_tokens * token, token, layout.head_dim, 1),
        )

    @property
    def host_addressable(self) -> bool:
        """Whether `slot` can hand out the cache's own memory (a CPU cache): the KV pool then
        reads and writes slots in place; otherwise it stages them (tsukimi/engine/kv_staging.py)."""
        return self.device.type == "cpu"

    def slot(self, block: int, layer: int) -> memoryview:
        """One (block, layer) slot, K/V then trailer: a writable view into a CPU cache.

        Raises:
            InvalidArgument: the cache is on a device (not host-addressable).
        """
        if not self.host_addressable:
            raise InvalidArgument(f"a KV cache on {self.device} has no host view of its slots: stage them")
        return memoryview(self.slots[block, layer].numpy())  # type: ignore[arg-type]

    def layer_bytes(self, block: int, layer: int) -> memoryview:
        """The K/V bytes of one layer of one block (the slot without its trailer)."""
        return self.slot(block, layer)[: self.layout.layer_bytes]

    def reserve(self, seq: SequenceKV, num_tokens: int) -> bool:
        """Make room in `seq` for `num_tokens` more tokens; False (and nothing taken) when
        the pool runs out (mutates)."""
        needed = -(-(seq.num_tokens + num_tokens) // self.layout.block_tokens) - len(seq.block_table)
        taken: list[int] = []
        for _ in range(max(0, needed)):
            block = self.pool.allocate()
            if block is None:
                self.pool.release(taken)
                return False
            taken.append(block)
        seq.block_table.extend(taken)
        return True


class BatchAttention:
    """The model's `attend` for one forward over several sequences: stores each layer's new
    K/V in the cache, then attends each sequence's new queries to all its keys (causal).

    `segments` lists, in token order, (sequence, number of new tokens); the new tokens of a
    sequence take positions seq.num_tokens onwards. `on_layer(layer)` runs once each layer's
    K/V are stored (the KV pool publishes that layer while the next ones compute). Call
    `commit()` after the forward.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        segments: Sequence[tuple[SequenceKV, int]],
        on_layer: Callable[[int], None] | None = None,
    ) -> None:
        self.cache, self.segments, self._on_layer = cache, list(segments), on_layer
        bt, device = cache.layout.block_tokens, cache.device
        blocks, offsets = [], []
        self._plans: list[tuple[int, int, torch.Tensor, int, torch.Tensor | None]] = []
        start = 0
        for seq, count in self.segments:
            positions = range(seq.num_tokens, seq.num_tokens + count)
            blocks += [seq.block_table[p // bt] for p in positions]
            offsets += [p % bt for p in positions]
            context = seq.num_tokens + count
            table = torch.tensor(seq.block_table[: -(-context // bt)], dtype=torch.long, device=device)
            mask = None
            if count > 1 and seq.num_tokens > 0:  # causal, aligned to the end of the context
                mask = end_aligned_causal(count, context)
            self._plans.append((start, count, table, context, mask))
            start += count
        self._blocks = torch.tensor(blocks, dtype=torch.long, device=device)
        self._offsets = torch.tensor(offsets, dtype=torch.long, device=device)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv = self.cache.kv
        kv[self._blocks, layer, 0, self._offsets] = k.to(kv.dtype)
        kv[self._blocks, layer, 1, self._offsets] = v.to(kv.dtype)
        if self._on_layer is not None:
            self._on_layer(layer)
        out = torch.empty_like(q)
        kv_heads, dim = k.shape[1], q.shape[2]
        for start, count, table, context, mask in self._plans:
            keys = kv[table, layer, 0].reshape(-1, kv_heads, dim)[:context]
            values = kv[table, layer, 1].reshape(-1, kv_heads, dim)[:context]
            query = q[start : start + count]
            causal = count > 1 and mask is None
            out[start : start + count] = attention(query, keys.to(q.dtype), values.to(q.dtype), mask, causal)
        return out

    def commit(self) -> None:
        """The forward ran: each sequence now has KV for its new tokens (mutates)."""
        for seq, count in self.segments:
            seq.num_tokens += count


def _size(layout: KVLayout) -> int:
    return torch.finfo(layout.dtype).bits // 8
