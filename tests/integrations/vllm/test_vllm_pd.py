"""PD disaggregation through tsukimi: a prefill instance (kv_producer) and a decode instance
(kv_consumer) as vLLM API servers, the proxy protocol of vLLM's toy proxy in between.

The pair also gives `tsukimi bench vllm-pd --quick`'s report (measured on it rather than on
servers of its own: a minute saved; the CLI's flags are checked in tests/bench/test_reports.py).

"direct": the consumer READs the producer's KV buffer with the Transfer Engine (block ids in
kv_transfer_params); "pool": the producer saves, the consumer loads by block hash, which is
also the across-processes case (the second instance loads what the first saved). The decode
side's own greedy tokens, computed before anything was handed over, are the reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integrations.vllm.conftest import loadable_tokens, needs_vllm, prompt
from tsukimi.netio import free_port
from tsukimi.testing.deployments import TsukimiCluster
from tsukimi.testing.vllm_server import VllmServer, VllmServerConfig, connector_config, pd_handover, start_servers

pytestmark = [needs_vllm, pytest.mark.timeout(1200)]
LENGTHS = (300, 520, 700, 1000)
# NOTE: what `tsukimi bench vllm-pd` runs its servers with: its report reads their logs
BENCH_ENV = {"VLLM_LOG_STATS_INTERVAL": "1", "TSUKIMI_LOG_LEVEL": "DEBUG"}


@pytest.fixture(scope="module")
def pd_pair(store_cluster: TsukimiCluster, vllm_logs: Path) -> Iterator[tuple[VllmServer, VllmServer]]:
    master = store_cluster.master_addr
    producer, consumer = start_servers(
        VllmServerConfig(
            connector=connector_config("kv_producer", master=master, pd_port=free_port()),
            cpus="0",
            env=BENCH_ENV,
            log_dir=vllm_logs,
        ),
        VllmServerConfig(
            connector=connector_config("kv_consumer", master=master), cpus="1", env=BENCH_ENV, log_dir=vllm_logs
        ),
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


def test_bench_vllm_pd_quick_reports_on_this_pair(pd_pair: tuple[VllmServer, VllmServer]) -> None:
    """`tsukimi bench vllm-pd --quick` (one 512-token prompt each way) measured on this pair:
    the report's shape, equal tokens, every full block loaded both ways."""
    from tests.bench.report_checks import check_report
    from tsukimi.bench import vllm_pd
    from tsukimi.bench.report import begin, finish

    start = begin("bench vllm-pd", vllm_pd.QUICK)
    figures = vllm_pd.measure(vllm_pd.QUICK, *pd_pair)
    report = check_report(finish(start, figures, vllm_pd.verdicts(figures)), "bench vllm-pd")
    assert report.figures["num_prompts"] == 1 and report.verdict("tokens_equal") is not None
    assert report.verdict("tokens_equal").met and report.verdict("all_loaded").met, report.verdicts  # type: ignore[union-attr]
    assert "| direct |" in vllm_pd.markdown(report.figures)
