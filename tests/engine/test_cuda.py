"""The engine on a CUDA GPU (`pytest -m gpu`; skipped without one): the paged cache in device
memory, flash attention on 4-D inputs, the KV pool's staged path (gather + one copy, one copy +
one scatter) and layer-wise loads on the side stream, each against the same engine's tokens
without the pool. The CPU runs the same code paths in tests/engine/test_kv_staging.py."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tsukimi.engine.engine import LLMEngine
from tsukimi.engine.kv_cache import KVLayout
from tsukimi.engine.kv_pool import KVFormat, StoreKVConnector
from tsukimi.engine.model import attention
from tsukimi.engine.presets import random_preset
from tsukimi.engine.sampling import SamplingParams
from tsukimi.engine.weights import LoadedModel, load_model
from tsukimi.store.client import StoreClient
from tsukimi.testing.deployments import Deployment, start_deployment

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BLOCK = 16
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def small() -> LoadedModel:
    """A 4-layer SmolLM2-shaped model in bfloat16 on the GPU."""
    config, model = random_preset("smollm2-135m", 0, "bfloat16", CUDA, num_layers=4)
    return LoadedModel(config, model, config.source)


@pytest.fixture(scope="module")
def small32() -> LoadedModel:
    """The same in float32: a prefix loaded then a masked chunk computes its last tokens with
    another kernel than one causal prefill, and bfloat16's rounding could flip a random model's
    greedy token; float32 tests the pool's bytes, not the kernels' rounding."""
    config, model = random_preset("smollm2-135m", 0, "float32", CUDA, num_layers=4)
    return LoadedModel(config, model, config.source)


@pytest.fixture
def store() -> Iterator[Deployment]:
    dep = start_deployment("inprocess")
    yield dep
    dep.close()


def _engine(loaded: LoadedModel, client: StoreClient | None, layerwise: bool = False) -> LLMEngine:
    mc = loaded.config
    layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, BLOCK, mc.torch_dtype)
    connector = StoreKVConnector(client, KVFormat.of(mc.identity, layout)) if client is not None else None
    return LLMEngine(loaded.model, layout, 256, connector=connector, layerwise_loading=layerwise, device=CUDA)


def _tokens(engine: LLMEngine, prompt: list[int], max_tokens: int = 8) -> list[int]:
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]


def test_flash_attention_runs_on_the_engine_s_4d_inputs() -> None:
    q = torch.randn(2048, 32, 128, device=CUDA, dtype=torch.bfloat16)
    k, v = (torch.randn(2048, 8, 128, device=CUDA, dtype=torch.bfloat16) for _ in range(2))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # NOTE: raises if flash cannot take these inputs
        out = attention(q, k, v, None, True)
    with sdpa_kernel(SDPBackend.MATH):
        want = attention(q, k, v, None, True)
    assert out.shape == q.shape and torch.allclose(out.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_a_fresh_prefill_runs_on_flash_and_its_cache_is_on_the_gpu(small: LoadedModel) -> None:
    engine = _engine(small, None)
    assert engine.cache.slots.device.type == "cuda" and not engine.cache.host_addressable
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        assert len(_tokens(engine, list(range(3, 503)), 1)) == 1


@pytest.mark.parametrize("layerwise", [False, True])
def test_greedy_tokens_are_the_same_with_and_without_the_pool(
    small32: LoadedModel, store: Deployment, layerwise: bool
) -> None:
    small = small32
    prompt = [1, *range(1000, 1100)]  # 6 full blocks
    want = _tokens(_engine(small, None), prompt)
    prefill, decode = _engine(small, store.client()), _engine(small, store.client(), layerwise)
    assert _tokens(prefill, prompt, 1) == want[:1]
    assert _tokens(decode, prompt + want[:1], 7) == want[1:]
    assert isinstance(decode.connector, StoreKVConnector) and decode.connector.loaded_blocks == 6
    assert isinstance(prefill.connector, StoreKVConnector) and prefill.connector.saved_blocks == 6


def test_layerwise_loads_run_on_the_side_stream(small32: LoadedModel, store: Deployment) -> None:
    small = small32
    prompt = [1, *range(2000, 2200)]
    publisher = _engine(small, store.client())
    _tokens(publisher, prompt, 1)
    engine = _engine(small, store.client(), layerwise=True)
    side = engine.cache.order._side
    assert side is not None and side != torch.cuda.current_stream()
    assert _tokens(engine, [*prompt, 5], 4) == _tokens(_engine(small, None), [*prompt, 5], 4)
    assert engine.loader is not None and isinstance(engine.connector, StoreKVConnector)
    assert engine.connector.loaded_blocks == len(prompt) // BLOCK


def test_the_8b_preset_builds_on_the_gpu_in_seconds() -> None:
    torch.cuda.synchronize()
    start = time.perf_counter()
    loaded = load_model("random:llama3-8b", "bfloat16", CUDA)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    params = list(loaded.model.parameters())
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in params)
    assert 7.9e9 < sum(p.numel() for p in params) < 8.1e9
    assert seconds < 60, f"building the 8B preset took {seconds:.1f} s"
    del loaded, params
    torch.cuda.empty_cache()
