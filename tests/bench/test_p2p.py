"""`tsukimi bench p2p`: the memory check and the goals (verdicts on ratios), on loopback and
across emulated hosts (`--lab`: its config and topology). Whole runs on a tiny checkpoint (8 MiB
in 1 MiB shards, N = 1, 2; `--lab --quick`: N = 3 on 100 Mbit/s links; every receiver's bytes
verified, who served what) are tests/bench/test_reports.py's p2p and p2p-lab cases."""

from __future__ import annotations

import pytest

from tsukimi.bench.p2p import P2PBenchConfig, check_memory
from tsukimi.bench.p2p_lab import P2PLabConfig
from tsukimi.bench.p2p_lab import topology as lab_topology
from tsukimi.bench.p2p_lab_report import goals as lab_goals
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


def test_lab_goals_are_the_issues_ratios_and_the_checks_that_links_bound_the_run() -> None:
    def row(system: str, n: int, seconds: float, origin: int, **extra: float) -> dict[str, object]:
        base = {"system": system, "receivers": n, "checkpoint_bytes": GIB, "seconds": seconds, "origin_bytes": origin}
        return {**base, **extra}

    runs = [
        row("one_link", 1, 2.0, GIB, cpu_busy=0.2, origin_link_busy=0.95),
        row("tsukimi", 8, 4.0, 3 * GIB // 2, cpu_busy=0.5, origin_link_busy=0.4),
        row("naive", 8, 16.0, 8 * GIB, cpu_busy=0.3, origin_link_busy=0.96),
        row("gloo", 8, 5.0, 4 * GIB, cpu_busy=0.4, origin_link_busy=0.9),
    ]
    found = {v.name: (v.detail, v.met) for v in lab_goals(runs)}
    assert found == {
        "seconds_x_naive": ("0.25", True),
        "seconds_x_one_link": ("2", True),
        "origin_x_checkpoint": ("1.5", True),
        "seconds_x_gloo": ("0.8", True),
        "cpu_busy_tsukimi": ("0.5", True),
        "naive_origin_link_busy": ("0.96", True),
    }
    assert {v.name for v in lab_goals(runs[2:3])} == {"naive_origin_link_busy"}


def test_the_lab_bench_refuses_unshaped_links_and_names_its_hosts() -> None:
    with pytest.raises(ConfigError, match="needs shaped links"):
        P2PLabConfig(link_rate="unlimited")
    with pytest.raises(ConfigError, match="rate must look like"):
        P2PLabConfig(link_rate="fast")
    topo = lab_topology(P2PLabConfig(receivers=3, link_rate="100mbit"))
    assert [h.name for h in topo.hosts] == ["meta", "origin", "r1", "r2", "r3"]
    assert {h.links[0].rate_bps for h in topo.hosts} == {100_000_000}
