"""CPP stages in one process: the layer split, the chunking, and the first token and KV of a
k-stage pipeline equal one engine's, op for op."""

from __future__ import annotations

import pytest
import torch

from tsukimi.engine.engine import LLMEngine
from tsukimi.engine.kv_cache import KVLayout, PagedKVCache
from tsukimi.engine.pipeline import PipelineStage, StageSpec, chunk_spans, run_pipeline_locally, split_layers
from tsukimi.engine.sampling import SamplingParams
from tsukimi.engine.weights import random_tiny
from tsukimi.errors import InvalidArgument


def test_split_layers_is_contiguous_and_balanced() -> None:
    assert split_layers(4, 2) == [StageSpec(0, 2, 0, 2), StageSpec(1, 2, 2, 4)]
    assert [(s.first_layer, s.end_layer) for s in split_layers(5, 3)] == [(0, 2), (2, 4), (4, 5)]
    assert split_layers(4, 1)[0].is_first and split_layers(4, 1)[0].is_last
    with pytest.raises(InvalidArgument):
        split_layers(2, 3)


def test_chunk_spans_cover_the_prompt() -> None:
    assert chunk_spans(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert chunk_spans(4, 4) == [(0, 4)]


class _Recorder:
    """A KVConnector that records what each stage offers, layer by layer."""

    def __init__(self) -> None:
        self.saved: dict[tuple[int, int], bytes] = {}

    def load(self, hashes: object, blocks: object, cache: PagedKVCache) -> int:
        return 0

    def save_layer(self, layer: int, hashes: list[int], blocks: list[int], cache: PagedKVCache) -> None:
        for block_hash, block in zip(hashes, blocks, strict=True):
            self.saved[(block_hash, layer)] = bytes(cache.layer_bytes(block, layer))

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_pipeline_first_token_and_kv_equal_one_engine(num_stages: int) -> None:
    torch.set_num_threads(1)
    loaded = random_tiny(0)
    mc, chunk = loaded.config, 64
    layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, 16, mc.torch_dtype)
    prompt = [1, *[(7 * i) % 31000 + 3 for i in range(200)]]
    engine_kv = _Recorder()
    engine = LLMEngine(loaded.model, layout, 64, mc.eos_token_ids, chunk, engine_kv)  # type: ignore[arg-type]
    expected = engine.generate([prompt], SamplingParams(max_tokens=1))[0]
    recorder = _Recorder()
    stages = [
        PipelineStage(loaded.model, spec, PagedKVCache(layout, 64), recorder)  # type: ignore[arg-type]
        for spec in split_layers(mc.num_layers, num_stages)
    ]
    assert [run_pipeline_locally(stages, prompt, chunk)] == expected
    assert len(recorder.saved) == (len(prompt) // 16) * mc.num_layers
    assert recorder.saved == engine_kv.saved  # bit for bit: the pool holds one worker's KV
