"""The inference engine's main loop: continuous batching over a paged KV cache.

`LLMEngine` owns the parts and their loop; each `step()` is schedule -> run -> postprocess:

    Scheduler.schedule()       which tokens of which requests this step computes: decodes, then
                               prompt chunks, within max_batched_tokens; admission reuses cached
                               prefixes, a full cache preempts (tsukimi/engine/scheduler.py)
    ModelRunner.run(batch)     one forward over them, publishing filled prompt blocks to the KV
                               pool; a token for each request whose tokens all have KV
                               (tsukimi/engine/model_runner.py)
    Scheduler.postprocess()    cache the filled blocks under their chained hashes, append the
                               tokens, finish the requests that stop

A request's prompt is matched block by block against the local prefix cache, then against the
KV pool through the optional `KVConnector` (prefill and decode roles); only the rest is
computed (tsukimi/engine/block_manager.py). With `layerwise_loading`, the pool's blocks are
read one layer at a time during the request's first step, overlapped with the forward
(tsukimi/engine/layer_loading.py); a block that fails to load late makes its request compute
again (`Scheduler.postprocess(recompute=...)`).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence

import torch

from tsukimi.engine.block_manager import BlockManager, KVConnector, weights_salt
from tsukimi.engine.kv_cache import KVLayout, PagedKVCache
from tsukimi.engine.layer_loading import LayerLoader, LayerwiseConnector
from tsukimi.engine.model_runner import Model, ModelRunner
from tsukimi.engine.request import EngineRequest, StepOutput
from tsukimi.engine.sampling import SamplingParams
from tsukimi.engine.scheduler import Scheduler
from tsukimi.errors import DuplicateRequest, InvalidArgument

# NOTE: KVConnector, Model and StepOutput are re-exported from their new homes for importers
__all__ = ["KVConnector", "LLMEngine", "Model", "StepOutput"]

logger = logging.getLogger(__name__)


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
        layerwise_loading: overlap loading the pool's blocks with the forward, layer by layer
            (when the connector can: a `LayerwiseConnector`); False: load them at admission.
            Off by default: on this CPU-only machine it measured no faster (docs/benchmarks.md).
        device: where the KV cache lives: the model's device (tsukimi/engine/device.py); the
            model's parameters must already be there.
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
        layerwise_loading: bool = False,
        device: torch.device | str = "cpu",
    ) -> None:
        if max_batched_tokens < 1:
            raise InvalidArgument("max_batched_tokens must be >= 1")
        self.model, self.eos_ids, self.connector = model, eos_ids, connector
        self.cache = PagedKVCache(layout, num_blocks, storage, device)
        self.max_batched_tokens = max_batched_tokens
        self.prefix_caching = prefix_caching
        self.loader = None
        if layerwise_loading and isinstance(connector, LayerwiseConnector):
            self.loader = LayerLoader(connector, self.cache)
        blocks = BlockManager(self.cache, connector, prefix_caching, self.loader)
        self.scheduler = Scheduler(blocks, max_batched_tokens, eos_ids)
        self.runner = ModelRunner(model, self.cache, connector, self.loader)

    def add_request(self, request_id: str, prompt: Sequence[int], params: SamplingParams) -> None:
        """Queue a request (mutates). Raises InvalidArgument for an empty prompt, a duplicate
        id, or a prompt that cannot fit in the cache."""
        if not prompt:
            raise InvalidArgument("the prompt must hold at least one token")
        if request_id in self.scheduler:
            raise DuplicateRequest(f"request {request_id!r} is already running")
        bt = self.cache.layout.block_tokens
        if -(-(len(prompt) + params.max_tokens) // bt) > self.cache.pool.num_blocks:
            raise InvalidArgument(f"prompt + max_tokens ({len(prompt)} + {params.max_tokens}) exceed the KV cache")
        seed = params.seed if params.seed is not None else zlib.crc32(request_id.encode())
        generator = torch.Generator().manual_seed(seed)
        self.scheduler.add(EngineRequest(request_id, list(prompt), params, generator))

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (mutates; unknown ids are ignored)."""
        self.scheduler.abort(request_id)

    def new_weights(self, weights_version: str) -> int:
        """The model's parameters were replaced by `weights_version` (a live weight update):
        forget every cached block and hash blocks under the new version's salt, so that no KV
        computed with other weights is reused here (mutates). The caller switches the KV pool's
        format itself (`StoreKVConnector.use_format`). Returns how many blocks were cached.

        Raises:
            InvalidArgument: requests are still in the engine (their KV mixes both weights).
        """
        if self.has_work():
            raise InvalidArgument(f"{len(self.scheduler)} requests are in the engine: drain it before new weights")
        self.scheduler.blocks.salt = weights_salt(weights_version)
        return self.cache.pool.drop_cached()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        """Run one iteration (mutates); the tokens it produced, per request. Raises OutOfSpace
        when requests wait, none runs, and the first cannot get its blocks."""
        batch = self.scheduler.schedule()
        tokens = self.runner.run(batch)
        return self.scheduler.postprocess(batch, tokens, recompute=self.runner.failed)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[int]]:
        """Run `prompts` to completion together; their output tokens, in order."""
        base = len(self.scheduler)
        names = [f"generate-{base}-{i}" for i in range(len(prompts))]
        for name, prompt in zip(names, prompts, strict=True):
            self.add_request(name, prompt, params)
        results: dict[str, list[int]] = {name: [] for name in names}
        while any(name in self.scheduler for name in names):
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id] += out.token_ids
        return [results[name] for name in names]
