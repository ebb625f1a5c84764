"""The figures of `tsukimi bench p2p --lab` (tsukimi/bench/p2p_lab.py): issue 24's goals as
verdicts on ratios measured in the run, the checks that the links bound it, and the table.

Goals (the P2P store's median round against the baselines' of the same run):
  seconds_x_naive       tsukimi's completion time / N naive readers of the origin   <= 0.3
  seconds_x_one_link    tsukimi's completion time / one reader alone (one link)     <= 2.5
  origin_x_checkpoint   bytes the origin served / checkpoint bytes                  <= 1.5
  seconds_x_gloo        tsukimi's completion time / gloo's broadcast over the links <= 1
Checks that the figures measure the links, not the two CPUs:
  naive_origin_link_busy  the origin's link in the naive rounds, x its shaped rate  >= 0.8
  cpu_busy_tsukimi        the machine's CPUs busy during tsukimi's rounds            <= 0.8
Reported, never asserted (the machine is shared: docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from rich.table import Table

from tsukimi.bench.p2p_report import Row
from tsukimi.bench.report import FigureViews, Verdict, cells_markdown, cells_table, goal

COLUMNS = (
    "system",
    "N",
    "seconds",
    "x one link",
    "origin served (x ckpt)",
    "origin link busy",
    "receiver links busy",
    "CPUs busy",
    "busiest process (x core)",
    "verified",
)


def _num(row: Row, key: str) -> float:
    return float(str(row[key]))


def _find(runs: list[Row], system: str) -> Row | None:
    return next((r for r in runs if r["system"] == system), None)


def _ratio(row: Row, other: Row | None, key: str) -> float | None:
    return _num(row, key) / _num(other, key) if other is not None else None


def goals(runs: list[Row]) -> list[Verdict]:
    """The goals and checks above; one whose baseline did not run is left out. Pure."""
    ours, naive = _find(runs, "tsukimi"), _find(runs, "naive")
    out: list[Verdict] = []
    if ours is not None:
        values: dict[str, tuple[float | None, Literal["<=", ">="], float]] = {
            "seconds_x_naive": (_ratio(ours, naive, "seconds"), "<=", 0.3),
            "seconds_x_one_link": (_ratio(ours, _find(runs, "one_link"), "seconds"), "<=", 2.5),
            "origin_x_checkpoint": (_num(ours, "origin_bytes") / _num(ours, "checkpoint_bytes"), "<=", 1.5),
            "seconds_x_gloo": (_ratio(ours, _find(runs, "gloo"), "seconds"), "<=", 1.0),
            "cpu_busy_tsukimi": (_num(ours, "cpu_busy"), "<=", 0.8),
        }
        for name, (value, op, target) in values.items():
            if value is not None:
                out.append(goal(name, f"N={ours['receivers']}: {name}", round(value, 3), op, target))
    if naive is not None:
        busy = _num(naive, "origin_link_busy")
        out.append(goal("naive_origin_link_busy", "naive: the origin's link x its rate", busy, ">=", 0.8))
    return out


def _cells(row: Row, one_link_s: float | None) -> list[str]:
    ckpt, seconds = _num(row, "checkpoint_bytes"), _num(row, "seconds")
    return [
        str(row["system"]),
        str(row["receivers"]),
        f"{seconds:.2f}",
        f"{seconds / one_link_s:.2f}" if one_link_s else "-",
        f"{_num(row, 'origin_bytes') / ckpt:.2f}",
        f"{_num(row, 'origin_link_busy'):.2f}",
        f"{_num(row, 'receiver_link_busy'):.2f}",
        f"{_num(row, 'cpu_busy'):.2f}",
        f"{_num(row, 'max_cpu_x_core'):.2f}",
        "yes" if row["verified"] else "NO",
    ]


def _rows(figures: Mapping[str, object]) -> list[list[str]]:
    runs = figures["runs"]
    assert isinstance(runs, list)
    one_link = _find(runs, "one_link")
    return [_cells(row, _num(one_link, "seconds") if one_link else None) for row in runs]


def _title(figures: Mapping[str, object]) -> str:
    topo = figures["topology"]
    assert isinstance(topo, dict)
    rate = float(str(topo["link_rate_bps"])) / 1e9
    return f"tsukimi bench p2p --lab: {len(topo['hosts'])} hosts, every link {rate:g} Gbit/s each way (tbf)"


def render_table(figures: Mapping[str, object]) -> Table:
    """The runs as a rich table (the goals are the report's verdicts). Pure."""
    return cells_table(_title(figures), COLUMNS, _rows(figures), left=("system",))


def render_markdown(figures: Mapping[str, object]) -> str:
    """The runs as a Markdown table (what docs/benchmarks.md shows). Pure."""
    return "\n".join([_title(figures), "", *cells_markdown(COLUMNS, _rows(figures))])


VIEWS = FigureViews(render_markdown, render_table)
