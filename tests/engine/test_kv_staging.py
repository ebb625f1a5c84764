"""The KV pool's staged path (the one a GPU cache takes), run on the CPU with `staged=True`:
slots gathered into host rows, one copy, one scatter. Same greedy tokens as without the pool,
and the pool holds the same bytes as the zero-copy path's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tsukimi.engine.engine import LLMEngine
from tsukimi.engine.kv_cache import KVLayout, PagedKVCache
from tsukimi.engine.kv_pool import KVFormat, StoreKVConnector
from tsukimi.engine.kv_staging import HostArena, SlotStaging
from tsukimi.engine.model import generate_greedy_reference
from tsukimi.engine.sampling import SamplingParams
from tsukimi.engine.weights import LoadedModel
from tsukimi.errors import InvalidArgument
from tsukimi.scheduler.block_hash import hash_blocks
from tsukimi.store.client import StoreClient
from tsukimi.testing.deployments import Deployment, start_deployment

BLOCK = 8
PROMPT = [1, *range(100, 140)]  # 5 full blocks and one token
NEW = 6


@pytest.fixture
def store() -> Iterator[Deployment]:
    dep = start_deployment("inprocess")
    yield dep
    dep.close()


def _engine(tiny: LoadedModel, client: StoreClient, staged: bool, layerwise: bool = False) -> LLMEngine:
    cfg = tiny.config
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK)
    connector = StoreKVConnector(client, KVFormat.of(tiny.source, layout), staged=staged)
    return LLMEngine(tiny.model, layout, 64, cfg.eos_token_ids, connector=connector, layerwise_loading=layerwise)


def _tokens(engine: LLMEngine, prompt: list[int], max_tokens: int) -> list[int]:
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]


@pytest.mark.parametrize("layerwise", [False, True])
def test_staged_prefill_to_pool_to_decode_equals_the_reference(
    tiny: LoadedModel, store: Deployment, layerwise: bool
) -> None:
    expected = generate_greedy_reference(tiny.model, PROMPT, NEW)
    prefill, decode = _engine(tiny, store.client(), True), _engine(tiny, store.client(), True, layerwise)
    assert _tokens(prefill, PROMPT, 1) == expected[:1]
    assert _tokens(decode, PROMPT + expected[:1], NEW - 1) == expected[1:]
    assert isinstance(prefill.connector, StoreKVConnector) and isinstance(decode.connector, StoreKVConnector)
    assert (prefill.connector.saved_blocks, decode.connector.loaded_blocks) == (5, 5)
    # the decode engine's loaded slots equal the prefill engine's computed ones, byte for byte
    for block_hash in hash_blocks(PROMPT, BLOCK)[:5]:
        src, dst = (e.cache.pool._by_hash[block_hash] for e in (prefill, decode))
        assert torch.equal(prefill.cache.slots[src, :, :-64], decode.cache.slots[dst, :, :-64])


def test_the_pool_holds_the_same_bytes_staged_or_in_place(tiny: LoadedModel) -> None:
    objects = []
    for staged in (False, True):
        dep = start_deployment("inprocess")
        try:
            engine = _engine(tiny, dep.client(), staged)
            _tokens(engine, PROMPT, 1)
            assert isinstance(engine.connector, StoreKVConnector)
            fmt = engine.connector.format
            keys = [fmt.key(h, layer) for h in hash_blocks(PROMPT, BLOCK)[:5] for layer in range(fmt.num_layers)]
            objects.append([dep.client().get(key) for key in keys])
        finally:
            dep.close()
    assert all(obj is not None for obj in objects[0]) and objects[0] == objects[1]


def test_staged_greedy_tokens_with_and_without_the_pool(tiny: LoadedModel, store: Deployment) -> None:
    cfg = tiny.config
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK)
    alone = LLMEngine(tiny.model, layout, 64, cfg.eos_token_ids)
    first, second = _engine(tiny, store.client(), True), _engine(tiny, store.client(), True, layerwise=True)
    want = _tokens(alone, [*PROMPT, 5, 6], NEW)
    assert _tokens(first, [*PROMPT, 5, 6], NEW) == want  # computes and publishes
    assert _tokens(second, [*PROMPT, 5, 6], NEW) == want  # loads 5 blocks through the staging
    assert isinstance(second.connector, StoreKVConnector) and second.connector.loaded_blocks == 5


def test_gather_then_scatter_moves_exactly_the_named_slots() -> None:
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_tokens=2)
    src, dst = PagedKVCache(layout, 6), PagedKVCache(layout, 6)
    src.slots.copy_(
        torch.randint(0, 256, src.slots.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    )
    staging = SlotStaging(src)
    ids = staging.slot_ids([4, 1], [2, 0])
    assert ids == [14, 12, 5, 3]
    rows = HostArena(layout.slot_bytes, src.device).take(len(ids))
    staging.gather(ids, rows)
    SlotStaging(dst).scatter(ids, rows)
    moved = torch.zeros(6, 3, dtype=torch.bool)
    for block, layer in ((4, 2), (4, 0), (1, 2), (1, 0)):
        moved[block, layer] = True
    assert torch.equal(dst.slots[moved], src.slots[moved])
    assert not dst.slots[~moved].any()


def test_the_arena_grows_by_exact_chunks_and_reset_makes_one() -> None:
    arena = HostArena(16, torch.device("cpu"))
    first = arena.take(3)
    first.fill_(7)
    second = arena.take(4)  # does not fit the first chunk: a new one of exactly 4, the first rows stay valid
    assert second.shape == (4, 16) and arena._chunks[-1].shape == (4, 16) and bool((first == 7).all())
    arena.reset()
    assert len(arena._chunks) == 1 and arena._chunks[0].shape == (3 + 4, 16)
    assert arena.take(7).data_ptr() == arena._chunks[0].data_ptr()


def test_a_reserved_arena_hands_out_the_round_from_one_chunk() -> None:
    arena = HostArena(16, torch.device("cpu"))
    arena.take(2)
    arena.reset()
    arena.reserve(10)  # nothing handed out: the small chunk is replaced by one of exactly 10 rows
    assert [chunk.shape[0] for chunk in arena._chunks] == [10]
    rows = [arena.take(n) for n in (3, 3, 4)]
    assert len(arena._chunks) == 1 and rows[2].data_ptr() == arena._chunks[0][6].data_ptr()
    arena.reserve(4)  # no room left: a second chunk, the rows handed out stay valid
    assert [chunk.shape[0] for chunk in arena._chunks] == [10, 4]


def test_a_cache_off_the_host_has_no_slot_views() -> None:
    cache = PagedKVCache(KVLayout(1, 1, 2, 2), 2, device="meta")
    assert not cache.host_addressable
    with pytest.raises(InvalidArgument, match="stage them"):
        cache.slot(0, 0)
