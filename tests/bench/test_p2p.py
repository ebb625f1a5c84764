"""`tsukimi bench p2p`: the memory check and the goals (verdicts on ratios). A whole run on a
tiny checkpoint (8 MiB in 1 MiB shards, N = 1, 2: every receiver's bytes verified, who served
what) is tests/bench/test_reports.py's p2p case."""

from __future__ import annotations

import pytest

from tsukimi.bench.p2p import P2PBenchConfig, check_memory
from tsukimi.bench.p2p_report import goals
from tsukimi.errors import ConfigError

MIB, GIB = 1 << 20, 1 << 30


def test_a_run_too_big_for_memory_is_refused_with_a_size_that_fits() -> None:
    cfg = P2PBenchConfig(receivers=(1, 8), checkpoint_bytes=GIB)
    with pytest.raises(ConfigError, match=r"needs about 1\d\.\d GiB.*try --size \d+MiB"):
        check_memory(cfg, available=8 * GIB)
    check_memory(P2PBenchConfig(receivers=(1, 2), checkpoint_bytes=64 * MIB), available=8 * GIB)


def test_goals_are_ratios_at_the_largest_receiver_count() -> None:
    def row(system: str, n: int, seconds: float, origin: int) -> dict[str, object]:
        gbps = n * GIB / seconds / 1e9
        return {
            "system": system,
            "transport": "tcp",
            "receivers": n,
            "checkpoint_bytes": GIB,
            "seconds": seconds,
            "gbps": gbps,
            "origin_bytes": origin,
        }

    runs = [
        row("tsukimi", 1, 1.0, GIB),
        row("tsukimi", 8, 4.0, 3 * GIB // 2),
        row("naive", 8, 10.0, 8 * GIB),
        row("gloo", 8, 5.0, 8 * GIB),
    ]
    found = {v.goal: (v.detail, v.met) for v in goals(runs)}
    assert found == {
        "N=8 tcp: origin_x_checkpoint <= 2": ("1.5", True),
        "N=8 tcp: seconds_x_naive <= 0.5": ("0.4", True),
        "N=8 tcp: gbps_x_gloo >= 1": ("1.25", True),
    }
    assert goals([r for r in runs if r["system"] != "tsukimi"]) == []
