"""TsukimiConnector's worker with its KV cache on a device (worker.py): pool saves and loads of
vLLM's per-layer layout [blocks, 2, block_tokens, kv_heads, head_dim] through the store's device
path, and PD direct hand-over READing a producer's CUDA KV buffer GPU to GPU (CUDA,
`pytest -m gpu`; the emulated device covers the engine's device paths in CI).

The worker imports two vLLM base classes; where vLLM is not installed (CI's venv, the GPU
machine) `_stub_vllm` stands in two empty classes for them, enough for the worker's own code.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Iterator

import pytest
import torch


def _stub_vllm() -> list[str]:
    """Stand-ins for the two vLLM classes the worker's modules import, when vLLM is missing;
    the module names added (taken out again once the worker is imported, so that nothing
    else in this process mistakes them for vLLM)."""
    if importlib.util.find_spec("vllm") is not None:
        return []
    added: list[str] = []
    for name, cls in [
        ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorMetadata"),
        ("vllm.distributed.kv_transfer.kv_connector.v1.metrics", "KVConnectorStats"),
    ]:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            module = ".".join(parts[:i])
            if module not in sys.modules:
                sys.modules[module] = types.ModuleType(module)
                added.append(module)
        setattr(sys.modules[name], cls, type(cls, (), {}))
    return added


_STUBS = _stub_vllm()

from tsukimi.config import MasterConfig  # noqa: E402
from tsukimi.integrations.vllm.config import TsukimiConnectorConfig  # noqa: E402
from tsukimi.integrations.vllm.keys import KVFormat  # noqa: E402
from tsukimi.integrations.vllm.metadata import LoadSpec, RemoteSource, SaveSpec, TsukimiConnectorMetadata  # noqa: E402
from tsukimi.integrations.vllm.worker import ConnectorWorker  # noqa: E402
from tsukimi.store.master.server import MasterServer  # noqa: E402

for _name in _STUBS:
    del sys.modules[_name]

pytestmark = pytest.mark.timeout(60)
BLOCK_SHAPE = (2, 16, 8, 64)  # K|V, block tokens, KV heads, head dim: 32 KiB in bf16
LAYERS = 4


@pytest.fixture(scope="module")
def master() -> Iterator[MasterServer]:
    with MasterServer(MasterConfig(rpc_port=0, http_port=0)) as server:
        yield server


def _worker(master: MasterServer, role: str = "kv_both", **extra: object) -> ConnectorWorker:
    config = TsukimiConnectorConfig(master=master.endpoint, segment_bytes=64 << 20, load_async=False, **extra)  # type: ignore[arg-type]
    fmt = KVFormat("test-model", "bfloat16", 16, BLOCK_SHAPE, LAYERS, "cuda:NHD")
    return ConnectorWorker(config, fmt, role)


@pytest.mark.gpu
def test_saves_and_loads_of_a_cuda_kv_cache(master: MasterServer) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    producer, consumer = _worker(master), _worker(master)
    try:
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        source = {n: torch.randn(64, *BLOCK_SHAPE, dtype=torch.bfloat16, device="cuda") for n in names}
        target = {n: torch.zeros(64, *BLOCK_SHAPE, dtype=torch.bfloat16, device="cuda") for n in names}
        producer.register_kv_caches(source)
        consumer.register_kv_caches(target)
        hashes = tuple(bytes([i]) * 32 for i in range(6))
        saved = (9, 3, 40, 41, 42, 7)
        for name in names:  # per layer, as vLLM calls it
            producer.save_kv_layer(name, [SaveSpec("r1", saved, hashes)])
        producer.wait_for_save([SaveSpec("r1", saved, hashes)])
        into = (0, 1, 2, 60, 61, 62)
        consumer.start_load_kv(_meta([LoadSpec("r2", into, hashes)]))
        assert consumer.get_block_ids_with_load_errors() == set()
        for name in names:
            assert torch.equal(target[name][list(into)], source[name][list(saved)])
        remote = RemoteSource("127.0.0.1", 1, "r0", (1, 2), "digest")
        consumer.start_load_kv(_meta([LoadSpec("r3", (5, 6), (), remote)]))
        assert consumer.get_block_ids_with_load_errors() == {5, 6}  # no producer there: recomputed
    finally:
        producer.close()
        consumer.close()


@pytest.mark.gpu
def test_pd_direct_hand_over_reads_a_cuda_kv_cache_gpu_to_gpu(master: MasterServer) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tsukimi.netio import free_port

    port = free_port()
    producer, consumer = _worker(master, role="kv_producer", pd_port=port), _worker(master, role="kv_consumer")
    try:
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        source = {n: torch.randn(32, *BLOCK_SHAPE, dtype=torch.bfloat16, device="cuda") for n in names}
        target = {n: torch.zeros(32, *BLOCK_SHAPE, dtype=torch.bfloat16, device="cuda") for n in names}
        torch.cuda.synchronize()
        producer.register_kv_caches(source)
        consumer.register_kv_caches(target)
        digest = KVFormat("test-model", "bfloat16", 16, BLOCK_SHAPE, LAYERS, "cuda:NHD").digest()
        remote = RemoteSource("127.0.0.1", port, "r9", (4, 5, 30), digest)
        consumer.start_load_kv(_meta([LoadSpec("r10", (0, 7, 8), (), remote)]))
        assert consumer.get_block_ids_with_load_errors() == set()
        torch.cuda.synchronize()
        for name in names:
            assert torch.equal(target[name][[0, 7, 8]], source[name][[4, 5, 30]])
    finally:
        producer.close()
        consumer.close()


def _meta(loads: list[LoadSpec]) -> TsukimiConnectorMetadata:
    return TsukimiConnectorMetadata(loads=loads)
