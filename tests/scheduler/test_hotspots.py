"""Hot-spot identification (tsukimi/scheduler/hotspots.py) and the Conductor spreading a hot
prefix's requests over the instances that hold a replica of it.

Costs as in test_conductor.py: prefill 1 ms per uncached token, KV at 1,000 tokens per ms."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from tsukimi.config import SIMULATOR_CONDUCTOR
from tsukimi.errors import ConfigError
from tsukimi.scheduler.conductor import Conductor, ScheduleRequest
from tsukimi.scheduler.cost_model import LinearCostModel
from tsukimi.scheduler.hotspots import HotSpotConfig, HotSpots
from tsukimi.scheduler.prefix_index import PrefixIndex, location

COST = LinearCostModel(prefill_coef=(0.0, 1e-3, 0.0), decode_coef=(0.01, 0.0, 1e-6), kv_bytes_per_token=1)
PREFIX = list(range(1, 9))  # an 8-block, 800-token system prompt
NAMES = [f"p{i}" for i in range(4)]
LOCS = {name: location(name, "dram") for name in NAMES}


def test_hot_prefix_is_the_run_of_hot_blocks_and_decays() -> None:
    spots = HotSpots(HotSpotConfig(threshold_rps=1.0, window_s=2.0, min_blocks=2))  # hot: a count >= 2
    assert spots.observe([*PREFIX, 100], now=0.0) == 0  # count 1
    assert spots.observe([*PREFIX, 101], now=0.1) == 0  # 1 * e^-0.05 + 1 = 1.95
    assert spots.observe([*PREFIX, 102], now=0.2) == len(PREFIX)  # 2.85; the unique suffix is not hot
    assert spots.observe([PREFIX[0], 999, *PREFIX[1:]], now=0.2) == 0  # a hot run of 1 < min_blocks
    assert spots.rate(PREFIX[0], 0.2) == pytest.approx((2.855 * 1 + 1) / 2.0, rel=0.01)
    assert spots.observe([*PREFIX, 103], now=60.0) == 0  # a minute later it is cold again


def test_targets_fill_up_to_max_replicas_shortest_queue_first() -> None:
    index = PrefixIndex()
    index.stored(LOCS["p2"], PREFIX)
    index.stored(LOCS["p0"], PREFIX[:4])  # a partial copy does not count
    spots = HotSpots(HotSpotConfig(max_replicas=3))
    queues = {"p0": 2.0, "p1": 1.0, "p2": 0.0, "p3": 1.0}
    assert spots.targets(index, PREFIX, LOCS, queues.__getitem__) == ["p1", "p3"]
    assert spots.targets(PrefixIndex(), PREFIX, LOCS, queues.__getitem__) == []  # no holder yet


def test_config_validation() -> None:
    with pytest.raises(ConfigError):
        HotSpotConfig(max_replicas=1)
    with pytest.raises(ConfigError):
        HotSpotConfig(threshold_rps=0)


def _burst(holders: list[str]) -> Counter[str]:
    """40 requests sharing PREFIX arrive at once; where the Conductor puts them."""
    index = PrefixIndex()
    for name in holders:
        index.stored(LOCS[name], PREFIX)
    config = dataclasses.replace(
        SIMULATOR_CONDUCTOR, block_tokens=100, kv_bandwidth_bytes_s=1e6, reuse="local", rejection="none"
    )
    conductor = Conductor(config, COST, index, NAMES, ["d0"], 1 << 30)
    placed = [conductor.schedule(ScheduleRequest(i, 900, [*PREFIX, 1000 + i]), now=0.0) for i in range(40)]
    return Counter(d.prefill for d in placed if d.prefill)


def test_conductor_spreads_a_hot_prefix_over_its_replicas() -> None:
    # one holder: every request is 100 ms there against 900 ms elsewhere, so they pile up on
    # it until its queue is 800 ms deep
    alone = _burst(["p0"])
    assert alone["p0"] >= 20
    # three replicas: the same burst is split evenly over them; the one without waits
    spread = _burst(["p0", "p1", "p2"])
    assert set(spread) <= {"p0", "p1", "p2", "p3"}
    assert max(spread[n] for n in ("p0", "p1", "p2")) - min(spread[n] for n in ("p0", "p1", "p2")) <= 1
    assert spread["p0"] < alone["p0"] / 2
