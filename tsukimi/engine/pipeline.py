"""One stage of chunked pipeline parallelism (CPP): the model restricted to a contiguous slice
of its layers, run over a long prompt chunk by chunk (Mooncake's multi-node chunked prefill,
FAST'25 Section 5.2, a simplified TeraPipe).

A prefill group of k stages splits the layers (`split_layers`); the prompt is cut into chunks
(`chunk_spans`) that flow through the stages, so stage i computes chunk c + 1 while stage
i + 1 computes chunk c::

    stage 0  (embed, layers [0, a))      chunk 0 | chunk 1 | chunk 2 |
    stage 1  (layers [a, L), norm, head)          | chunk 0 | chunk 1 | chunk 2 -> first token

Each stage keeps its own paged KV for its layers (chunk c attends to every earlier chunk's KV
of the same layer: `BatchAttention` over one growing sequence), and publishes its layers of
each prompt block the chunk fills to the KV pool under the usual per-(block, layer) keys, so a
decode worker loads the whole prompt's KV from the pool as it does after a one-worker prefill.

The stage's cache keeps the full model's layout (slots for every layer, only its own used):
the pool's objects are then exactly a one-worker prefill's (same format digest, same global
layer in each key and trailer), at the price of (k - 1) / k of the cache unused.

The arithmetic is the engine's own, op for op (the same embedding, layers, norm and logits on
the same chunk boundaries as `LLMEngine` with `max_batched_tokens = chunk_tokens`), so the first
token and the KV are those of one worker. Moving the hidden states between stages is the
serving side's job (tsukimi/serving/prefill_group/stage.py). Not thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tsukimi.engine.block_manager import KVConnector
from tsukimi.engine.kv_cache import BatchAttention, PagedKVCache, SequenceKV
from tsukimi.engine.model import LlamaModel, rope_cos_sin
from tsukimi.errors import InvalidArgument, OutOfSpace
from tsukimi.scheduler.block_hash import BlockHash, hash_blocks


@dataclass(frozen=True, slots=True)
class StageSpec:
    """Stage `index` of `num_stages`: layers [first_layer, end_layer) of the model."""

    index: int
    num_stages: int
    first_layer: int
    end_layer: int

    @property
    def is_first(self) -> bool:
        """Takes token ids (has the embedding)."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """Gives the first token (has the final norm and the lm head)."""
        return self.index == self.num_stages - 1


def split_layers(num_layers: int, num_stages: int) -> list[StageSpec]:
    """Contiguous, balanced layer slices (earlier stages take the remainder). Pure.

    Raises:
        InvalidArgument: fewer layers than stages, or no stage.
    """
    if not 1 <= num_stages <= num_layers:
        raise InvalidArgument(f"{num_stages} stages cannot split {num_layers} layers")
    base, extra = divmod(num_layers, num_stages)
    specs, start = [], 0
    for index in range(num_stages):
        end = start + base + (index < extra)
        specs.append(StageSpec(index, num_stages, start, end))
        start = end
    return specs


def chunk_spans(num_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """(start, count) of each chunk of a `num_tokens` prompt. Pure."""
    if chunk_tokens < 1:
        raise InvalidArgument(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return [(start, min(chunk_tokens, num_tokens - start)) for start in range(0, num_tokens, chunk_tokens)]


class PipelineStage:
    """Runs one prompt at a time through the layers of `spec` (see the module).

    Args:
        model: the whole model (only this stage's parts are used).
        spec: which layers.
        cache: this stage's KV cache (the full model's layout).
        connector: the KV pool to publish this stage's layers of the prompt blocks to (None: none).
    """

    def __init__(self, model: LlamaModel, spec: StageSpec, cache: PagedKVCache, connector: KVConnector | None) -> None:
        self.model, self.spec, self.cache, self.connector = model, spec, cache, connector
        self._seq: SequenceKV | None = None
        self._prompt_tokens = 0
        self._hashes: list[BlockHash] = []

    def begin(self, prompt: Sequence[int]) -> None:
        """Start a prompt: reserve its blocks (mutates; ends any prompt still open).

        Raises:
            InvalidArgument: an empty prompt or one beyond the model's context.
            OutOfSpace: the cache cannot hold it.
        """
        self.end()
        if not prompt or len(prompt) > self.model.config.max_position:
            raise InvalidArgument(f"a prompt of {len(prompt)} tokens (1..{self.model.config.max_position})")
        seq = SequenceKV()
        if not self.cache.reserve(seq, len(prompt)):
            raise OutOfSpace(f"the stage's KV cache cannot hold {len(prompt)} tokens")
        self._seq, self._prompt_tokens = seq, len(prompt)
        bt = self.cache.layout.block_tokens
        self._hashes = hash_blocks(prompt, bt) if self.connector is not None else []

    def run_chunk(self, inputs: Tensor) -> Tensor:
        """Compute the prompt's next chunk through this stage's layers (mutates the KV).

        Args:
            inputs: token ids int64 [T] (first stage) or the previous stage's hidden [T, hidden].

        Returns:
            The hidden states [T, hidden] for the next stage or, on the last stage, the float32
            final-normed hidden of the chunk's last token [1, hidden] (feed it to `first_token`).
        """
        seq = self._seq
        if seq is None:
            raise InvalidArgument("run_chunk before begin")
        count = int(inputs.shape[0])
        if seq.num_tokens + count > self._prompt_tokens:
            raise InvalidArgument(f"chunk of {count} tokens beyond the prompt's {self._prompt_tokens}")
        model, spec = self.model, self.spec
        attend = BatchAttention(self.cache, [(seq, count)], on_layer=self._publisher(seq.num_tokens, count))
        with torch.inference_mode():
            x = model.embed_tokens(inputs) if spec.is_first else inputs
            positions = torch.arange(seq.num_tokens, seq.num_tokens + count)
            cos, sin = rope_cos_sin(positions, model.config.head_dim, model.config.rope_theta)
            for layer in range(spec.first_layer, spec.end_layer):
                x = model.layers[layer](x, cos, sin, attend, layer)
            attend.commit()
            if not spec.is_last:
                return x
            hidden: Tensor = model.norm(x).float()  # NOTE: every row, as the engine does: same arithmetic
            return hidden[-1:]

    def first_token(self, hidden: Tensor) -> int:
        """The greedy token of the last chunk's final hidden (last stage only). Pure."""
        with torch.inference_mode():
            return int(self.model.logits(hidden).argmax(dim=-1)[0])

    @property
    def done(self) -> bool:
        """Every token of the open prompt went through this stage."""
        return self._seq is not None and self._seq.num_tokens == self._prompt_tokens

    def end(self) -> None:
        """Wait for this stage's publishing and free the prompt's blocks (mutates; idempotent)."""
        if self.connector is not None:
            self.connector.flush()
        if self._seq is not None:
            self.cache.pool.release(self._seq.block_table[::-1])
        self._seq, self._hashes = None, []

    def _publisher(self, start: int, count: int) -> _Publisher | None:
        """Offers this stage's layers of the prompt blocks that [start, start + count) fills."""
        if self.connector is None or self._seq is None:
            return None
        bt = self.cache.layout.block_tokens
        first, end = start // bt, min((start + count) // bt, len(self._hashes))
        if end <= first:
            return None
        return _Publisher(self.connector, self._hashes[first:end], self._seq.block_table[first:end], self.cache)


@dataclass(frozen=True, slots=True)
class _Publisher:
    """BatchAttention's per-layer hook: publish the layer of these blocks (while the next computes)."""

    connector: KVConnector
    hashes: list[BlockHash]
    blocks: list[int]
    cache: PagedKVCache

    def __call__(self, layer: int) -> None:
        self.connector.save_layer(layer, self.hashes, self.blocks, self.cache)


def run_pipeline_locally(stages: Sequence[PipelineStage], prompt: Sequence[int], chunk_tokens: int) -> int:
    """Every chunk through every stage in one thread, in order (a reference, no parallelism):
    the first token. Ends every stage (their KV is published). Mutates the stages."""
    for stage in stages:
        stage.begin(prompt)
    ids = torch.tensor(list(prompt), dtype=torch.int64)
    hidden = ids
    for start, count in chunk_spans(len(prompt), chunk_tokens):
        hidden = ids[start : start + count]
        for stage in stages:
            hidden = stage.run_chunk(hidden)
    token = stages[-1].first_token(hidden)
    for stage in stages:
        stage.end()
    return token
