"""Layer-wise loading (tsukimi/engine/layer_loading.py), observed through a KV pool double whose
every layer batch takes DELAY_S: the forward's layer 0 runs while later layers still arrive,
no layer's attention runs before its own layer arrived, and a block that fails late is
recomputed (the tokens, sampled ones too, equal a run without the failure)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import pytest
import torch

from tsukimi.engine.engine import LLMEngine, StepOutput
from tsukimi.engine.kv_cache import KVLayout, PagedKVCache
from tsukimi.engine.model import generate_greedy_reference
from tsukimi.engine.sampling import SamplingParams
from tsukimi.engine.weights import LoadedModel
from tsukimi.scheduler.block_hash import BlockHash, hash_blocks

BLOCK = 8
PROMPT = [1, *range(200, 240)]  # 5 full blocks, all from the pool; the 41st token is computed
DELAY_S = 0.1


class SlowPool:
    """A KV pool in a dict, (block hash, layer) -> slot bytes; each load batch sleeps DELAY_S
    and notes when it ended. `fail` names (block hash, layer) objects that fail to load."""

    def __init__(self) -> None:
        self.objects: dict[tuple[BlockHash, int], bytes] = {}
        self.fail: set[tuple[BlockHash, int]] = set()
        self.loaded_blocks = 0
        self.layer_loaded_s: dict[int, float] = {}
        self.saves: list[tuple[int, tuple[BlockHash, ...]]] = []

    def probe(self, hashes: Sequence[BlockHash]) -> int:
        n = 0
        while n < len(hashes) and (hashes[n], 0) in self.objects:
            n += 1
        return n

    def load_layer(
        self, layer: int, hashes: Sequence[BlockHash], blocks: Sequence[int], cache: PagedKVCache
    ) -> list[bool]:
        time.sleep(DELAY_S)
        arrived = []
        for block_hash, block in zip(hashes, blocks, strict=True):
            ok = (block_hash, layer) not in self.fail
            if ok:
                cache.slot(block, layer)[:] = self.objects[block_hash, layer]
            arrived.append(ok)
        self.layer_loaded_s[layer] = time.perf_counter()
        return arrived

    def load(self, hashes: Sequence[BlockHash], blocks: Sequence[int], cache: PagedKVCache) -> int:
        """All layers before the step (layerwise loading off)."""
        for layer in range(cache.layout.num_layers):
            self.load_layer(layer, hashes, blocks, cache)
        self.loaded_blocks += min(len(hashes), len(blocks))
        return min(len(hashes), len(blocks))

    def save_layer(self, layer: int, hashes: Sequence[BlockHash], blocks: Sequence[int], cache: PagedKVCache) -> None:
        self.saves.append((layer, tuple(hashes)))
        for block_hash, block in zip(hashes, blocks, strict=True):
            self.objects.setdefault((block_hash, layer), bytes(cache.slot(block, layer)))

    def flush(self) -> None:
        pass


def _engine(tiny: LoadedModel, pool: SlowPool, layerwise: bool = True) -> LLMEngine:
    cfg = tiny.config
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK)
    return LLMEngine(tiny.model, layout, 64, cfg.eos_token_ids, connector=pool, layerwise_loading=layerwise)


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[StepOutput]:
    engine.add_request("r", prompt, params)
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    return outputs


def _tokens(outputs: list[StepOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def _published(tiny: LoadedModel, prompt: list[int]) -> SlowPool:
    pool = SlowPool()
    _run(_engine(tiny, pool), prompt, SamplingParams(max_tokens=1))
    assert len(pool.objects) == (len(prompt) // BLOCK) * tiny.config.num_layers
    pool.saves.clear()
    return pool


def _layer_finished_s(tiny: LoadedModel) -> tuple[dict[int, float], list[torch.utils.hooks.RemovableHandle]]:
    """When each decoder layer's forward (attention included) first finished."""
    finished: dict[int, float] = {}

    def hook(index: int) -> Callable[..., None]:
        def note(*_: object) -> None:
            finished.setdefault(index, time.perf_counter())

        return note

    handles = [layer.register_forward_hook(hook(index)) for index, layer in enumerate(tiny.model.layers)]
    return finished, handles


@pytest.mark.parametrize("layerwise", [True, False])
def test_compute_starts_before_the_last_layer_arrives(tiny: LoadedModel, layerwise: bool) -> None:
    pool = _published(tiny, PROMPT)
    engine = _engine(tiny, pool, layerwise)
    finished, handles = _layer_finished_s(tiny)
    try:
        outputs = _run(engine, PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
    finally:
        for handle in handles:
            handle.remove()
    last = tiny.config.num_layers - 1
    assert _tokens(outputs) == generate_greedy_reference(tiny.model, PROMPT, 4)
    assert outputs[0].pool_tokens == 5 * BLOCK and pool.loaded_blocks == 5
    assert all(finished[layer] > pool.layer_loaded_s[layer] for layer in range(last + 1))  # never early
    if layerwise:  # layer 0 computed while the last layer was still on its way (DELAY_S per layer)
        assert finished[0] < pool.layer_loaded_s[last]
    else:  # the baseline loads everything first
        assert finished[0] > pool.layer_loaded_s[last]


def test_a_late_failure_recomputes_and_publishes_nothing_wrong(tiny: LoadedModel) -> None:
    prompt = PROMPT + list(range(300, 317))  # 2 more full blocks, filled (and published) by its first step
    pool = _published(tiny, PROMPT)
    hashes = hash_blocks(prompt, BLOCK)
    pool.fail.add((hashes[2], 2))  # block 2 passes the probe, then its layer 2 fails
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    outputs = _run(_engine(tiny, pool), prompt, params)
    assert (outputs[0].cached_tokens, outputs[0].pool_tokens) == (0, 0)  # recomputed, nothing loaded
    assert pool.loaded_blocks == 0
    layers = [layer for layer, saved in pool.saves if hashes[5] in saved]
    failed_step, recompute = layers[:-4], layers[-4:]
    assert recompute == [0, 1, 2, 3] and failed_step in ([0], [0, 1])  # nothing of it from layer 2 on
    clean = _run(_engine(tiny, SlowPool()), prompt, params)  # the same request, no pool at all
    assert _tokens(outputs) == _tokens(clean)  # its sampling generator was not advanced by the failed step


def test_a_late_failure_keeps_other_requests_in_the_step(tiny: LoadedModel) -> None:
    pool = _published(tiny, PROMPT)
    pool.fail.add((hash_blocks(PROMPT, BLOCK)[1], 0))
    engine = _engine(tiny, pool)
    other = [1, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    greedy = SamplingParams(max_tokens=3, ignore_eos=True)
    assert engine.generate([PROMPT, other], greedy) == [
        generate_greedy_reference(tiny.model, PROMPT, 3),
        generate_greedy_reference(tiny.model, other, 3),
    ]
    engine.scheduler.check_invariants()
    engine.cache.pool.check_invariants()
