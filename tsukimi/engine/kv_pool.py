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
64-byte trailer that names the format digest, the block hash and the layer. Both directions
are zero-copy on our side: the store writes from and reads into the slot itself; a slot whose
trailer or size does not match is refused (`KVFormatError`), and the block is not used::

    | payload: kv[k|v, token, kv head, head dim] of one layer of one block (KVLayout)              |
    | magic "TSKV" | version u32 | format digest 16 B | block hash u64 | payload u64 | layer u32 | pad |

Loading stops at the first block that the pool does not hold in full (lost, evicted or never
written): the engine computes the rest, so a lost block costs time, never correctness.
Loading comes in two shapes: `load` reads every layer of the blocks at once, before the step;
`probe` then `load_layer` (one batch per layer) let the forward start on layer 0 while later
layers still arrive (tsukimi/engine/layer_loading.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import struct
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass

from tsukimi.engine.block_manager import INITIAL_WEIGHTS
from tsukimi.engine.kv_cache import KVLayout, PagedKVCache
from tsukimi.errors import KVFormatError as KVFormatError
from tsukimi.errors import ObjectExists, TsukimiError
from tsukimi.scheduler.block_hash import BlockHash
from tsukimi.store.client import StoreClient
from tsukimi.store.replica_io import GetResult

logger = logging.getLogger(__name__)

_TRAILER = struct.Struct("<4sI16sQQI")
_MAGIC, _VERSION = b"TSKV", 3


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
        return hashlib.blake2b(json.dumps(asdict(self), sort_keys=True).encode(), digest_size=16).digest()

    @property
    def prefix(self) -> str:
        return f"kv/{self.digest.hex()}"

    def key(self, block_hash: BlockHash, layer: int) -> str:
        return f"{self.prefix}/{block_hash:016x}/{layer}"


class StoreKVConnector:
    """The engine's `KVConnector` over a `StoreClient`. `save_layer` may be called from the
    engine thread only; writes run on one background thread, in order."""

    def __init__(self, client: StoreClient, fmt: KVFormat, replicas: int = 1) -> None:
        self.client, self.format, self.replicas = client, fmt, replicas
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
        if not hashes:
            return 0
        layers = self.format.num_layers
        pairs = [(h, b, layer) for h, b in zip(hashes, blocks, strict=False) for layer in range(layers)]
        keys = [self.format.key(h, layer) for h, _, layer in pairs]
        slots = [cache.slot(b, layer) for _, b, layer in pairs]
        try:
            got = self.client.batch_get(keys, slots)
        except TsukimiError as exc:  # the pool is an optimisation: compute instead
            logger.warning("KV pool unavailable for a load (%s): computing instead", exc)
            return 0
        loaded = 0
        for n, block_hash in enumerate(hashes[: len(blocks)]):
            span = range(n * layers, (n + 1) * layers)
            if not all(  # missing, unreadable or refused: compute from here
                self._verified(got[i], slots[i], block_hash, layer, cache.layout) for layer, i in enumerate(span)
            ):
                break
            loaded += 1
        self.loaded_blocks += loaded
        return loaded

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
        slots = [cache.slot(b, layer) for b in blocks]
        got = self.client.batch_get([self.format.key(h, layer) for h in hashes], slots)
        return [self._verified(got[i], slots[i], h, layer, cache.layout) for i, h in enumerate(hashes)]

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
        items = []
        for block_hash, block in zip(hashes, blocks, strict=True):
            slot = cache.slot(block, layer)
            trailer = _TRAILER.pack(_MAGIC, _VERSION, self.format.digest, block_hash, cache.layout.layer_bytes, layer)
            slot[cache.layout.layer_bytes : cache.layout.layer_bytes + len(trailer)] = trailer
            items.append((self.format.key(block_hash, layer), slot))  # NOTE: sent from the cache itself
        if items:
            self._pending.append(self._writer.submit(self._put, items, layer == self.format.num_layers - 1))

    def flush(self) -> None:
        """Wait until every layer handed to `save_layer` is written (or failed, logged)."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

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
