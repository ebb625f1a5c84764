"""The inference engine's main loop: continuous batching over a paged KV cache.

Each `step()` schedules every decoding request (one token each), then prompt tokens of waiting
requests in arrival order up to `max_batched_tokens` (a long prompt is prefilled in chunks
over several steps), runs one forward over all of them, samples a token for every request
whose tokens all have KV, and caches every newly filled block under its chained hash.

A request's prompt is matched block by block against the local prefix cache, then against the
KV pool through the optional `KVConnector` (prefill and decode roles); only the rest is
computed. At least the last prompt token is always computed, since its logits give the first
output token.
"""

from __future__ import annotations

import logging
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tsukimi.engine.kv_cache import BatchAttention, KVLayout, PagedKVCache, SequenceKV
from tsukimi.engine.sampling import SamplingParams, sample, stop_reason
from tsukimi.errors import InvalidArgument, OutOfSpace
from tsukimi.scheduler.block_hash import BlockHash, hash_blocks

logger = logging.getLogger(__name__)


class Model(Protocol):
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attend: BatchAttention) -> torch.Tensor: ...
    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


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
class StepOutput:
    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # None while generating; "stop", "length" or "abort"
    cached_tokens: int = 0  # prompt tokens whose KV was reused (local cache or pool)
    pool_tokens: int = 0  # of those, loaded from the pool


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    seq: SequenceKV = field(default_factory=SequenceKV)
    output: list[int] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)  # of the full blocks whose KV is in the cache
    admitted: bool = False
    cached_tokens: int = 0
    pool_tokens: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class LLMEngine:
    """Runs requests on `model` (not thread-safe: one thread calls add_request / step).

    Args:
        model / eos_ids: the model and its end-of-sequence tokens.
        layout: the KV cache layout; num_blocks: its size in blocks.
        max_batched_tokens: tokens per forward at most (decodes first, then prompt chunks).
        connector: the KV pool, or None (colocated, local prefix cache only).
        storage: memory for the KV cache (e.g. registered shared memory), or None.
        prefix_caching: reuse KV of earlier requests (local cache and pool); False computes
            every prompt in full (the no-reuse baseline of `tsukimi bench serve`).
    """

    def __init__(
        self,
        model: Model,
        layout: KVLayout,
        num_blocks: int,
        eos_ids: tuple[int, ...] = (),
        max_batched_tokens: int = 512,
        connector: KVConnector | None = None,
        storage: memoryview | None = None,
        prefix_caching: bool = True,
    ) -> None:
        if max_batched_tokens < 1:
            raise InvalidArgument("max_batched_tokens must be >= 1")
        self.model, self.eos_ids, self.connector = model, eos_ids, connector
        self.cache = PagedKVCache(layout, num_blocks, storage)
        self.max_batched_tokens = max_batched_tokens
        self.prefix_caching = prefix_caching
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._ids: set[str] = set()

    def add_request(self, request_id: str, prompt: Sequence[int], params: SamplingParams) -> None:
        """Queue a request (mutates). Raises InvalidArgument for an empty prompt, a duplicate
        id, or a prompt that cannot fit in the cache."""
        if not prompt:
            raise InvalidArgument("the prompt must hold at least one token")
        if request_id in self._ids:
            raise InvalidArgument(f"request {request_id!r} is already running")
        bt = self.cache.layout.block_tokens
        if -(-(len(prompt) + params.max_tokens) // bt) > self.cache.pool.num_blocks:
            raise InvalidArgument(f"prompt + max_tokens ({len(prompt)} + {params.max_tokens}) exceed the KV cache")
        seed = params.seed if params.seed is not None else zlib.crc32(request_id.encode())
        generator = torch.Generator().manual_seed(seed)
        self._waiting.append(_Request(request_id, list(prompt), params, generator))
        self._ids.add(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (mutates; unknown ids are ignored)."""
        for queue in (self._waiting, self._running):
            for request in list(queue):
                if request.request_id == request_id:
                    queue.remove(request)
                    self._finish(request)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def step(self) -> list[StepOutput]:
        """Run one iteration (mutates); the tokens it produced, per request."""
        scheduled = self._schedule()
        if not scheduled and self._running:  # every running request waits for blocks: free some
            self._preempt(self._running[-1])
            scheduled = self._schedule()
        if not scheduled:
            if self.has_work():
                raise OutOfSpace("the KV cache cannot hold the next request")
            return []
        ids: list[int] = []
        positions: list[int] = []
        for request, count in scheduled:
            start = request.seq.num_tokens
            ids += request.tokens[start : start + count]
            positions += range(start, start + count)
        filled = [self._filling(request, count) for request, count in scheduled]
        publish = self._publishable(scheduled, filled)
        attend = BatchAttention(self.cache, [(r.seq, n) for r, n in scheduled], on_layer=publish)
        with torch.inference_mode():
            hidden = self.model.forward(torch.tensor(ids), torch.tensor(positions), attend)
            attend.commit()
            ready, last, offset = [], [], 0
            for request, count in scheduled:
                offset += count
                if request.seq.num_tokens == len(request.tokens):
                    ready.append(request)
                    last.append(offset - 1)
            logits = self.model.logits(hidden[last]) if ready else None
        for (request, _), blocks in zip(scheduled, filled, strict=True):
            self._cache_filled(request, blocks)
        if self.connector is not None:
            self.connector.flush()  # NOTE: published before the first token leaves this worker
        outputs = []
        for row, request in enumerate(ready):
            assert logits is not None
            token = sample(logits[row], request.params, request.generator)
            reason = stop_reason(token, len(request.output) + 1, request.params, self.eos_ids)
            emitted = () if reason == "stop" else (token,)
            request.output += emitted
            outputs.append(StepOutput(request.request_id, emitted, reason, request.cached_tokens, request.pool_tokens))
            if reason is not None:
                self._running.remove(request)
                self._finish(request)
        return outputs

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[int]]:
        """Run `prompts` to completion together; their output tokens, in order."""
        base = len(self._ids)
        names = [f"generate-{base}-{i}" for i in range(len(prompts))]
        for name, prompt in zip(names, prompts, strict=True):
            self.add_request(name, prompt, params)
        results: dict[str, list[int]] = {name: [] for name in names}
        while any(name in self._ids for name in names):
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id] += out.token_ids
        return [results[name] for name in names]

    # -- internals ----------------------------------------------------------------------

    def _schedule(self) -> list[tuple[_Request, int]]:
        budget = self.max_batched_tokens
        scheduled: list[tuple[_Request, int]] = []
        for request in list(self._running):  # decodes and unfinished prompt chunks, oldest first
            if request not in self._running:
                continue  # preempted below for an older request
            count = min(len(request.tokens) - request.seq.num_tokens, budget)
            if not count:
                continue
            while not self.cache.reserve(request.seq, count):
                victim = self._running[-1]
                if victim is request or any(victim is r for r, _ in scheduled):
                    count = 0
                    break
                self._preempt(victim)
            if count:
                scheduled.append((request, count))
                budget -= count
        while self._waiting and budget > 0:
            request = self._waiting[0]
            if not request.admitted:
                self._admit(request)
            count = min(len(request.tokens) - request.seq.num_tokens, budget)
            if not self.cache.reserve(request.seq, count):
                self._unadmit(request)  # NOTE: never hold blocks while waiting: a running one may need them
                break
            self._running.append(self._waiting.popleft())
            scheduled.append((request, count))
            budget -= count
        return scheduled

    def _admit(self, request: _Request) -> None:
        """Reuse the longest cached prefix: local blocks first, then the pool's."""
        bt = self.cache.layout.block_tokens
        hashes = hash_blocks(request.prompt, bt) if self.prefix_caching else []
        if hashes and len(hashes) * bt >= len(request.prompt):  # NOTE: the last prompt token must be computed
            hashes = hashes[:-1]
        local = self.cache.pool.lookup(hashes)
        request.seq.block_table, request.hashes = list(local), hashes[: len(local)]
        loaded = 0
        if self.connector is not None and len(local) < len(hashes):
            wanted = hashes[len(local) :]
            blocks = [b for b in (self.cache.pool.allocate() for _ in wanted) if b is not None]
            loaded = self.connector.load(wanted[: len(blocks)], blocks, self.cache)
            self.cache.pool.release(blocks[loaded:])
            for block, block_hash in zip(blocks[:loaded], wanted, strict=False):
                self.cache.pool.cache(block, block_hash)
            request.seq.block_table += blocks[:loaded]
            request.hashes += wanted[:loaded]
        request.seq.num_tokens = (len(local) + loaded) * bt
        request.cached_tokens, request.pool_tokens = request.seq.num_tokens, loaded * bt
        request.admitted = True

    def _publishable(
        self, scheduled: list[tuple[_Request, int]], filled: list[list[tuple[BlockHash, int]]]
    ) -> Callable[[int], None] | None:
        """The per-layer hook that publishes the prompt blocks this step fills (None: none)."""
        connector, bt = self.connector, self.cache.layout.block_tokens
        if connector is None:
            return None
        hashes, blocks = [], []
        for (request, _), pairs in zip(scheduled, filled, strict=True):
            prompt_blocks = len(request.prompt) // bt
            for n, (block_hash, block) in enumerate(pairs, start=len(request.hashes)):
                if n < prompt_blocks:
                    hashes.append(block_hash)
                    blocks.append(block)
        if not hashes:
            return None
        return lambda layer: connector.save_layer(layer, hashes, blocks, self.cache)

    def _filling(self, request: _Request, count: int) -> list[tuple[BlockHash, int]]:
        """(hash, block) of the blocks that this step's `count` tokens of `request` fill."""
        if not self.prefix_caching:
            return []
        bt = self.cache.layout.block_tokens
        known, full = len(request.hashes), (request.seq.num_tokens + count) // bt
        if full <= known:
            return []
        parent = request.hashes[-1] if request.hashes else None
        new = hash_blocks(request.tokens[known * bt : full * bt], bt, parent=parent)
        return list(zip(new, request.seq.block_table[known:full], strict=True))

    def _cache_filled(self, request: _Request, filled: list[tuple[BlockHash, int]]) -> None:
        for block_hash, block in filled:
            self.cache.pool.cache(block, block_hash)
        request.hashes += [block_hash for block_hash, _ in filled]

    def _preempt(self, request: _Request) -> None:
        """Out of blocks: give up `request`'s KV; it recomputes (prompt + output so far) later."""
        logger.debug("preempting %s: the KV cache is full", request.request_id)
        self._running.remove(request)
        self._unadmit(request)
        self._waiting.appendleft(request)

    def _unadmit(self, request: _Request) -> None:
        # NOTE: tail first, so that the idle LRU gives up a chain's tail before its head
        # (a head evicted first would leave the rest cached but unreachable).
        self.cache.pool.release(request.seq.block_table[::-1])
        request.seq, request.hashes, request.admitted = SequenceKV(), [], False

    def _finish(self, request: _Request) -> None:
        self.cache.pool.release(request.seq.block_table[::-1])  # tail first (see _unadmit)
        request.seq.block_table = []
        self._ids.discard(request.request_id)
