"""Layer-wise loading of pooled KV, overlapped with the forward that reads it.

Without it, admission loads every layer of a request's pooled prefix before the step's
forward starts (`KVConnector.load`). With it, admission only asks the pool which blocks it
holds in full (`LayerwiseConnector.probe`, one master round trip) and counts them as the
request's KV; the step then issues one load batch per layer, all at once and in layer
order, on a background thread, and the forward waits for layer l's batch only just before
layer l's attention reads the cache::

    loads:    [ layer 0 ][ layer 1 ][ layer 2 ] ... [ layer L-1 ]
    forward:        [ 0 ]      [ 1 ]      [ 2 ] ...        [ L-1 ] -> logits
                    ^ waits for layer 0's batch only

Loaded blocks enter the local prefix cache only at the end of the step, once every layer
arrived and was verified, so no other request can share a block that is still arriving.

Failures: a block the probe saw may still fail to load (evicted since, a holder gone, a
trailer that names another format). Such a late failure, found at layer l, is handled by
finishing the step, then recomputing: the request's forward goes on (its attention from
layer l on read wrong KV, which touches no other request's rows), but from layer l on none
of its new blocks is published to the pool, it samples no token, caches none of the blocks
the step filled, and is preempted (`Scheduler.postprocess(recompute=...)`): it goes back to
the front of the waiting queue, gives up every block, and on its next admission computes
its whole prefix past the local cache instead of loading it again (so a block the pool keeps
refusing cannot loop). The batches of later layers skip the failed request's blocks.

On a GPU the batch of layer l ends with its host-to-device copy and scatter queued on the
cache's side stream, all of them after the forward queued before the step (a marker taken when
its loads start); waiting for layer l is then the forward's stream waiting for that copy's
event (`StreamOrder`), and the loading thread goes on to layer l + 1's reads meanwhile. The
order above is the same code on both devices; on the CPU the copies are done when they return.

Every wait is bounded (`LOAD_TIMEOUT_S`): a layer that has not arrived by then fails its
requests; a load still running at the end of the step, which could still write into blocks
about to be reused, raises `TransferError` rather than risk it (the store's own calls are
bounded well below it, so it means a bug).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from tsukimi.engine.kv_cache import PagedKVCache
from tsukimi.engine.request import EngineRequest
from tsukimi.errors import TransferError, TsukimiError
from tsukimi.scheduler.block_hash import BlockHash

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 60.0
"""How long a step waits for its loads, all layers together (far above the store's own timeouts)."""


@runtime_checkable
class LayerwiseConnector(Protocol):
    """A KV pool that can load one layer at a time (tsukimi/engine/kv_pool.py)."""

    loaded_blocks: int

    def probe(self, hashes: Sequence[BlockHash]) -> int:
        """How many of the first `hashes` the pool holds in full, every layer (0 when it cannot
        tell). Reads nothing into the cache."""
        ...

    def load_layer(
        self, layer: int, hashes: Sequence[BlockHash], blocks: Sequence[int], cache: PagedKVCache
    ) -> list[bool]:
        """Read `layer` of the blocks `hashes` into `blocks`; per block, whether it arrived and
        was verified. May run on another thread than the engine's."""
        ...


@dataclass(frozen=True, slots=True)
class PendingLoad:
    """A request's pooled blocks, counted as its KV at admission, not yet read."""

    request: EngineRequest
    hashes: tuple[BlockHash, ...]
    blocks: tuple[int, ...]


class LayerLoader:
    """The pending loads of the requests admitted for the next step, and their start. Engine
    thread only (the loads themselves run on its one background thread)."""

    def __init__(self, connector: LayerwiseConnector, cache: PagedKVCache) -> None:
        self.connector, self.cache = connector, cache
        self._pending: list[PendingLoad] = []
        self._no_pool: set[str] = set()  # request ids that recompute after a late failure
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tsukimi-kv-load")

    def use_pool(self, request: EngineRequest) -> bool:
        """Whether `request` may load from the pool at this admission: not right after a late
        failure (mutates: the exclusion holds for one admission)."""
        if request.request_id in self._no_pool:
            self._no_pool.discard(request.request_id)
            return False
        return True

    def add(self, request: EngineRequest, hashes: Sequence[BlockHash], blocks: Sequence[int]) -> None:
        """Load `blocks` of `request` (admitted) in its first step (mutates)."""
        self._pending.append(PendingLoad(request, tuple(hashes), tuple(blocks)))

    def drop(self, request: EngineRequest) -> None:
        """`request` gave its blocks back before its step ran: load nothing for it (mutates)."""
        self._pending = [load for load in self._pending if load.request is not request]

    def start(self) -> LayerLoads | None:
        """Issue every pending load, one batch per layer in layer order (mutates: the pending
        loads are handed over). None when nothing is pending."""
        if not self._pending:
            return None
        pending, self._pending = self._pending, []
        return LayerLoads(self, pending)

    def recompute_later(self, request: EngineRequest) -> None:
        """`request`'s next admission computes its prefix instead of loading it (mutates)."""
        self._no_pool.add(request.request_id)

    def close(self) -> None:
        self.executor.shutdown(wait=True)


class LayerLoads:
    """One step's loads in flight: `wait(layer)` before layer `layer` reads the cache,
    `finish()` after the forward. `layer_done_s[l]` is when layer l's batch ended
    (time.perf_counter; None until then)."""

    def __init__(self, loader: LayerLoader, pending: list[PendingLoad]) -> None:
        self._loader, self._pending = loader, pending
        self._lock = threading.Lock()
        self._failed: set[EngineRequest] = set()
        num_layers = loader.cache.layout.num_layers
        self.layer_done_s: list[float | None] = [None] * num_layers
        # NOTE: the previous step's forward, still queued on a GPU when it sampled nothing (no
        # host sync), may read blocks freed since and handed to these loads: their copies wait for it
        self._after_forward = loader.cache.order.mark_current()
        self._deadline = time.monotonic() + LOAD_TIMEOUT_S
        self._futures: list[Future[None]] = [loader.executor.submit(self._load, layer) for layer in range(num_layers)]

    @property
    def failed(self) -> frozenset[EngineRequest]:
        """The requests with a block that failed to load so far."""
        with self._lock:
            return frozenset(self._failed)

    def _load(self, layer: int) -> None:
        if layer == 0:  # NOTE: the loader's first batch: every later side-stream copy follows it
            self._loader.cache.order.side_waits(self._after_forward)
        with self._lock:
            live = [load for load in self._pending if load.request not in self._failed]
        hashes = [h for load in live for h in load.hashes]
        blocks = [b for load in live for b in load.blocks]
        try:
            arrived = self._loader.connector.load_layer(layer, hashes, blocks, self._loader.cache) if blocks else []
        except TsukimiError as exc:  # NOTE: the pool is an optimisation: these requests recompute
            logger.warning("KV pool unavailable while loading layer %d (%s): recomputing", layer, exc)
            arrived = [False] * len(blocks)
        failed, offset = [], 0
        for load in live:
            if not all(arrived[offset : offset + len(load.blocks)]):
                failed.append(load.request)
            offset += len(load.blocks)
        with self._lock:
            self._failed.update(failed)
        self.layer_done_s[layer] = time.perf_counter()

    def wait(self, layer: int) -> None:
        """Block until layer `layer`'s batch ended, at most until the step's deadline (a layer
        that misses it fails all of this step's loads); then order the forward's later work
        after its copies into the cache (on a GPU: its stream waits for their event, the host
        does not; tsukimi/engine/stream_order.py)."""
        try:
            self._futures[layer].result(timeout=max(0.0, self._deadline - time.monotonic()))
            self._loader.cache.order.wait_loaded(layer)
        except FutureTimeout:
            logger.error("layer %d of the KV pool loads missed the deadline: recomputing", layer)
            with self._lock:
                self._failed.update(load.request for load in self._pending)

    def finish(self) -> frozenset[EngineRequest]:
        """After the forward (or its failure): wait for every batch, cache the loaded blocks of
        the requests whose loads all succeeded, mark the others to recompute (mutates the
        local block pool and the loader). Returns the failed requests.

        Raises:
            TransferError: a batch still runs past the deadline (see the module).
        """
        for layer in range(len(self._futures)):
            self.wait(layer)
        if not all(future.done() for future in self._futures):
            raise TransferError(f"KV pool loads still running {LOAD_TIMEOUT_S:.0f} s after they started")
        failed = self.failed
        pool = self._loader.cache.pool
        for load in self._pending:
            if load.request in failed:
                self._loader.recompute_later(load.request)
                continue
            for block, block_hash in zip(load.blocks, load.hashes, strict=True):
                pool.cache(block, block_hash)
            self._loader.connector.loaded_blocks += len(load.blocks)
        if failed:
            logger.warning("%d requests had a KV block fail to load late: recomputing them", len(failed))
        return failed
