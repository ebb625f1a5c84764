"""KV blocks through the store: a prefill engine publishes them, a decode engine (its own cache)
loads them, and the tokens equal a colocated run; lost blocks are recomputed; blocks of
another format are refused. The store is a real master and holders in this process."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import cast

import pytest

from tsukimi.clock import VirtualClock
from tsukimi.engine import kv_pool
from tsukimi.engine.engine import LLMEngine, StepOutput
from tsukimi.engine.kv_cache import KVLayout
from tsukimi.engine.kv_pool import KVFormat, StoreKVConnector
from tsukimi.engine.model import generate_greedy_reference
from tsukimi.engine.sampling import SamplingParams
from tsukimi.engine.weights import LoadedModel
from tsukimi.scheduler.block_hash import BlockHash, hash_blocks
from tsukimi.store.client import StoreClient
from tsukimi.store.replica_io import GetResult
from tsukimi.testing.deployments import Deployment, start_deployment

BLOCK = 8
PROMPTS = [[1, *range(100, 140)], [1, *range(100, 132), 7, 7, 7], [1, 2, 3]]  # the 2nd shares 4 blocks
NEW = 8


@pytest.fixture
def store() -> Iterator[Deployment]:
    dep = start_deployment("inprocess")
    yield dep
    dep.close()


def _engine(
    tiny: LoadedModel, client: StoreClient | None, layerwise: bool = False
) -> tuple[LLMEngine, StoreKVConnector | None]:
    cfg = tiny.config
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK)
    connector = StoreKVConnector(client, KVFormat.of(tiny.source, layout)) if client is not None else None
    engine = LLMEngine(tiny.model, layout, 128, cfg.eos_token_ids, connector=connector, layerwise_loading=layerwise)
    return engine, connector


def _run(engine: LLMEngine, name: str, prompt: list[int], max_tokens: int) -> list[StepOutput]:
    engine.add_request(name, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    return outputs


@pytest.mark.parametrize("layerwise", [False, True])
def test_prefill_to_pool_to_decode_equals_colocated(tiny: LoadedModel, store: Deployment, layerwise: bool) -> None:
    prefill, prefill_pool = _engine(tiny, store.client(), layerwise)
    decode, decode_pool = _engine(tiny, store.client(), layerwise)
    assert prefill_pool is not None and decode_pool is not None
    # (cached tokens, of which from the pool) for prefill, then decode
    reuse = [((0, 0), (40, 40)), ((32, 0), (32, 0)), ((0, 0), (0, 0))]
    for n, prompt in enumerate(PROMPTS):
        expected = list(generate_greedy_reference(tiny.model, prompt, NEW))
        first = _run(prefill, f"p{n}", prompt, 1)
        assert [t for o in first for t in o.token_ids] == expected[:1]
        rest = _run(decode, f"d{n}", prompt + expected[:1], NEW - 1)
        assert [t for o in rest for t in o.token_ids] == expected[1:]
        got = ((first[0].cached_tokens, first[0].pool_tokens), (rest[0].cached_tokens, rest[0].pool_tokens))
        assert got == reuse[n]  # prompt 1 shares 4 blocks with prompt 0: both engines hold them locally
    assert prefill_pool.saved_blocks == 5  # prompt 0's full blocks; prompt 1 computed no new full block
    assert decode_pool.loaded_blocks == 5


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_lost_block_is_recomputed_never_misread(tiny: LoadedModel, store: Deployment, layerwise: bool) -> None:
    prefill, _ = _engine(tiny, store.client())
    decode, pool = _engine(tiny, store.client(), layerwise)
    assert pool is not None
    prompt = PROMPTS[0]
    expected = list(generate_greedy_reference(tiny.model, prompt, NEW))
    _run(prefill, "p", prompt, 1)
    lost = hash_blocks(prompt, BLOCK)[2]
    assert store.client().remove(pool.format.key(lost, 1), force=True)  # one layer of block 2 is gone
    rest = _run(decode, "d", prompt + expected[:1], NEW - 1)
    assert rest[0].pool_tokens == 2 * BLOCK  # blocks 0 and 1; block 2 and on were computed
    assert [t for o in rest for t in o.token_ids] == expected[1:]


@pytest.mark.parametrize("layerwise", [False, True])
def test_blocks_of_another_format_are_refused(tiny: LoadedModel, store: Deployment, layerwise: bool) -> None:
    decode, pool = _engine(tiny, store.client(), layerwise)
    assert pool is not None
    prompt = PROMPTS[0]
    first = hash_blocks(prompt, BLOCK)[0]
    size = decode.cache.layout.slot_bytes
    for layer in range(decode.cache.layout.num_layers):
        store.client().put(pool.format.key(first, layer), b"\x01" * size)  # right size, wrong trailer
    outputs = _run(decode, "d", prompt, NEW)
    assert (outputs[0].cached_tokens, pool.refused_blocks) == (0, 1)  # refused, logged, computed instead
    assert [t for o in outputs for t in o.token_ids] == list(generate_greedy_reference(tiny.model, prompt, NEW))
    other = KVFormat.of("some-other-model", decode.cache.layout)
    assert other.prefix != pool.format.prefix  # another model's blocks live under other keys


class _Recorder:
    """A connector that notes, at each save_layer, whether the next layer was computed yet."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, bool]] = []

    def load(self, hashes: object, blocks: object, cache: object) -> int:
        return 0

    def save_layer(self, layer: int, hashes: list[int], blocks: list[int], cache: object) -> None:
        from tsukimi.engine.kv_cache import PagedKVCache

        assert isinstance(cache, PagedKVCache)
        later = layer + 1 < cache.layout.num_layers and bool(cache.kv[blocks[0], layer + 1].abs().sum() > 0)
        self.events.append(("save", layer, later))

    def flush(self) -> None:
        self.events.append(("flush", -1, False))


