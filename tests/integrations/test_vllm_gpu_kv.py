"""TsukimiConnector's worker with its KV cache on a device (worker.py): pool saves and loads of
vLLM's per-layer layout [blocks, 2, block_tokens, kv_heads, head_dim] through the store's device
path (CUDA, `pytest -m gpu`), and PD direct hand-over refused (ConfigError) on a producer whose
cache is not in host memory (a meta-device cache stands for it in CI).

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
from tsukimi.errors import ConfigError  # noqa: E402
from tsukimi.integrations.vllm.config import TsukimiConnectorConfig  # noqa: E402
from tsukimi.integrations.vllm.keys import KVFormat  # noqa: E402
from tsukimi.integrations.vllm.metadata import LoadSpec, RemoteSource, SaveSpec  # noqa: E402
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


def test_a_pd_producer_refuses_a_device_kv_cache(master: MasterServer) -> None:
    worker = _worker(master, role="kv_producer", pd_port=1)
    try:
        caches = {
            f"layers.{i}.attn": torch.empty(8, *BLOCK_SHAPE, dtype=torch.bfloat16, device="meta") for i in range(LAYERS)
        }
        with pytest.raises(ConfigError, match="PD direct hand-over of a GPU KV cache"):
            worker.register_kv_caches(caches)
    finally:
        worker.close()


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
        assert consumer.get_block_ids_with_load_errors() == {5, 6}  # direct: recomputed
    finally:
        producer.close()
        consumer.close()


def _meta(loads: list[LoadSpec]) -> object:
    from tsukimi.integrations.vllm.metadata import TsukimiConnectorMetadata

    return TsukimiConnectorMetadata(loads=loads)
