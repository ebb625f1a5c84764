"""The block bookkeeping of the engine's requests: which KV blocks each request holds, and
under which chained hashes (tsukimi/scheduler/block_hash.py) its full blocks are cached.

- Admission reuses the longest cached prefix of a prompt: the local block pool's blocks
  first, then blocks loaded from the KV pool through the `KVConnector`; at least the last
  prompt token is always left to compute, since its logits give the first output token.
- Reservation grows a request's block table for a step's tokens.
- A step fills blocks (`FilledBlock`): once the forward has computed them they are cached in
  the pool under their hashes, and the request's hash chain grows::

      tokens:    | block 0 | block 1 | block 2 | block 3 | ...
      hashes:      h0        h1                              <- request.hashes before the step
      this step:           [ ....... new tokens ..... ]
      filled:                        (h2, table[2])          <- full after the step: cached after it

- The hashes are keyed by a salt of the weights version (`weights_salt`; none for the weights
  as loaded): after a live weight update no block computed with the old weights matches.
- Release gives blocks back tail first, so that the pool's idle LRU recycles a chain's tail
  before its head (a head recycled first would leave the rest cached but unreachable).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tsukimi.engine.kv_cache import PagedKVCache, SequenceKV
from tsukimi.engine.layer_loading import LayerLoader
from tsukimi.engine.request import EngineRequest
from tsukimi.scheduler.block_hash import BlockHash, hash_blocks

logger = logging.getLogger(__name__)

INITIAL_WEIGHTS = "initial"
"""The weights version of a model as loaded (its identity already names the weights' source)."""


def weights_salt(weights_version: str) -> bytes:
    """The block hashes' salt for `weights_version`: none for the weights as loaded (pure)."""
    if weights_version == INITIAL_WEIGHTS:
        return b""
    return hashlib.blake2b(weights_version.encode(), digest_size=16).digest()


class KVConnector(Protocol):
    """Moves KV blocks between this engine's cache and the KV pool (tsukimi/engine/kv_pool.py)."""

    def load(self, hashes: Sequence[BlockHash], blocks: Sequence[int], cache: PagedKVCache) -> int:
        """Fill `blocks` with the pool's copies of the blocks `hashes` (in order); returns how
        many of the first ones it could load."""
        ...

    def save_layer(self, layer: int, hashes: Sequence[BlockHash], blocks: Sequence[int], cache: PagedKVCache) -> None:
        """Offer `layer` of these freshly computed full blocks to the pool (may return before it
        is written: the forward goes on with the next layer)."""
        ...

    def flush(self) -> None:
        """Wait until everything offered is written."""
        ...


@dataclass(frozen=True, slots=True)
class FilledBlock:
    """A block that a step fills: the chained hash of its tokens and its id in the cache."""

    block_hash: BlockHash
    block: int


class BlockManager:
    """The requests' blocks in `cache`'s pool (not thread-safe: the engine thread only).

    Args:
        cache: the KV cache whose block pool this manages.
        connector: the KV pool to load prefixes from, or None (local prefix cache only).
        prefix_caching: reuse and cache full blocks by hash; False: no reuse at all.
        loader: load the pool's blocks layer by layer during the step (layer_loading.py), or
            None: all of them at admission.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        connector: KVConnector | None,
        prefix_caching: bool,
        loader: LayerLoader | None = None,
    ) -> None:
        self.cache, self.connector, self.prefix_caching, self.loader = cache, connector, prefix_caching, loader
        self.block_tokens = cache.layout.block_tokens
        self.salt = b""  # NOTE: weights_salt of the weights version (LLMEngine.new_weights)

    def admit(self, request: EngineRequest) -> None:
        """Give `request` the longest cached prefix of its prompt, local blocks first, then the
        pool's; its KV then covers that prefix (mutates the request and the pool)."""
        bt = self.block_tokens
        hashes = hash_blocks(request.prompt, bt, self.salt) if self.prefix_caching else []
        if hashes and len(hashes) * bt >= len(request.prompt):  # NOTE: the last prompt token must be computed
            hashes = hashes[:-1]
        local = self.cache.pool.lookup(hashes)
        request.seq.block_table, request.hashes = list(local), hashes[: len(local)]
        loaded = 0
        if self.connector is not None and len(local) < len(hashes):
            loaded = self._load(request, hashes[len(local) :])
        request.seq.num_tokens = (len(local) + loaded) * bt
        request.cached_tokens, request.pool_tokens = request.seq.num_tokens, loaded * bt
        request.admitted = True

    def _load(self, request: EngineRequest, wanted: list[BlockHash]) -> int:
        """Load what the KV pool holds of `wanted` (the blocks after the local prefix) into
        fresh blocks appended to `request`'s table; returns how many it loaded."""
        assert self.connector is not None
        pool, loader = self.cache.pool, self.loader
        if loader is not None:  # NOTE: counted as KV now, read during the step (layer_loading.py)
            wanted = wanted[: loader.connector.probe(wanted)] if loader.use_pool(request) else []
        blocks = [b for b in (pool.allocate() for _ in wanted) if b is not None]
        if loader is not None:
            loaded = len(blocks)
            loader.add(request, wanted[:loaded], blocks)
        else:
            loaded = self.connector.load(wanted[: len(blocks)], blocks, self.cache)
            pool.release(blocks[loaded:])
            for block, block_hash in zip(blocks[:loaded], wanted, strict=False):
                pool.cache(block, block_hash)
        request.seq.block_table += blocks[:loaded]
        request.hashes += wanted[:loaded]
        return loaded

    def reserve(self, request: EngineRequest, num_tokens: int) -> bool:
        """Make room for `num_tokens` more tokens of `request`; False (nothing taken) when the
        pool runs out (mutates)."""
        return self.cache.reserve(request.seq, num_tokens)

    def filling(self, request: EngineRequest, num_tokens: int) -> tuple[FilledBlock, ...]:
        """The blocks that the next `num_tokens` tokens of `request` fill (pure; empty without
        prefix caching)."""
        if not self.prefix_caching:
            return ()
        bt = self.block_tokens
        known, full = len(request.hashes), (request.seq.num_tokens + num_tokens) // bt
        if full <= known:
            return ()
        parent = request.hashes[-1] if request.hashes else None
        new = hash_blocks(request.tokens[known * bt : full * bt], bt, self.salt, parent=parent)
        return tuple(map(FilledBlock, new, request.seq.block_table[known:full]))

    def num_prompt_blocks(self, request: EngineRequest, filled: Sequence[FilledBlock]) -> int:
        """How many of `filled` (a step's blocks of `request`, from `filling`) hold prompt tokens
        only: those go to the KV pool (pure)."""
        return max(0, min(len(filled), len(request.prompt) // self.block_tokens - len(request.hashes)))

    def cache_filled(self, request: EngineRequest, filled: Sequence[FilledBlock]) -> None:
        """The forward computed `filled`: cache them under their hashes (mutates)."""
        for fill in filled:
            self.cache.pool.cache(fill.block, fill.block_hash)
        request.hashes += [fill.block_hash for fill in filled]

    def unadmit(self, request: EngineRequest) -> None:
        """Give back all of `request`'s blocks and forget its KV: it recomputes (mutates)."""
        if self.loader is not None:
            self.loader.drop(request)
        self.cache.pool.release(request.seq.block_table[::-1])  # NOTE: tail first (see the module)
        request.seq, request.hashes, request.admitted = SequenceKV(), [], False

    def free(self, request: EngineRequest) -> None:
        """`request` ended: give back its blocks (mutates; cached ones stay reusable)."""
        self.cache.pool.release(request.seq.block_table[::-1])  # tail first (see the module)
        request.seq.block_table = []
