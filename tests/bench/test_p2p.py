"""`tsukimi bench p2p` on a tiny checkpoint (8 MiB in 1 MiB shards, N = 1, 2): the JSON shape,
every receiver's bytes verified, who served what; the memory check and the goal ratios."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tsukimi.bench.p2p import P2PBenchConfig, check_memory
from tsukimi.bench.p2p_report import goals
from tsukimi.bench.report import BenchReport
from tsukimi.errors import ConfigError

MIB, GIB = 1 << 20, 1 << 30
CKPT = 8 * MIB


@pytest.mark.timeout(90)
def test_bench_p2p_json_every_system_verified() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tsukimi.cli",
            "bench",
            "p2p",
            "--json",
            "--receivers",
            "1,2",
            "--size",
            "8MiB",
            "--shard",
            "1MiB",
            "--timeout",
            "60",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=85,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    report = BenchReport.from_json(out.stdout)
    runs = report.figures["runs"]
    assert isinstance(runs, list)
    assert [(r["system"], r["receivers"]) for r in runs] == [
        (system, n) for n in (1, 2) for system in ("tsukimi", "naive", "gloo")
    ]
    for row in runs:
        assert {"system", "receivers", "checkpoint_bytes", "seconds", "gbps", "origin_bytes"} <= set(row)
        assert row["checkpoint_bytes"] == CKPT and row["seconds"] > 0 and row["verified"] is True
        assert row["gbps"] == pytest.approx(row["receivers"] * CKPT / row["seconds"] / 1e9, rel=1e-2)
        if row["system"] == "naive":
            assert row["origin_bytes"] == row["receivers"] * CKPT and row["replica_bytes"] == 0
        elif row["system"] == "tsukimi":
            assert row["origin_bytes"] + row["replica_bytes"] == row["receivers"] * CKPT
            assert row["origin_bytes"] >= CKPT  # NOTE: every shard leaves the origin at least once
        else:  # gloo: what rank 0 wrote, at least one copy of the checkpoint
            assert row["origin_bytes"] >= CKPT
        assert row["transport"] == "tcp"
    goals_run = {v.name for v in report.verdicts} - {"quiet_machine"}
    assert goals_run == {"origin_x_checkpoint_tcp", "seconds_x_naive_tcp", "gbps_x_gloo_tcp"}


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
