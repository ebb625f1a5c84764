"""The forward of one engine step: a `ScheduledBatch` in, one sampled token per request out.

One forward runs over every scheduled request's new tokens at once (`BatchAttention` over the
paged KV cache). As soon as a layer's K/V are stored, that layer of the full prompt blocks the
step fills is offered to the KV pool (`KVConnector.save_layer`) while the next layers compute;
all of it is written (`flush`) before any token of the step leaves. Only requests whose tokens
all have KV after the step get logits and a sampled token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from tsukimi.engine.block_manager import KVConnector
from tsukimi.engine.kv_cache import BatchAttention, PagedKVCache
from tsukimi.engine.sampling import sample
from tsukimi.engine.scheduler import ScheduledBatch


class Model(Protocol):
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attend: BatchAttention) -> torch.Tensor: ...
    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class ModelRunner:
    """Runs `model` over batches in `cache`, publishing prompt blocks through `connector`
    (None: none). Not thread-safe: the engine thread only."""

    def __init__(self, model: Model, cache: PagedKVCache, connector: KVConnector | None) -> None:
        self.model, self.cache, self.connector = model, cache, connector

    def run(self, batch: ScheduledBatch) -> list[int | None]:
        """Compute `batch` (mutates: the cache, each request's KV length and sampling generator).

        Returns:
            Per entry of `batch`, the sampled token, or None where the entry samples nothing.
        """
        if not batch.requests:
            return []
        ids = [token for entry in batch.requests for token in entry.token_ids]
        positions = [p for entry in batch.requests for p in range(entry.start, entry.start + entry.num_tokens)]
        segments = [(entry.request.seq, entry.num_tokens) for entry in batch.requests]
        attend = BatchAttention(self.cache, segments, on_layer=self._publisher(batch))
        with torch.inference_mode():
            hidden = self.model.forward(torch.tensor(ids), torch.tensor(positions), attend)
            attend.commit()
            ends: list[int] = []  # each sampling entry's last token: its logits row
            offset = 0
            for entry in batch.requests:
                offset += entry.num_tokens
                if entry.samples:
                    ends.append(offset - 1)
            logits = self.model.logits(hidden[ends]) if ends else None
        if self.connector is not None:
            self.connector.flush()  # NOTE: published before the first token leaves this worker
        return self._sample(batch, logits)

    def _publisher(self, batch: ScheduledBatch) -> Callable[[int], None] | None:
        """The per-layer hook that offers the batch's filled prompt blocks to the KV pool
        (None: no pool, or no such block)."""
        connector = self.connector
        if connector is None:
            return None
        published = [fill for entry in batch.requests for fill in entry.published]
        if not published:
            return None
        hashes, blocks = [fill.block_hash for fill in published], [fill.block for fill in published]
        return lambda layer: connector.save_layer(layer, hashes, blocks, self.cache)

    def _sample(self, batch: ScheduledBatch, logits: torch.Tensor | None) -> list[int | None]:
        tokens: list[int | None] = []
        row = 0
        for entry in batch.requests:
            if not entry.samples:
                tokens.append(None)
                continue
            assert logits is not None
            tokens.append(sample(logits[row], entry.request.params, entry.request.generator))
            row += 1
        return tokens
