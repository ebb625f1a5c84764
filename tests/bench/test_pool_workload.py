"""`tsukimi bench serve --workload pool` (issue 26 item 5): the workload's families, tokens,
schedule and sizing on small made-up traces and the shipped sample (pure); the runs and
clusters it plans; and its quick variant sent to one PD cluster with the pool (module-scoped),
whose workers count the reuse from their own caches and from the pool."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from tsukimi.bench.client import CompletionRequest, CompletionResult
from tsukimi.bench.commands import add_parser
from tsukimi.bench.pool_serve import parse_sums, pool_counters, pool_settings, reuse_counters, turn_figures
from tsukimi.bench.pool_workload import (
    QUICK_POOL,
    PoolRequest,
    PoolWorkload,
    block_keys,
    families,
    pool_requests,
    prompt_tokens,
    sizing,
)
from tsukimi.bench.runners import serve_config
from tsukimi.bench.serve import ServeBenchConfig, ServeRun, planned_runs, run_pool, verdicts
from tsukimi.bench.up_cluster import launch_up
from tsukimi.errors import ConfigError
from tsukimi.serving.cluster.launcher import LaunchedCluster
from tsukimi.serving.router.decision_log import DecisionRecord
from tsukimi.sim.commands import DEFAULT_TRACE
from tsukimi.sim.trace import TraceRequest, load_trace

SAMPLE = Path(__file__).parents[2] / DEFAULT_TRACE


def _req(*hash_ids: int, length: int = 0) -> TraceRequest:
    return TraceRequest(0, length or 512 * len(hash_ids), 100, tuple(hash_ids))


# two conversations (second blocks 1 and 5) of 3 and 2 turns, a one-block request, a lone request
TRACE = [
    _req(0, 1, 2),
    _req(0, 5, 6),
    _req(0),
    _req(0, 1, 2, 3),
    _req(0, 9, 10),
    _req(0, 5, 6, 7, length=512 * 3 + 100),
    _req(0, 1, 2, 3, 4),
]
SMALL = PoolWorkload(families=2, turns=3, min_turns=2, trace_block_tokens=8, max_prompt_tokens=64, rate=4.0)


def test_families_group_the_turns_that_share_their_second_block_in_trace_order() -> None:
    found = families(TRACE, SMALL)
    assert [[r.hash_ids for r in f] for f in found] == [
        [(0, 1, 2), (0, 1, 2, 3), (0, 1, 2, 3, 4)],
        [(0, 5, 6), (0, 5, 6, 7)],
    ]
    assert [len(f) for f in families(TRACE, dataclasses.replace(SMALL, turns=2))] == [2, 2]
    # a family ends before its first request over max_prompt_tokens (4 trace blocks of 8 tokens: 32)
    short = dataclasses.replace(SMALL, max_prompt_tokens=32, families=1)
    assert [r.hash_ids for r in families(TRACE, short)[0]] == [(0, 1, 2), (0, 1, 2, 3)]
    with pytest.raises(ConfigError, match="families of >= 3"):
        families(TRACE, dataclasses.replace(SMALL, min_turns=3))


def test_the_same_hash_id_is_the_same_tokens_and_lengths_scale_with_the_block() -> None:
    first, second = prompt_tokens(_req(0, 1, 2), 8), prompt_tokens(_req(0, 1, 2, 3), 8)
    assert len(first) == 24 and len(second) == 32 and second[:24] == first
    assert prompt_tokens(_req(4, 1), 8)[8:] == first[8:16]  # hash id 1: the same 8 ids anywhere
    assert len(prompt_tokens(_req(0, 5, 6, 7, length=512 * 3 + 100), 8)) == 26  # 1636 * 8 / 512, rounded
    assert len(prompt_tokens(_req(0, 1, length=5000), 8)) == 16  # never past its blocks
    assert all(3 <= t < 250 for t in second)


def test_requests_go_round_by_round_at_the_rate() -> None:
    requests = pool_requests(TRACE, SMALL)
    assert [(r.family, r.turn) for r in requests] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]
    assert [r.at_s for r in requests] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert requests[2].prompt[:24] == requests[0].prompt and requests[4].prompt[:32] == requests[2].prompt
    assert all(r.max_tokens == SMALL.max_tokens for r in requests)
    assert pool_requests(TRACE, SMALL) == requests  # pure


def test_sizing_counts_the_distinct_full_blocks_and_gives_each_worker_a_share() -> None:
    requests = [PoolRequest(0, 0, 0, tuple(range(40)), 4), PoolRequest(1, 0, 1, tuple(range(50)), 4)]
    assert len(block_keys(requests[0].prompt, 16)) == 2  # 40 tokens: 2 full blocks
    assert block_keys(requests[1].prompt, 16)[:2] == block_keys(requests[0].prompt, 16)
    sized = sizing(requests, PoolWorkload(cache_fraction=0.5), block_tokens=16)
    # distinct: 3 (the 50-token prompt's 3 full blocks, 2 shared); largest: ceil(54 / 16) = 4
    assert (sized.working_set_blocks, sized.largest_request_blocks, sized.num_blocks) == (3, 4, 8)
    assert sizing(requests, PoolWorkload(num_blocks=5)).num_blocks == 5  # an explicit size wins
    with pytest.raises(ConfigError):
        sizing([], PoolWorkload())


def test_the_default_workload_on_the_sample_exceeds_each_cache_fourfold() -> None:
    workload = PoolWorkload()
    requests = pool_requests(load_trace(SAMPLE), workload)
    assert len({r.family for r in requests}) == 24 and all(len(r.prompt) + r.max_tokens <= 4096 for r in requests)
    assert sum(r.turn >= 1 for r in requests) >= 2 * 24  # every family reuses at least twice
    sized = sizing(requests, workload)
    assert sized.cache_fraction == pytest.approx(0.25, abs=0.01) and sized.working_set_blocks > 2000


@pytest.mark.parametrize(
    "bad",
    [{"families": 0}, {"min_turns": 1}, {"min_turns": 5, "turns": 4}, {"rate": 0.0}, {"cache_fraction": 1.5}],
)
def test_a_bad_workload_is_a_config_error(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        PoolWorkload(**bad)  # type: ignore[arg-type]


def test_the_pool_workload_runs_pd_with_the_pool_then_colocated_without() -> None:
    cfg = ServeBenchConfig(workload="pool")
    assert planned_runs(cfg) == [("pool", True, 0.0), ("no_pool", True, 0.0)]
    pool, no_pool = pool_settings("pool", "tiny", 300, 2), pool_settings("no_pool", "tiny", 300, 2)
    assert {'mode="pd"', "workers.num_blocks=300", "workers.prefill=2"} <= set(pool)
    assert {'mode="colocated"', "workers.num_blocks=300", "workers.colocated=3"} <= set(no_pool)
    figures = {"runs": {}, "pool_sizing": {}, "pool_ttft_p50_ratio": 0.4}
    assert next((v.name, v.met) for v in verdicts(figures)) == ("pool_ttft_p50", True)


def test_serve_flags_build_the_pool_workload_and_quick_shrinks_it() -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    flags = ("--families", "30", "--turns", "3", "--trace-block-tokens", "96", "--cache-fraction", "0.2")
    full = serve_config(parser.parse_args(["bench", "serve", "--workload", "pool", *flags, "--rate", "3"]))
    assert full.pool == PoolWorkload(30, 3, trace_block_tokens=96, rate=3.0, cache_fraction=0.2)
    quick = serve_config(parser.parse_args(["bench", "serve", "--workload", "pool", "--quick", "--num-blocks", "40"]))
    assert quick.pool == dataclasses.replace(QUICK_POOL, num_blocks=40)


def test_turn_figures_split_ttft_by_first_and_later_turns() -> None:
    requests = [PoolRequest(0, 0, 0, (5, 6), 1), PoolRequest(1, 0, 1, (5, 6, 7), 1), PoolRequest(2, 1, 0, (8,), 1)]

    def sent(prompt: tuple[int, ...], ttft_s: float) -> tuple[CompletionRequest, CompletionResult]:
        return CompletionRequest(prompt, 1), CompletionResult("served", 200, "", True, ttft_s, token_times_s=(ttft_s,))

    rejected = (CompletionRequest((9,), 1), CompletionResult("rejected", 429, "ttft_slo", True, 0.1))
    records = [
        DecisionRecord("a", 0.0, "pd", 2, queued=True),
        None,
        DecisionRecord("b", 0.0, "pd", 3, decode_wait_s=0.3),
    ]
    figures = turn_figures([sent((5, 6), 2.0), sent((5, 6, 7), 0.5), sent((8,), 4.0), rejected], records, requests)
    assert figures["ttft_first_turns_s"] == {"p50": 2.0, "p90": 4.0, "p99": 4.0}  # nearest rank
    assert figures["ttft_later_turns_s"] == {"p50": 0.5, "p90": 0.5, "p99": 0.5}
    assert figures["queued_before_prefill"] == 1
    assert figures["waited_at_decode"] == 1 and figures["decode_wait_s"] == {"p50": 0.3, "p90": 0.3, "p99": 0.3}


def test_parse_sums_adds_every_label_and_the_counters_total() -> None:
    text = '# HELP x\nm_total 3.0\nm 1.0\ng{segment="a"} 2.0\ng{segment="b"} 5.0\nother 9\n'
    assert parse_sums(text, {"m": "m", "g": "g", "none": "absent"}) == {"m": 4.0, "g": 7.0, "none": 0.0}


@pytest.fixture(scope="module")
def pd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedCluster]:
    settings = pool_settings("pool", "tiny", 62, 1)  # NOTE: QUICK_POOL's sizing on the sample
    with launch_up(settings, tmp_path_factory.mktemp("pool")) as cluster, cluster.tending():
        yield cluster


def test_quick_pool_workload_reuses_from_the_cache_and_the_pool(pd_cluster: LaunchedCluster) -> None:
    requests = pool_requests(load_trace(SAMPLE), QUICK_POOL)
    assert sizing(requests, QUICK_POOL).num_blocks == 62
    run = ServeRun("pool")
    asyncio.run(run_pool(pd_cluster.api, "tiny", requests, run))
    figures = run.figures({})
    assert (figures["requests"], figures["completed"], figures["errors"]) == (8, 8, 0)
    reused = reuse_counters(pd_cluster.processes)
    assert set(reused) == {f"{role}_{source}_tokens" for role in ("prefill", "decode") for source in ("local", "pool")}
    assert reused["prefill_local_tokens"] + reused["prefill_pool_tokens"] == figures["cached_prompt_tokens"] > 0
    assert reused["decode_pool_tokens"] > 0  # the hand-over
    store = pool_counters(pd_cluster.master)
    assert store["objects"] > 0 and store["evictions"] == 0 and store["used_bytes"] <= store["capacity_bytes"]
