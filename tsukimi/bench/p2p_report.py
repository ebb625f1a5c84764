"""The report of `tsukimi bench p2p` (tsukimi/bench/p2p.py): the issue's goals as ratios
measured in the run, and the table (rich, or Markdown for docs/benchmarks.md).

Goals, at the largest receiver count, for each transport tsukimi ran on:
  origin_x_checkpoint  bytes the origin served / checkpoint bytes     goal <= 2
  seconds_x_naive      tsukimi's completion time / naive's             goal <= 0.5
  gbps_x_gloo          tsukimi's aggregate GB/s / gloo broadcast's     goal >= 1
Reported, never asserted (the machine is shared: docs/benchmarks.md).
"""

from __future__ import annotations

from rich.table import Table

Row = dict[str, object]
GOALS = (("origin_x_checkpoint", "<=", 2.0), ("seconds_x_naive", "<=", 0.5), ("gbps_x_gloo", ">=", 1.0))
COLUMNS = ("system", "transport", "N", "seconds", "GB/s", "origin sent (x ckpt)", "peers sent (x ckpt)", "verified")


def _num(row: Row, key: str) -> float:
    return float(str(row[key]))


def _find(runs: list[Row], system: str, n: int, transport: str | None = None) -> Row | None:
    for row in runs:
        if row["system"] == system and row["receivers"] == n and (transport is None or row["transport"] == transport):
            return row
    return None


def goals(runs: list[Row]) -> list[Row]:
    """Each goal's ratio at the largest N tsukimi ran (none when it did not run or a
    baseline is missing). Pure: reads the rows only."""
    ours = [r for r in runs if r["system"] == "tsukimi"]
    if not ours:
        return []
    n = max(int(str(r["receivers"])) for r in ours)
    out: list[Row] = []
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
            if value is None:
                continue
            met = value <= target if op == "<=" else value >= target
            out.append(
                {
                    "transport": row["transport"],
                    "receivers": n,
                    "goal": f"{name} {op} {target}",
                    "value": round(value, 3),
                    "met": met,
                }
            )
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


def _goal_line(goal: Row) -> str:
    verdict = "met" if goal["met"] else "missed"
    return f"N={goal['receivers']} {goal['transport']}: {goal['goal']}: {goal['value']} ({verdict})"


def render_table(report: dict[str, object]) -> Table:
    runs, found = report["runs"], report["goals"]
    assert isinstance(runs, list) and isinstance(found, list)
    ckpt = _size(_num(runs[0], "checkpoint_bytes")) if runs else "-"
    table = Table(title=f"tsukimi bench p2p: a {ckpt} checkpoint to N receivers (GB/s = N x bytes / s / 1e9)")
    for name in COLUMNS:
        table.add_column(name, justify="left" if name in ("system", "transport") else "right")
    for row in runs:
        table.add_row(*_cells(row))
    table.caption = "; ".join(_goal_line(g) for g in found) or None
    return table


def render_markdown(report: dict[str, object]) -> str:
    """The report as a Markdown table and a list of the goals (what docs/benchmarks.md shows)."""
    runs, found = report["runs"], report["goals"]
    assert isinstance(runs, list) and isinstance(found, list)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in runs]
    if found:
        lines += ["", *(f"- {_goal_line(g)}" for g in found)]
    lines += ["", f"git {report['git_rev']}, {report['cpus']} CPUs."]
    return "\n".join(lines)