def test_layers_are_published_while_the_next_ones_compute(tiny: LoadedModel) -> None:
    cfg = tiny.config
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK)
    recorder = _Recorder()
    engine = LLMEngine(tiny.model, layout, 64, cfg.eos_token_ids, connector=recorder)
    _run(engine, "p", PROMPTS[0], 1)
    saves = [e for e in recorder.events if e[0] == "save"]
    assert [layer for _, layer, _ in saves] == list(range(cfg.num_layers))  # one call per layer, in order
    assert not any(computed for _, _, computed in saves)  # each before the next layer's K/V existed
    assert recorder.events[-1][0] == "flush"


class _LosingConnector(StoreKVConnector):
    """Loses one object of the pool right after the probe saw it (evicted in between)."""

    lose = ""

    def probe(self, hashes: Sequence[BlockHash]) -> int:
        found = super().probe(hashes)
        if self.lose:
            assert self.client.remove(self.lose, force=True)
            self.lose = ""
        return found


def test_a_block_lost_after_the_probe_is_recomputed(tiny: LoadedModel, store: Deployment) -> None:
    prefill, _ = _engine(tiny, store.client())
    cfg = tiny.config
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK)
    pool = _LosingConnector(store.client(), KVFormat.of(tiny.source, layout))
    decode = LLMEngine(tiny.model, layout, 128, cfg.eos_token_ids, connector=pool, layerwise_loading=True)
    prompt = PROMPTS[0]
    expected = list(generate_greedy_reference(tiny.model, prompt, NEW))
    _run(prefill, "p", prompt, 1)
    pool.lose = pool.format.key(hash_blocks(prompt, BLOCK)[3], cfg.num_layers - 1)  # the last layer of block 3
    rest = _run(decode, "d", prompt + expected[:1], NEW - 1)
    assert [t for o in rest for t in o.token_ids] == expected[1:]
    assert (rest[0].pool_tokens, pool.loaded_blocks) == (0, 0)  # found late: the whole prefix recomputed


class _SlowLink:
    """A store client whose batches take `seconds_per_byte` of a virtual clock: records the
    size of each batch (keys) a load makes."""

    def __init__(self, client: StoreClient, clock: VirtualClock, seconds_per_byte: float) -> None:
        self.client, self.clock, self.seconds_per_byte = client, clock, seconds_per_byte
        self.batches: list[int] = []
        self.lose = ""

    def __getattr__(self, name: str) -> object:  # put, batch_put, ...: the real client's
        return getattr(self.client, name)

    def batch_get(self, keys: Sequence[str], into: Sequence[memoryview]) -> list[GetResult]:
        if self.lose:
            assert self.client.remove(self.lose, force=True)
            self.lose = ""
        self.batches.append(len(keys))
        self.clock.advance(sum(len(v) for v in into) * self.seconds_per_byte)
        return self.client.batch_get(keys, into)


def test_a_load_reads_in_order_in_batches_sized_to_the_link(
    tiny: LoadedModel, store: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tiny.config
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK)
    monkeypatch.setattr(kv_pool, "FIRST_GROUP_BYTES", 2 * layout.slot_bytes)  # 2 objects first
    monkeypatch.setattr(kv_pool, "GROUP_S", 1.0)
    prefill, _ = _engine(tiny, store.client())
    prompt = PROMPTS[0]  # 41 tokens: 5 full blocks = 20 objects of 4 layers
    expected = list(generate_greedy_reference(tiny.model, prompt, NEW))
    _run(prefill, "p", prompt, 1)
    clock = VirtualClock()
    link = _SlowLink(store.client(), clock, seconds_per_byte=1.0 / (3 * layout.slot_bytes))  # 3 objects/s
    pool = StoreKVConnector(cast(StoreClient, link), KVFormat.of(tiny.source, layout), clock=clock)
    decode = LLMEngine(tiny.model, layout, 128, cfg.eos_token_ids, connector=pool)
    rest = _run(decode, "d", prompt + expected[:1], NEW - 1)
    assert [t for o in rest for t in o.token_ids] == expected[1:]
    assert pool.loaded_blocks == 5
    assert link.batches[0] == 2 and set(link.batches[1:-1]) == {3}  # 1 s of the link's rate each
    assert sum(link.batches) == 5 * cfg.num_layers


def test_a_load_stops_at_the_first_lost_object_and_reads_no_further(
    tiny: LoadedModel, store: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tiny.config
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK)
    monkeypatch.setattr(kv_pool, "FIRST_GROUP_BYTES", 2 * layout.slot_bytes)
    prefill, _ = _engine(tiny, store.client())
    prompt = PROMPTS[0]
    expected = list(generate_greedy_reference(tiny.model, prompt, NEW))
    _run(prefill, "p", prompt, 1)
    clock = VirtualClock()
    link = _SlowLink(store.client(), clock, seconds_per_byte=1.0 / (2 * layout.slot_bytes))  # 2 objects/s
    pool = StoreKVConnector(cast(StoreClient, link), KVFormat.of(tiny.source, layout), clock=clock)
    link.lose = pool.format.key(hash_blocks(prompt, BLOCK)[1], 1)  # block 1, layer 1: the 6th object
    decode = LLMEngine(tiny.model, layout, 128, cfg.eos_token_ids, connector=pool)
    rest = _run(decode, "d", prompt + expected[:1], NEW - 1)
    assert [t for o in rest for t in o.token_ids] == expected[1:]
    assert pool.loaded_blocks == 1  # block 0 whole; block 1 lost a layer: computed from there
    assert sum(link.batches) == 6  # 2 + 2 + 2: the batch with the lost object is the last
