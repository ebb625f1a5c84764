"""Queue, then reject (issue 17), live: `tsukimi bench kv-burst`'s burst of concurrent prompts
overflowing the decode worker's KV cache ten times over, against `tsukimi up`'s plan of the tiny
model (real worker and router processes; tsukimi/bench/kv_burst.py).

With the default TTFT SLO (30 s) every request is served, by waiting for decode KV memory, with
the same greedy tokens as one at a time; with a 2 s SLO the rejected ones (HTTP 429 ttft_slo,
saying what was predicted) are exactly those the Conductor predicted at arrival to miss it. The
predictions come from the router's decision records, by the request ids the bench sent
(`GET /decisions`). The full 64 x 1,500-token burst is a measurement (docs/benchmarks.md:
`tsukimi bench kv-burst`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from tsukimi.bench.kv_burst import BurstCluster, BurstConfig, burst_cluster, run_burst

# 16 prompts of 600 tokens + 16 output tokens (616 reserved each: 39 blocks) into 64 blocks
SMALL = BurstConfig(requests=16, prompt_tokens=600, max_tokens=16, decode_num_blocks=64)


@pytest.fixture(scope="module")
def cluster() -> Iterator[BurstCluster]:
    with burst_cluster(SMALL) as started:
        yield started


@pytest.mark.timeout(300)
def test_a_burst_overflowing_decode_kv_is_served_by_waiting(cluster: BurstCluster) -> None:
    result = run_burst(SMALL, cluster)
    figures = result.summary()
    assert result.decode_capacity_tokens == 64 * 16
    assert (figures["served"], figures["rejected"], figures["other_errors"]) == (16, 0, 0)
    assert figures["decision_records"] == 16  # every request's arrival decision, by its X-Request-Id
    assert figures["queued"] == 15  # one fits at a time
    assert figures["same_tokens_as_sequential"] is True


@pytest.mark.timeout(300)
def test_with_a_2s_ttft_slo_only_those_predicted_to_miss_it_are_rejected(cluster: BurstCluster) -> None:
    # NOTE: new prompts (no cache hits); the config's cost model (0.5 ms per prompt token, pessimistic
    # for tiny): the workers' fit leaves out the ~0.4 s each request spends outside engine steps, so
    # under load a queued request predicted at 1.9 s could wait past the 2 s deadline
    slow = dataclasses.replace(SMALL, ttft_slo_s=2.0, seed=1, prefill_token_s=0.0005)
    result = run_burst(slow, cluster)
    served = [o for o in result.outcomes if o.kind == "served"]
    rejected = [o for o in result.outcomes if o.kind == "rejected"]
    assert len(served) + len(rejected) == 16 and served and rejected
    assert all(o.predicted_ttft_s is not None for o in result.outcomes)
    assert all(o.predicted_ttft_s > 2.0 and o.reason == "ttft_slo" for o in rejected)
    assert all("> the TTFT SLO 2 s" in o.message for o in rejected)
    assert all(o.predicted_ttft_s <= 2.0 for o in served)
    assert result.same_tokens_as_sequential
