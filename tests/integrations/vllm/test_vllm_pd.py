"""PD disaggregation through tsukimi: a prefill instance (kv_producer) and a decode instance
(kv_consumer) as vLLM API servers, the proxy protocol of vLLM's toy proxy in between.

"direct": the consumer READs the producer's KV buffer with the Transfer Engine (block ids in
kv_transfer_params); "pool": the producer saves, the consumer loads by block hash, which is
also the across-processes case (the second instance loads what the first saved). The decode
side's own greedy tokens, computed before anything was handed over, are the reference.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integrations.vllm.conftest import loadable_tokens, needs_vllm, prompt
from tsukimi.netio import free_port
from tsukimi.testing.deployments import TsukimiCluster
from tsukimi.testing.vllm_server import VllmServer, VllmServerConfig, connector_config, pd_handover, start_servers

pytestmark = [needs_vllm, pytest.mark.timeout(1200)]
LENGTHS = (300, 520, 700, 1000)


@pytest.fixture(scope="module")
def pd_pair(store_cluster: TsukimiCluster) -> Iterator[tuple[VllmServer, VllmServer]]:
    master = store_cluster.master_addr
    producer, consumer = start_servers(
        VllmServerConfig(connector=connector_config("kv_producer", master=master, pd_port=free_port()), cpus="0"),
        VllmServerConfig(connector=connector_config("kv_consumer", master=master), cpus="1"),
    )
    try:
        yield producer, consumer
    finally:
        producer.close()
        consumer.close()


def _handover_matches_decode_alone(pd_pair: tuple[VllmServer, VllmServer], mode: str, first_seed: int) -> None:
    producer, consumer = pd_pair
    prompts = [prompt(first_seed + i, n) for i, n in enumerate(LENGTHS)]
    alone = [consumer.complete(p) for p in prompts]
    assert [r.cached_tokens for r in alone] == [0] * len(prompts)  # nothing to load yet: computed
    handed = [pd_handover(producer, consumer, p, 8, mode) for p in prompts]
    assert [decode.cached_tokens for _, decode in handed] == [loadable_tokens(n) for n in LENGTHS]
    assert [decode.token_ids for _, decode in handed] == [r.token_ids for r in alone]
    assert [prefill.token_ids[0] for prefill, _ in handed] == [r.token_ids[0] for r in alone]


def test_pd_direct_transfer_engine_read(pd_pair: tuple[VllmServer, VllmServer]) -> None:
    producer, consumer = pd_pair
    _handover_matches_decode_alone(pd_pair, "direct", 10)
    params = producer.complete(prompt(10, 300), 1, {"do_remote_decode": True, "tsukimi_pd_mode": "direct"})
    assert params.kv_transfer_params is not None
    assert params.kv_transfer_params["do_remote_prefill"] is True
    assert len(params.kv_transfer_params["remote_block_ids"]) == 300 // 128
    # direct mode saved nothing: the pool cannot have served the consumer
    assert consumer.complete(prompt(11, 520)).cached_tokens == 0
    consumer.complete(prompt(10, 300), 1, params.kv_transfer_params)  # the producer frees the blocks


def test_pd_through_the_pool_across_processes(pd_pair: tuple[VllmServer, VllmServer]) -> None:
    _handover_matches_decode_alone(pd_pair, "pool", 20)
