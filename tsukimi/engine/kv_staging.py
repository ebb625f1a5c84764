"""Slots of a KV cache that the host cannot address (a GPU's), moved through host staging in
few large copies: never one copy per block.

    publish  cache.slots[ids] --index_select--> one device buffer --ONE D2H--> staging rows --> store puts
    load     store gets --> staging rows --ONE H2D--> one device buffer --index_copy_--> cache.slots[ids]

A slot id is block x num_layers + layer (the cache's slots, flattened), so one gather or one
scatter covers any set of (block, layer) slots: a layer of a step's blocks, or every layer of a
prefix. The staging is page-locked on a GPU (`device.pinned`): a pinned copy runs ~3x a
pageable one, and one contiguous copy plus one scatter ran 16x one copy per 32 KiB block
(GPU.md). The copies run on the cache's side stream (`StreamOrder`), ordered by markers.
On the CPU the same code runs (the KV pool's `staged=True`), so CI tests the gather/scatter
and the staging bookkeeping; there each copy is plain memory and done when it returns.

The store reads and writes the staging rows like any host buffer (its puts and gets take any
buffer: no registration with the transfer engine is needed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from tsukimi.engine.device import pinned
from tsukimi.engine.kv_cache import PagedKVCache
from tsukimi.engine.stream_order import Marker


@runtime_checkable
class StagedPublisher(Protocol):
    """A KV connector that publishes through host staging rows (tsukimi/engine/kv_pool.py):
    told the step's published blocks before the forward, it allocates their rows then."""

    def reserve_publish(self, num_blocks: int, cache: PagedKVCache) -> None:
        """Room for every layer of `num_blocks` blocks of `cache` in the publish rows."""
        ...


class HostArena:
    """Host rows of `row_bytes` handed out until `reset()`, allocated to the need, never by
    doubling. `reserve` makes room for a known number of rows at once, before their copies (a
    step's blocks x layers); `take` past the room grows by a chunk of exactly what it asks (rows
    handed out stay valid: a chunk lives while any of its views does). Not thread-safe.

    NOTE: on a GPU every chunk is a cudaHostAlloc through torch's host caching allocator (slow,
    rounded up, never given back to the OS): doubling pinned ~2x the need in six allocations in
    the middle of a 16k prefill's forward, where one exact one before it does.
    """

    def __init__(self, row_bytes: int, device: torch.device) -> None:
        self.row_bytes, self.device = row_bytes, device
        self._chunks: list[torch.Tensor] = []
        self._used = 0  # rows used of the last chunk
        self._round = 0  # rows handed out since the last reset

    def reserve(self, num_rows: int) -> None:
        """Room for `num_rows` more rows in one chunk, allocated now when the arena lacks it
        (mutates; a no-op when it has it)."""
        room = self._chunks[-1].shape[0] - self._used if self._chunks else 0
        if room >= num_rows:
            return
        if self._round == 0:  # NOTE: nothing handed out since the reset: the old rows are free
            self._chunks = []
        self._chunks.append(pinned(num_rows * self.row_bytes, self.device).view(num_rows, self.row_bytes))
        self._used = 0

    def take(self, num_rows: int) -> torch.Tensor:
        """`num_rows` fresh rows, uint8 [num_rows, row_bytes] (mutates)."""
        self.reserve(num_rows)
        self._used += num_rows
        self._round += num_rows
        return self._chunks[-1][self._used - num_rows : self._used]

    def reset(self) -> None:
        """Every row handed out is free again (the caller waited for their copies; mutates).
        Several chunks become one as large as the round's rows (or the largest chunk), so that
        the next round of that size needs none."""
        if len(self._chunks) > 1:
            rows = max(self._round, max(chunk.shape[0] for chunk in self._chunks))
            self._chunks = [pinned(rows * self.row_bytes, self.device).view(rows, self.row_bytes)]
        self._used = self._round = 0


class SlotStaging:
    """Gathers and scatters slots of `cache` between its device and host rows (see the module)."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self._flat = cache.slots.view(-1, cache.layout.slot_bytes)  # slot id = block x num_layers + layer

    def slot_ids(self, blocks: Sequence[int], layers: Sequence[int]) -> list[int]:
        """The slot ids of `layers` of each of `blocks`, block-major (pure)."""
        num_layers = self.cache.layout.num_layers
        return [block * num_layers + layer for block in blocks for layer in layers]

    def gather(self, slot_ids: Sequence[int], rows: torch.Tensor, after: Marker = None) -> Marker:
        """Copy the slots `slot_ids` into host `rows` ([len(slot_ids), slot_bytes]): one
        index_select and ONE device-to-host copy on the side stream, once `after` is reached.
        Returns the marker after which `rows` hold them (wait on it before reading them)."""
        order = self.cache.order
        with order.side():
            index = self._index(slot_ids)  # NOTE: before the wait: queued now, the host never blocks on layer l
            order.side_waits(after)
            rows.copy_(self._flat.index_select(0, index), non_blocking=True)
            return order.mark_side()

    def scatter(self, slot_ids: Sequence[int], rows: torch.Tensor) -> Marker:
        """Copy host `rows` into the slots `slot_ids`: ONE host-to-device copy and one
        index_copy_ on the side stream. Returns the marker after which the slots hold them and
        `rows` may be reused."""
        order = self.cache.order
        with order.side():
            index = self._index(slot_ids)
            self._flat.index_copy_(0, index, rows.to(self.cache.device, non_blocking=True))
            return order.mark_side()

    def _index(self, slot_ids: Sequence[int]) -> torch.Tensor:
        """`slot_ids` as an int64 index on the cache's device, copied on the current stream.
        On a GPU from pinned host memory without blocking: a pageable `torch.tensor(...,
        device=cuda)` synchronizes the stream, which on the side stream means waiting for
        every marker it was told to wait for (torch's host allocator keeps the pinned source
        alive until the copy ran). On the CPU: the list as a tensor."""
        on_gpu = self.cache.device.type == "cuda"
        index = torch.tensor(slot_ids, dtype=torch.long, pin_memory=on_gpu)
        return index.to(self.cache.device, non_blocking=on_gpu)
