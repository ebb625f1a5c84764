"""`tsukimi bench prefix-link`'s pure parts (tsukimi/bench/prefix_link.py, prefix_link_report.py):
the Conductor's estimates of fetching a pooled prefix vs recomputing it, and the verdicts. The
bench itself runs in tests/bench/test_reports.py (a lab of two hosts)."""

from __future__ import annotations

from typing import cast

import pytest

from tsukimi.bench.prefix_link import PrefixLinkConfig
from tsukimi.bench.prefix_link_estimate import Estimate, RequestShape, conductor_estimate
from tsukimi.bench.prefix_link_report import goals, render_markdown
from tsukimi.errors import ConfigError
from tsukimi.scheduler.block_hash import BlockHash
from tsukimi.scheduler.cost_model import CostModel, LinearCostModel

SHAPE = RequestShape(2048, 64, 512, 512, tuple(BlockHash(h) for h in (11, 12, 13, 14)))
# NOTE: 1 ms a token, no fixed or attention cost; 40 000 B of KV a token: the prefix is 81.92 MB
COST = cast(CostModel, LinearCostModel((0.0, 1e-3, 0.0), (0.0, 0.0, 0.0), 40_000))


def test_the_conductor_recomputes_where_the_link_is_slower_than_the_engine() -> None:
    # the engine computes 1000 tokens/s = 40 MB/s of KV: below that, recompute wins
    slow = conductor_estimate(SHAPE, COST, 20e6)
    assert _rounded(slow) == Estimate("recompute", 4.16, 4.096, 2.112, 1.0)
    fast = conductor_estimate(SHAPE, COST, 80e6, slowdown=1.5)
    assert _rounded(fast) == Estimate("fetch", 1.088, 1.024, 2.112, 1.5)
    assert (fast.of("fetch"), fast.of("recompute")) == (fast.fetch_s, fast.recompute_s)


def _rounded(e: Estimate) -> Estimate:
    return Estimate(e.pick, round(e.fetch_s, 6), round(e.transfer_s, 6), round(e.recompute_s, 6), e.slowdown)


def _row(rate: str, bytes_s: float, fetch: tuple[float, float], recompute: tuple[float, float], pick: str) -> dict:
    """A link's figures: (measured, estimated) TTFT of each option."""
    return {
        "link_rate": rate,
        "link_bytes_s": bytes_s,
        "prefix_bytes": 81_920_000,
        "fetch_bytes_s": 0.95 * bytes_s,
        "fetch_x_link": 0.95,
        "fetch_ttft_s": fetch[0],
        "recompute_ttft_s": recompute[0],
        "fetch_error": fetch[1] / fetch[0] - 1,
        "recompute_error": recompute[1] / recompute[0] - 1,
        "faster": "fetch" if fetch[0] < recompute[0] else "recompute",
        "estimate": {"pick": pick, "fetch_s": fetch[1], "recompute_s": recompute[1]},
        "load_avg_1m": 0.5,
    }


def test_verdicts_judge_the_estimates_and_the_picks_per_link() -> None:
    slow = _row("50mbit", 6.25e6, (16.0, 15.0), (7.0, 6.9), "recompute")
    fast = _row("400mbit", 50e6, (2.5, 1.9), (7.0, 6.9), "fetch")  # NOTE: estimate 24 % low
    met = {v.name: v.met for v in goals([fast, slow])}
    assert met == {
        "fetch_error_400mbit": False,
        "recompute_error_400mbit": True,
        "link_bound_400mbit": True,
        "fetch_error_50mbit": True,
        "recompute_error_50mbit": True,
        "link_bound_50mbit": True,
        "slow_link_recompute": True,
        "fast_link_fetch": True,
    }
    wrong = _row("50mbit", 6.25e6, (16.0, 15.0), (7.0, 6.9), "fetch")
    assert {v.name: v.met for v in goals([wrong, fast])}["slow_link_recompute"] is False
    figures = {"model": "tiny", "input_tokens": 2112, "kv_bytes_per_token": 40_000, "links": [slow, fast]}
    table = render_markdown(figures)
    assert "| 50mbit |" in table and "| 400mbit |" in table and "-24.0%" in table


def test_config_refuses_partial_blocks_and_unshaped_links() -> None:
    with pytest.raises(ConfigError, match="whole blocks"):
        PrefixLinkConfig(prefix_tokens=1000)
    with pytest.raises(ConfigError, match="shaped links"):
        PrefixLinkConfig(link_rates=("unlimited",))
