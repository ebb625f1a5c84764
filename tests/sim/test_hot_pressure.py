"""Hot-spot replication under cache pressure (tsukimi/sim/hotspots.py, instances.py): a prefill
cache evicts its cold blocks before hot ones, so replicas of hot prompts stay resident while
unique prompts pass through, and several hot prompts competing for small caches get a lower
p90 TTFT with replication on (docs/reproduction.md section 5c)."""

from __future__ import annotations

import dataclasses

import pytest

from tsukimi.config import SIMULATOR_CONDUCTOR, SimConfig
from tsukimi.eviction import LruPolicy
from tsukimi.scheduler.hotspots import HotSpotConfig
from tsukimi.scheduler.prefix_index import PrefixIndex
from tsukimi.sim.hotspots import SkewedWorkload, p90_ttft_s, skewed_trace
from tsukimi.sim.instances import BlockCache
from tsukimi.sim.simulator import simulate


def _cache(hot: set[int] | None) -> BlockCache:
    cache = BlockCache("p/dram", 4, LruPolicy(), PrefixIndex())
    if hot is not None:
        cache.hot = hot.__contains__
    return cache


def test_cold_blocks_are_evicted_before_hot_ones() -> None:
    cache = _cache({1, 2})
    cache.access([1, 2])  # the hot prefix, least recently used from now on
    cache.access([3, 4])
    cache.access([5, 6])
    assert sorted(cache.policy.victims()) == [1, 2, 5, 6]
    assert cache.index.match_at("p/dram", [1, 2]) == 2
    assert cache.hot_evictions == 0


def test_without_hot_blocks_eviction_is_plain_lru() -> None:
    cache = _cache(None)
    cache.access([1, 2])
    cache.access([3, 4])
    cache.access([5, 6])
    assert sorted(cache.policy.victims()) == [3, 4, 5, 6]


def test_hot_blocks_go_when_nothing_cold_is_left() -> None:
    cache = _cache({1, 2, 3, 4})
    cache.access([1, 2, 3, 4])
    cache.access([5, 6])  # the request's own blocks always fit: two hot ones go, LRU first
    # NOTE: a chain is inserted last to first, so its tail (4, then 3) is the least recent
    assert sorted(cache.policy.victims()) == [1, 2, 5, 6]
    assert cache.hot_evictions == 2


SIM = SimConfig(num_prefill=16, num_decode=4, cache_blocks=48)  # room for ~2.5 of 3 prompts
CONDUCTOR = dataclasses.replace(SIMULATOR_CONDUCTOR, rejection="none", kv_bandwidth_bytes_s=25e9)


def _shared_p90(seed: int, hot: HotSpotConfig | None) -> float:
    workload = SkewedWorkload(requests=1500, rate_rps=40, shared=0.95, phase_s=20, ramp_s=10, seed=seed, prompts=3)
    jobs = simulate(skewed_trace(workload), SIM, CONDUCTOR, hot=hot).jobs
    return p90_ttft_s([j for j in jobs if j.input_tokens == 18 * 512])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replication_lowers_shared_p90_under_cache_pressure(seed: int) -> None:
    assert _shared_p90(seed, HotSpotConfig()) < _shared_p90(seed, None)
