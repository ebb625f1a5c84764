"""`TsukimiConnector`: vLLM's KV cache on tsukimi's store, and PD disaggregation through it.

Load it into vLLM by module path (no vLLM change)::

    python -m vllm.entrypoints.openai.api_server --model .models/tiny --no-enable-prefix-caching \\
      --kv-transfer-config '{"kv_connector": "TsukimiConnector",
        "kv_connector_module_path": "tsukimi.integrations.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"master": "tcp://127.0.0.1:50051"}}'

Roles: "kv_both" looks up, loads and saves; "kv_producer" (PD prefill) saves to the pool
(pd_mode "pool") or keeps its blocks for the consumer to READ (pd_mode "direct");
"kv_consumer" (PD decode) loads from the pool or from the producer named in the request's
`kv_transfer_params`. `kv_connector_extra_config` keys: tsukimi/integrations/vllm/config.py
(master, metadata, transport, segment_bytes, rpc_timeout_s, retry_s, load_async,
save_per_layer, checksum, pd_mode, pd_host, pd_port, pd_lease_s, model_tag); docs/vllm.md.

Set `kv_load_failure_policy` to "recompute": vLLM's default ("fail") turns a block that
vanished from the pool into a failed request instead of recomputing it. Objects are keyed
`vllm/{format digest}/{block hash}/{layer}` (keys.py). This class only routes vLLM's calls to
the scheduler half (scheduler.py) or the worker half (worker.py).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tsukimi.integrations.vllm.config import TsukimiConnectorConfig
from tsukimi.integrations.vllm.metadata import TsukimiConnectorMetadata, kv_format
from tsukimi.integrations.vllm.scheduler import ConnectorScheduler
from tsukimi.integrations.vllm.stats import TsukimiConnectorStats
from tsukimi.integrations.vllm.worker import ConnectorWorker

logger = logging.getLogger(__name__)


def _log_through_vllm() -> None:
    """tsukimi's log lines go where vLLM's go (its handlers, INFO), unless tsukimi logs
    somewhere already; with TSUKIMI_LOG_LEVEL set (e.g. DEBUG: a line per load), to stderr at
    that level."""
    ours = logging.getLogger("tsukimi")
    if ours.handlers:
        return
    level = os.environ.get("TSUKIMI_LOG_LEVEL", "")
    if level:
        stream = logging.StreamHandler()
        stream.setFormatter(logging.Formatter("%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"))
        ours.addHandler(stream)
    else:
        for handler in logging.getLogger("vllm").handlers:
            ours.addHandler(handler)
    ours.setLevel(level.upper() or logging.INFO)
    ours.propagate = False


class TsukimiConnector(KVConnectorBase_V1):  # type: ignore[misc]  # vLLM is untyped here
    """vLLM KV connector (v1 API) over tsukimi's store and Transfer Engine."""

    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_through_vllm()
        transfer = vllm_config.kv_transfer_config
        self._config = TsukimiConnectorConfig.from_extra(dict(transfer.kv_connector_extra_config or {}))
        fmt = kv_format(vllm_config, kv_cache_config, self._config.model_tag)
        kv_role = str(transfer.kv_role)
        if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
            logger.warning("kv_load_failure_policy is not 'recompute': a block lost from the pool fails its request")
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ConnectorScheduler(self._config, fmt, kv_role, str(transfer.engine_id))
        else:
            self._worker = ConnectorWorker(self._config, fmt, kv_role)
        logger.info(
            "TsukimiConnector %s (%s), master %s, format %s", kv_role, role.name, self._config.master, fmt.digest()
        )

    # -- scheduler side ----------------------------------------------------------------

    def _sched(self) -> ConnectorScheduler:
        assert self._scheduler is not None, "a scheduler-side call on the worker connector"
        return self._scheduler

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> TsukimiConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    # -- worker side -------------------------------------------------------------------

    def _work(self) -> ConnectorWorker:
        assert self._worker is not None, "a worker-side call on the scheduler connector"
        return self._worker

    def _meta(self) -> TsukimiConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TsukimiConnectorMetadata)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._work().start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # NOTE: loads are whole requests between steps (async) or done in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self.has_connector_metadata():
            self._work().save_kv_layer(layer_name, self._meta().saves)

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self._work().wait_for_save(self._meta().saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._work().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> TsukimiConnectorStats | None:
        return self._worker.stats.take() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TsukimiConnectorStats | None:
        return TsukimiConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._scheduler is not None:
            self._scheduler.close()
            self._scheduler = None
