"""The figures of `tsukimi bench hot-lab` (tsukimi/bench/hot_lab.py): the verdict on p90 TTFT
with hot-key replication off and on, the checks that the links bound the run, and the table.

  p90_ttft_on_x_off        p90 TTFT on / off (lower with replication on)            <= 1
  busiest_holder_link_off  the off run's busiest holder link, x its shaped rate      >= 0.6
                           (over the whole run, Poisson gaps included: the default
                           workload offers 0.72 of h1's link, `offered_load_x_link`)
  cpu_busy_on              the machine's CPUs busy during the on run                 <= 0.8
                           (other users' work included: the machine is shared)
  holder_cpu_max           the busiest holder process, either run, x one core        <= 0.5
Reported, never asserted (the machine is shared: docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Mapping

from rich.table import Table

from tsukimi.bench.p2p_report import Row
from tsukimi.bench.report import FigureViews, Verdict, cells_markdown, cells_table, goal

COLUMNS = (
    "hot_threshold",
    "p50 TTFT s",
    "p90 TTFT s",
    "p90 shared s",
    "mean fetch s",
    "hot replications",
    "prefix replicas",
    "MiB served per holder",
    "busiest holder link",
    "holder CPU (x core)",
    "CPUs busy",
)


def _num(row: Row, key: str) -> float:
    return float(str(row[key]))


def goals(runs: list[Row]) -> list[Verdict]:
    """The verdict and checks above on the runs [off, on]. Pure."""
    off, on = runs
    return [
        goal(
            "p90_ttft_on_x_off",
            "p90 TTFT lower with replication on: p90 on / off",
            round(_num(on, "p90_ttft_s") / _num(off, "p90_ttft_s"), 3),
            "<=",
            1.0,
        ),
        goal(
            "busiest_holder_link_off",
            "off: the busiest holder's link x its rate",
            _num(off, "busiest_holder_link_busy"),
            ">=",
            0.6,
        ),
        goal("cpu_busy_on", "on: the machine's CPUs busy", _num(on, "cpu_busy"), "<=", 0.8),
        goal("holder_cpu_max", "the busiest holder process x one core", _holder_cpu(runs), "<=", 0.5),
    ]


def _holder_cpu(runs: list[Row]) -> float:
    cpus = [row["holder_cpu_x_core"] for row in runs]
    return max(float(c) for cpu in cpus if isinstance(cpu, dict) for c in cpu.values())


def _cells(row: Row) -> list[str]:
    served = row["holder_link_bytes"]
    assert isinstance(served, dict)
    replicas = row["prefix_replicas_at_end"]
    assert isinstance(replicas, list)
    shared = row["p90_shared_ttft_s"]
    fetch = row["mean_fetch_s"]
    cpu = row["holder_cpu_x_core"]
    assert isinstance(cpu, dict)
    return [
        f"{_num(row, 'hot_threshold'):g}" + (" (off)" if _num(row, "hot_threshold") == 0 else " (on)"),
        f"{_num(row, 'p50_ttft_s'):.3f}",
        f"{_num(row, 'p90_ttft_s'):.3f}",
        "-" if shared is None else f"{float(str(shared)):.3f}",
        "-" if fetch is None else f"{float(str(fetch)):.3f}",
        f"{_num(row, 'hot_replications'):g}",
        "/".join(map(str, replicas)),
        " / ".join(f"{int(b) / (1 << 20):.0f}" for b in served.values()),
        f"{_num(row, 'busiest_holder_link_busy'):.2f}",
        " / ".join(f"{float(c):.2f}" for c in cpu.values()),
        f"{_num(row, 'cpu_busy'):.2f}",
    ]


def _rows(figures: Mapping[str, object]) -> list[list[str]]:
    runs = figures["runs"]
    assert isinstance(runs, list)
    return [_cells(row) for row in runs]


def _title(figures: Mapping[str, object]) -> str:
    topo = figures["topology"]
    assert isinstance(topo, dict)
    roles = topo["roles"]
    assert isinstance(roles, dict)
    rate = float(str(topo["link_rate_bps"])) / 1e6
    return (
        f"tsukimi bench hot-lab: master on {roles['master+writer']}, {len(roles['holders'])} holders, "
        f"{len(roles['readers'])} readers, one host each; every link {rate:g} Mbit/s each way (tbf), tcp"
    )


def render_table(figures: Mapping[str, object]) -> Table:
    """The runs as a rich table (the verdicts are the report's). Pure."""
    return cells_table(_title(figures), COLUMNS, _rows(figures))


def render_markdown(figures: Mapping[str, object]) -> str:
    """The runs as a Markdown table (what docs/benchmarks.md shows). Pure."""
    return "\n".join([_title(figures), "", *cells_markdown(COLUMNS, _rows(figures))])


VIEWS = FigureViews(render_markdown, render_table)
