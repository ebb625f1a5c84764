"""The forward of one engine step: a `ScheduledBatch` in, one sampled token per request out.

One forward runs over every scheduled request's new tokens at once (`BatchAttention` over the
paged KV cache). As soon as a layer's K/V are stored, that layer of the full prompt blocks the
step fills is offered to the KV pool (`KVConnector.save_layer`) while the next layers compute;
all of it is written (`flush`) before any token of the step leaves. Only requests whose tokens
all have KV after the step get logits and a sampled token. With a `LayerLoader`, the pooled
blocks admitted for this step are read one layer at a time while the forward runs, each layer
waited for just before its attention (tsukimi/engine/layer_loading.py); a request whose blocks
failed to load samples nothing and is listed in `failed` for the scheduler to recompute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from tsukimi.engine.block_manager import KVConnector
from tsukimi.engine.kv_cache import BatchAttention, PagedKVCache
from tsukimi.engine.kv_staging import StagedPublisher
from tsukimi.engine.layer_loading import LayerLoader, LayerLoads
from tsukimi.engine.request import EngineRequest
from tsukimi.engine.sampling import sample
from tsukimi.engine.scheduler import ScheduledBatch


class Model(Protocol):
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attend: BatchAttention) -> torch.Tensor: ...
    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class ModelRunner:
    """Runs `model` over batches in `cache`, publishing prompt blocks through `connector`
    (None: none) and loading pooled blocks layer by layer through `loader` (None: loaded at
    admission). Not thread-safe: the engine thread only."""

    def __init__(
        self, model: Model, cache: PagedKVCache, connector: KVConnector | None, loader: LayerLoader | None = None
    ) -> None:
        self.model, self.cache, self.connector, self.loader = model, cache, connector, loader
        self.failed: frozenset[EngineRequest] = frozenset()  # the last step's late load failures

    def run(self, batch: ScheduledBatch) -> list[int | None]:
        """Compute `batch` (mutates: the cache, each request's KV length and sampling generator).

        Returns:
            Per entry of `batch`, the sampled token, or None where the entry samples nothing.
        """
        self.failed = frozenset()
        if not batch.requests:
            return []
        ids = [token for entry in batch.requests for token in entry.token_ids]
        positions = [p for entry in batch.requests for p in range(entry.start, entry.start + entry.num_tokens)]
        segments = [(entry.request.seq, entry.num_tokens) for entry in batch.requests]
        loads = self.loader.start() if self.loader is not None else None
        attend = BatchAttention(self.cache, segments, on_layer=self._on_layer(batch, loads))
        try:
            with torch.inference_mode():
                device = self.cache.device
                hidden = self.model.forward(
                    torch.tensor(ids, device=device), torch.tensor(positions, device=device), attend
                )
        finally:  # NOTE: never leave a load writing into blocks that may be released
            self.failed = loads.finish() if loads is not None else frozenset()
        attend.commit()
        with torch.inference_mode():
            ends: list[int] = []  # each sampling entry's last token: its logits row
            offset = 0
            for entry in batch.requests:
                offset += entry.num_tokens
                if entry.samples:
                    ends.append(offset - 1)
            # NOTE: on the host: sampling draws from each request's CPU generator (one small copy)
            logits = self.model.logits(hidden[ends]).cpu() if ends else None
        if self.connector is not None:
            self.connector.flush()  # NOTE: published before the first token leaves this worker
        return self._sample(batch, logits)

    def _on_layer(self, batch: ScheduledBatch, loads: LayerLoads | None) -> Callable[[int], None] | None:
        """The per-layer hook, run once a layer's new K/V are stored and before its attention:
        waits for that layer's loads, then offers the batch's filled prompt blocks to the KV
        pool, but none of a request whose loads failed (its KV is wrong from there on). None:
        nothing to do."""
        connector = self.connector
        published = [(entry.request, fill) for entry in batch.requests for fill in entry.published]
        if loads is None and (connector is None or not published):
            return None
        if isinstance(connector, StagedPublisher) and published:  # NOTE: pinned rows allocated before the forward
            connector.reserve_publish(len(published), self.cache)

        def on_layer(layer: int) -> None:
            failed = frozenset[EngineRequest]()
            if loads is not None:
                loads.wait(layer)
                failed = loads.failed
            fills = [fill for request, fill in published if request not in failed]
            if connector is not None and fills:
                connector.save_layer(layer, [f.block_hash for f in fills], [f.block for f in fills], self.cache)

        return on_layer

    def _sample(self, batch: ScheduledBatch, logits: torch.Tensor | None) -> list[int | None]:
        tokens: list[int | None] = []
        row = 0
        for entry in batch.requests:
            if not entry.samples:
                tokens.append(None)
                continue
            assert logits is not None
            if entry.request in self.failed:  # NOTE: its logits are wrong; its generator stays as it was
                tokens.append(None)
            else:
                tokens.append(sample(logits[row], entry.request.params, entry.request.generator))
            row += 1
        return tokens
