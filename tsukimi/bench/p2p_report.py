"""The figures of `tsukimi bench p2p` (tsukimi/bench/p2p.py): the issue's goals as verdicts on
ratios measured in the run, and the table (rich, or Markdown for docs/benchmarks.md).

Goals, at the largest receiver count, for each transport tsukimi ran on:
  origin_x_checkpoint  bytes the origin served / checkpoint bytes     goal <= 2
  seconds_x_naive      tsukimi's completion time / naive's             goal <= 0.5
  gbps_x_gloo          tsukimi's aggregate GB/s / gloo broadcast's     goal >= 1
Reported, never asserted (the machine is shared: docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from rich.table import Table

from tsukimi.bench.report import FigureViews, Verdict, cells_markdown, goal

Row = dict[str, object]
GOALS: tuple[tuple[str, Literal["<=", ">="], float], ...] = (
    ("origin_x_checkpoint", "<=", 2.0),
    ("seconds_x_naive", "<=", 0.5),
    ("gbps_x_gloo", ">=", 1.0),
)
COLUMNS = ("system", "transport", "N", "seconds", "GB/s", "origin sent (x ckpt)", "peers sent (x ckpt)", "verified")


def _num(row: Row, key: str) -> float:
    return float(str(row[key]))


def _find(runs: list[Row], system: str, n: int, transport: str | None = None) -> Row | None:
    for row in runs:
        if row["system"] == system and row["receivers"] == n and (transport is None or row["transport"] == transport):
            return row
    return None


def goals(runs: list[Row]) -> list[Verdict]:
    """Each goal at the largest N tsukimi ran, per transport; a goal whose baseline did not
    run is left out. Pure: reads the rows only."""
    ours = [r for r in runs if r["system"] == "tsukimi"]
    if not ours:
        return []
    n = max(int(str(r["receivers"])) for r in ours)
    out: list[Verdict] = []
    for row in (r for r in ours if r["receivers"] == n):
        naive = _find(runs, "naive", n, str(row["transport"]))
        gloo = _find(runs, "gloo", n)
        values = {
            "origin_x_checkpoint": _num(row, "origin_bytes") / _num(row, "checkpoint_bytes"),
            "seconds_x_naive": _num(row, "seconds") / _num(naive, "seconds") if naive else None,
            "gbps_x_gloo": _num(row, "gbps") / _num(gloo, "gbps") if gloo else None,
        }
        for name, op, target in GOALS:
            value = values[name]
            if value is not None:
                what = f"N={n} {row['transport']}: {name}"
                out.append(goal(f"{name}_{row['transport']}", what, round(value, 3), op, target))
    return out


def _size(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):.0f} MiB"


def _cells(row: Row) -> list[str]:
    ckpt = _num(row, "checkpoint_bytes")
    return [
        str(row["system"]),
        str(row["transport"]),
        str(row["receivers"]),
        f"{_num(row, 'seconds'):.2f}",
        f"{_num(row, 'gbps'):.2f}",
        f"{_num(row, 'origin_bytes') / ckpt:.2f}",
        f"{_num(row, 'replica_bytes') / ckpt:.2f}",
        "yes" if row["verified"] else "NO",
    ]


def render_table(figures: Mapping[str, object]) -> Table:
    """The runs as a rich table (the goals are the report's verdicts). Pure."""
    runs = figures["runs"]
    assert isinstance(runs, list)
    ckpt = _size(_num(runs[0], "checkpoint_bytes")) if runs else "-"
    table = Table(title=f"tsukimi bench p2p: a {ckpt} checkpoint to N receivers (GB/s = N x bytes / s / 1e9)")
    for name in COLUMNS:
        table.add_column(name, justify="left" if name in ("system", "transport") else "right")
    for row in runs:
        table.add_row(*_cells(row))
    return table


def render_markdown(figures: Mapping[str, object]) -> str:
    """The runs as a Markdown table (what docs/benchmarks.md shows; the goals are the report's
    verdicts). Pure."""
    runs = figures["runs"]
    assert isinstance(runs, list)
    return "\n".join(cells_markdown(COLUMNS, [_cells(row) for row in runs]))


VIEWS = FigureViews(render_markdown, render_table)
