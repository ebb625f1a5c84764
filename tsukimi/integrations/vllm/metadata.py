"""What the connector's scheduler half tells its worker half each step, and the KV format both
derive from vLLM's config.

`TsukimiConnectorMetadata` is the `KVConnectorMetadata` of one step: the loads to start (from
the pool by block hash, or from a producer's KV buffer for PD), the blocks to save, and the
finished requests whose blocks a PD producer keeps for its consumer. Plain dataclasses: vLLM
may pickle them to the worker process.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from tsukimi.errors import ConfigError
from tsukimi.integrations.vllm.keys import KVFormat


@dataclass(frozen=True, slots=True)
class RemoteSource:
    """A PD producer's blocks (the `kv_transfer_params` its request_finished returned)."""

    host: str
    port: int
    request_id: str
    block_ids: tuple[int, ...]
    digest: str


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load blocks into `block_ids` (local ids, in prompt order): from the pool under
    `block_hashes`, or from `remote` (then `block_hashes` is empty and `remote.block_ids[i]`
    goes to `block_ids[i]`). No blocks and a remote: only tell the producer to let go."""

    req_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...] = ()
    remote: RemoteSource | None = None


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Put blocks `block_ids` (local ids) into the pool under `block_hashes`."""

    req_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class SendSpec:
    """A PD producer's finished request whose blocks wait for the consumer's READ."""

    req_id: str
    block_ids: tuple[int, ...]


@dataclass
class TsukimiConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]  # vLLM is untyped here
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    sends: list[SendSpec] = field(default_factory=list)


def _attention_kernel(dtype: Any, block_size: int, head_size: int, cache_dtype: str) -> str:
    """The attention kernel family that packs the KV blocks (see keys.py)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(dtype, block_size, head_size, cache_dtype)
        return f"cpu:{platform.machine()}:{isa}"
    return f"{current_platform.device_name}:NHD"


def kv_format(vllm_config: Any, kv_cache_config: Any, model_tag: str = "") -> KVFormat:
    """The KV format of this vLLM instance (the same in the scheduler and the worker).

    Raises:
        ConfigError: more than one KV cache group (hybrid models), or tensor / pipeline
            parallelism, which the connector does not handle.
    """
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(f"TsukimiConnector handles one KV cache group, this model has {len(groups)}")
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        # NOTE: each rank would hold other heads (or layers) under the same keys
        raise ConfigError("TsukimiConnector does not handle tensor or pipeline parallelism yet (keys carry no rank)")
    spec = groups[0].kv_cache_spec
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    dtype_name = str(spec.dtype).removeprefix("torch.")
    name = str(model_config.model)
    if os.path.isdir(name):  # NOTE: "./m" and "/abs/m" are one model; other hosts: set model_tag
        name = os.path.realpath(name)
    model = model_tag or f"{name}@{model_config.revision or ''}"
    kernel = _attention_kernel(spec.dtype, spec.block_size, spec.head_size, cache_config.cache_dtype)
    return KVFormat(
        model=model,
        dtype=dtype_name,
        block_size=spec.block_size,
        block_shape=(spec.num_kv_heads, spec.block_size, 2 * spec.head_size),
        num_layers=len(groups[0].layer_names),
        kernel=kernel,
        hash_algo=str(cache_config.prefix_caching_hash_algo),
    )
