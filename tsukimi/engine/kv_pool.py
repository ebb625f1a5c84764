"""KV blocks in the store (the KV pool): how a prefill instance publishes the blocks it
computes and how any instance loads a prefix that is already there.

One store object per (full block, layer), keyed by the block's chained hash and the layer under
a prefix that digests the KV format (model identity, weights version, dtype, layer count, KV
heads, head size, block size), so instances of different models or layouts never read each
other's blocks, nor an instance whose weights were updated live (tsukimi/serving/worker/weight_update.py)
the blocks computed with its old weights: `StoreKVConnector.use_format` moves it to the new
prefix, and the old one's objects, unreachable from then on, age out of the pool by eviction
(they stay readable for workers still on the old weights during a rolling update).
Publishing is layer by layer: as soon as the forward has stored layer l's K/V, a background
thread writes layer l of the blocks that this step fills, while the next layers compute;
`flush()` waits for them at the end of the step, before any block can be released.

An object is exactly one KV cache slot (tsukimi/engine/kv_cache.py): the layer's K/V, then a
64-byte trailer that names the format digest, the block hash and the layer. With a cache in
host memory both directions are zero-copy on our side: the store writes from and reads into
the slot itself. With a cache on a GPU (or `staged=True`, which CI uses on the CPU) the slots
move through host staging rows, one gather + one copy per layer and step to publish, one copy
+ one scatter per load batch (tsukimi/engine/kv_staging.py); the pool's objects are the same
bytes either way. A slot whose trailer or size does not match is refused (`KVFormatError`),
and the block is not used::

    | payload: kv[k|v, token, kv head, head dim] of one layer of one block (KVLayout)              |
    | magic "TSKV" | version u32 | format digest 16 B | block hash u64 | payload u64 | layer u32 | pad |

Loading stops at the first block that the pool does not hold in full (lost, evicted or never
written): the engine computes the rest, so a lost block costs time, never correctness.
Loading comes in two shapes: `load` reads every layer of the blocks before the step, in order,
in store batches sized to the link (a batch must end within its read lease: one batch for a long
prefix over a slow link would lose all of it; `_read_groups`);
`probe` then `load_layer` (one batch per layer) let the forward start on layer 0 while later
layers still arrive (tsukimi/engine/layer_loading.py).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import struct
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch

from tsukimi.clock import Clock, WallClock
from tsukimi.engine.block_manager import INITIAL_WEIGHTS
from tsukimi.engine.kv_cache import KVLayout, PagedKVCache
from tsukimi.engine.kv_staging import HostArena, SlotStaging
from tsukimi.engine.stream_order import Marker, StreamOrder
from tsukimi.errors import KVFormatError as KVFormatError
from tsukimi.errors import ObjectExists, TsukimiError
from tsukimi.scheduler.block_hash import BlockHash
from tsukimi.store.client import StoreClient
from tsukimi.store.replica_io import GetResult

logger = logging.getLogger(__name__)

_TRAILER = struct.Struct("<4sI16sQQI")
_MAGIC, _VERSION = b"TSKV", 3
FIRST_GROUP_BYTES = 4 << 20  # a load's first store batch; the next ones sized by its rate
GROUP_S = 1.0  # NOTE: a group's target duration: a quarter of the default read lease's share


@dataclass(frozen=True, slots=True)
class KVFormat:
    model_identity: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    weights_version: str = INITIAL_WEIGHTS  # NOTE: a live weight update changes it (and the digest)

    @classmethod
    def of(cls, model_identity: str, layout: KVLayout, weights_version: str = INITIAL_WEIGHTS) -> KVFormat:
        return cls(
            model_identity,
            str(layout.dtype).removeprefix("torch."),
            layout.num_layers,
            layout.num_kv_heads,
            layout.head_dim,
            layout.block_tokens,
            weights_version,
        )

    @property
    def digest(self) -> bytes:
        return _format_digest(self)

    @property
    def prefix(self) -> str:
        return f"kv/{self.digest.hex()}"

    def key(self, block_hash: BlockHash, layer: int) -> str:
        return f"{self.prefix}/{block_hash:016x}/{layer}"


@functools.lru_cache(maxsize=64)
def _format_digest(fmt: KVFormat) -> bytes:
    # NOTE: cached: every pool key needs it (a block's every layer, on each save and load), and
    # asdict + json + blake2b take ~30 us a call against ~2 us for a key with it cached
    return hashlib.blake2b(json.dumps(asdict(fmt), sort_keys=True).encode(), digest_size=16).digest()


@dataclass(slots=True)
class _Staging:
    """The staging of one cache: its slot mover, the publish rows of the step in flight
    (`flush` frees them) and two alternating load buffers, each with the marker of its last
    copy into the cache (layer l's batch reuses buffer l % 2 once that copy is done)."""

    cache: PagedKVCache
    slots: SlotStaging
    publish: HostArena
    loads: tuple[HostArena, HostArena]
    load_marks: list[Marker]

    @classmethod
    def of(cls, cache: PagedKVCache) -> _Staging:
        row, device = cache.layout.slot_bytes, cache.device
        return cls(
            cache,
            SlotStaging(cache),
            HostArena(row, device),
            (HostArena(row, device), HostArena(row, device)),
            [None, None],
        )


def _views(rows: torch.Tensor) -> list[memoryview]:
    """One writable memoryview per host row (what the store reads from and writes into)."""
    return [memoryview(row.numpy()) for row in rows]


class StoreKVConnector:
    """The engine's `KVConnector` over a `StoreClient`. `save_layer` may be called from the
    engine thread only; writes run on one background thread, in order.

    staged: move slots through host staging even when the cache is host-addressable (CI's way
        to run the GPU path's gather/scatter on the CPU); a cache on a device always stages.
    """

    def __init__(
        self, client: StoreClient, fmt: KVFormat, replicas: int = 1, staged: bool = False, clock: Clock | None = None
    ) -> None:
        self.client, self.format, self.replicas, self.staged = client, fmt, replicas, staged
        self._clock = clock or WallClock()
        self._staging: _Staging | None = None
        self.loaded_blocks = self.saved_blocks = self.refused_blocks = 0
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tsukimi-kv-publish")
        self._pending: list[Future[None]] = []
        self._describe(fmt)

    def use_format(self, fmt: KVFormat) -> None:
        """Load and publish under `fmt` from now on (after a live weight update; mutates). Waits
        for the blocks offered under the old format first. Engine thread only."""
        self.flush()
        self.format = fmt
        try:
            self._describe(fmt)
        except TsukimiError as exc:  # NOTE: only a description for readers: the blocks work without it
            logger.warning("could not describe KV format %s in the pool: %s", fmt.prefix, exc)

    def _describe(self, fmt: KVFormat) -> None:
        described = json.dumps(asdict(fmt), sort_keys=True).encode()
        with contextlib.suppress(ObjectExists):  # NOTE: for readers of the pool: what the digest stands for
            self.client.put(f"{fmt.prefix}/format", described, pin="soft")

    def load(self, hashes: Sequence[BlockHash], blocks: Sequence[int], cache: PagedKVCache) -> int:
        """Read every layer of the blocks `hashes` into `blocks`, in order, in groups (see
        `_read_groups`); how many leading blocks arrived whole and in this format."""
        if not hashes:
            return 0
        layers = self.format.num_layers
        pairs = [(h, b, layer) for h, b in zip(hashes, blocks, strict=False) for layer in range(layers)]
        keys = [self.format.key(h, layer) for h, _, layer in pairs]
        staging = self._staging_for(cache)
        rows = (
            staging.publish.take(len(pairs)) if staging is not None else None
        )  # NOTE: between steps: no publish in flight
        slots = _views(rows) if rows is not None else [cache.slot(b, layer) for _, b, layer in pairs]
        usable = 0  # leading (block, layer) objects that arrived whole and in this format
        for start, got in self._read_groups(keys, slots, cache.layout.slot_bytes):
            for i, result in enumerate(got, start):
                if not self._verified(result, slots[i], hashes[i // layers], i % layers, cache.layout):
                    break  # missing, unreadable or refused: compute from here
                usable = i + 1
            if usable < start + len(got):
                break
        loaded = usable // layers
        if staging is not None and rows is not None:  # NOTE: the verified blocks only: one copy, one scatter
            # NOTE: after the last forward, which may still read blocks freed since (a step that sampled nothing)
            cache.order.side_waits(cache.order.mark_current())
            done = staging.slots.scatter(
                staging.slots.slot_ids(blocks[:loaded], range(layers)), rows[: loaded * layers]
            )
            cache.order.host_waits(done)
            staging.publish.reset()
        self.loaded_blocks += loaded
        return loaded

    def _read_groups(
        self, keys: Sequence[str], slots: Sequence[memoryview], object_bytes: int
    ) -> Iterator[tuple[int, list[GetResult]]]:
        """Read `keys` into `slots` in order, one store batch per group: (index of the group's
        first key, its results). The first group is about FIRST_GROUP_BYTES; each next one is
        sized to take about GROUP_S at the rate the last one ran. Stops after a batch the
        store refused as a whole (the pool is an optimisation: the engine computes the rest).

        NOTE: a batch's reads must end within the read lease the master granted for it (0.8 x
        `master.lease_ttl_s`, tsukimi/store/replica_io.py); one batch for a long prefix over a
        slow link shares the link among every object, so none ends in time and the whole load
        is lost. In groups, each with its own lease, the prefix arrives in order and a slow
        link costs only time; on a fast link the first group's rate makes the rest one batch.
        """
        start, budget = 0, FIRST_GROUP_BYTES
        while start < len(keys):
            count = max(1, min(len(keys) - start, budget // max(1, object_bytes)))
            began = self._clock.now()
            try:
                got = self.client.batch_get(keys[start : start + count], slots[start : start + count])
            except TsukimiError as exc:
                logger.warning("KV pool unavailable for a load (%s): computing instead", exc)
                return
            yield start, got
            elapsed = max(self._clock.now() - began, 1e-6)
            budget = int(count * object_bytes / elapsed * GROUP_S)
            start += count

    def reserve_publish(self, num_blocks: int, cache: PagedKVCache) -> None:
        """Allocate now the staging rows of every layer of `num_blocks` blocks that the next
        step publishes (engine thread, before its forward; a no-op without staging or when
        the rows are there: `HostArena.reserve`)."""
        staging = self._staging_for(cache)
        if staging is not None:
            staging.publish.reserve(num_blocks * self.format.num_layers)

    def probe(self, hashes: Sequence[BlockHash]) -> int:
        """How many of the first `hashes` the pool holds in full, every layer (one master round
        trip; reads nothing, grants no lease; 0 when the pool cannot answer)."""
        layers = self.format.num_layers
        try:
            present = self.client.batch_exists([self.format.key(h, layer) for h in hashes for layer in range(layers)])
        except TsukimiError as exc:  # the pool is an optimisation: compute instead
            logger.warning("KV pool unavailable for a probe (%s): computing instead", exc)
            return 0
        for n in range(len(hashes)):
            if not all(present[n * layers : (n + 1) * layers]):
                return n
        return len(hashes)

    def load_layer(
        self, layer: int, hashes: Sequence[BlockHash], blocks: Sequence[int], cache: PagedKVCache
    ) -> list[bool]:
        """Read `layer` of the blocks `hashes` into `blocks` (one batch; tsukimi/engine/
        layer_loading.py); per block, whether it arrived whole and in this format. Raises the
        store's errors for the whole batch (RpcTimeout, MasterUnavailable, ...)."""
        staging = self._staging_for(cache)
        if staging is None:
            slots = [cache.slot(b, layer) for b in blocks]
            got = self.client.batch_get([self.format.key(h, layer) for h in hashes], slots)
            return [self._verified(got[i], slots[i], h, layer, cache.layout) for i, h in enumerate(hashes)]
        arena = staging.loads[layer % 2]  # NOTE: the loader's one thread: layer l-1's copy may still run
        cache.order.host_waits(staging.load_marks[layer % 2])
        arena.reset()
        rows = arena.take(len(blocks))
        views = _views(rows)
        got = self.client.batch_get([self.format.key(h, layer) for h in hashes], views)
        arrived = [self._verified(got[i], views[i], h, layer, cache.layout) for i, h in enumerate(hashes)]
        # NOTE: every row, as the zero-copy path reads every block in place: a block that failed
        # makes its request recompute (layer_loading.py), so its bytes are never used
        done = staging.slots.scatter(staging.slots.slot_ids(blocks, (layer,)), rows)
        staging.load_marks[layer % 2] = done
        cache.order.loaded(layer, done)
        return arrived

    def _staging_for(self, cache: PagedKVCache) -> _Staging | None:
        """The staging of `cache`, or None when slots move in place (a host cache, not `staged`)."""
        if cache.host_addressable and not self.staged:
            return None
        if self._staging is None or self._staging.cache is not cache:  # NOTE: a fresh engine, a fresh cache
            self._staging = _Staging.of(cache)
        return self._staging

    def _verified(self, got: GetResult, slot: memoryview, block_hash: BlockHash, layer: int, layout: KVLayout) -> bool:
        """Whether one (block, layer) object read into `slot` may be used (a refusal is logged)."""
        if got.size != layout.slot_bytes:
            if got.found:
                self._refuse(KVFormatError(f"KV block {block_hash:016x}: an object of the wrong size"))
            return False
        try:
            self._check(slot, block_hash, layer, layout.layer_bytes)
        except KVFormatError as exc:
            self._refuse(exc)
            return False
        return True

    def _refuse(self, error: KVFormatError) -> None:
        """A block written in another format (or damaged): never used; this request computes it."""
        self.refused_blocks += 1
        logger.error("refusing a KV block from the pool: %s", error)

    def save_layer(self, layer: int, hashes: Sequence[BlockHash], blocks: Sequence[int], cache: PagedKVCache) -> None:
        """Publish `layer` of these freshly computed blocks, in the background (see `flush`)."""
        if not blocks:
            return
        layer_bytes, last = cache.layout.layer_bytes, layer == self.format.num_layers - 1
        trailers = [
            _TRAILER.pack(_MAGIC, _VERSION, self.format.digest, block_hash, layer_bytes, layer) for block_hash in hashes
        ]
        keys = [self.format.key(block_hash, layer) for block_hash in hashes]
        staging = self._staging_for(cache)
        if staging is None:
            slots = [cache.slot(block, layer) for block in blocks]  # NOTE: sent from the cache itself
            for slot, trailer in zip(slots, trailers, strict=True):
                slot[layer_bytes : layer_bytes + len(trailer)] = trailer
            self._pending.append(self._writer.submit(self._put, list(zip(keys, slots, strict=True)), last))
            return
        if not self._pending:  # NOTE: the step's first layer: the rows of the rest, in one allocation
            staging.publish.reserve(len(blocks) * (self.format.num_layers - layer))
        # NOTE: after the forward stored this layer (a marker on its stream), on the side stream:
        # one gather and one copy into rows that stay the step's until `flush`
        rows = staging.publish.take(len(blocks))
        ready = staging.slots.gather(staging.slots.slot_ids(blocks, (layer,)), rows, cache.order.mark_current())
        views = _views(rows)
        self._pending.append(
            self._writer.submit(
                self._put_staged, list(zip(keys, views, strict=True)), last, ready, trailers, layer_bytes
            )
        )

    def _put_staged(
        self,
        items: list[tuple[str, memoryview]],
        last_layer: bool,
        ready: Marker,
        trailers: list[bytes],
        layer_bytes: int,
    ) -> None:
        """`_put` of staged rows, once their copy from the device is done (the writer thread)."""
        StreamOrder.host_waits(ready)
        for (_, row), trailer in zip(items, trailers, strict=True):
            row[layer_bytes : layer_bytes + len(trailer)] = trailer
        self._put(items, last_layer)

    def flush(self) -> None:
        """Wait until every layer handed to `save_layer` is written (or failed, logged); the
        staging rows of those layers are free again (mutates)."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()
        if pending and self._staging is not None:
            self._staging.publish.reset()

    def close(self) -> None:
        self.flush()
        self._writer.shutdown(wait=True)

    def _put(self, items: list[tuple[str, memoryview]], last_layer: bool) -> None:
        try:
            errors = self.client.batch_put(items, replicas=self.replicas)
        except TsukimiError as exc:  # the pool is best effort: the prefill itself succeeded
            logger.warning("could not publish %d KV objects: %s", len(items), exc)
            return
        for (key, _), error in zip(items, errors, strict=True):
            if error is None:
                self.saved_blocks += last_layer
            elif not isinstance(error, ObjectExists):  # another instance published it first: fine
                logger.warning("could not publish KV object %s: %s", key, error)

    def _check(self, slot: memoryview, block_hash: BlockHash, layer: int, payload: int) -> None:
        magic, version, digest, found_hash, found_payload, found_layer = _TRAILER.unpack_from(slot, payload)
        if magic != _MAGIC or version != _VERSION or digest != self.format.digest:
            raise KVFormatError(f"KV block {block_hash:016x} was written in another format: refusing it")
        if (found_hash, found_layer, found_payload) != (block_hash, layer, payload):
            named = f"{found_hash:016x}/{found_layer}"
            raise KVFormatError(f"KV block {block_hash:016x} layer {layer}: its trailer names {named}")
