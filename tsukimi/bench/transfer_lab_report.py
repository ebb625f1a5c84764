"""The figures of `tsukimi bench transfer --lab` (tsukimi/bench/transfer_lab.py): issue 24's
goals as verdicts on ratios measured in the run, the checks that the links bound it, and the
tables.

Goals:
  two_nics_x_one           two NICs' rate / one NIC's (the worse of write and read)   >= 1.8
  failed_batches_nic_down  batches failed with b's eth1 taken down mid-run             <= 0
Checks that the figures measure the links, not the two CPUs:
  one_nic_link_busy        one NIC's link, bytes both ways x its shaped rate (write)    >= 0.8
  unshaped_x_shaped        the unshaped two-NIC write rate / the shaped one             >= 1.2
Reported, never asserted (the machine is shared: docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Mapping

from rich.table import Table

from tsukimi.bench.p2p_report import Row
from tsukimi.bench.report import FigureViews, Verdict, cells_markdown, cells_table, goal

COLUMNS = ("NICs", "op", "shaped", "batch (MiB)", "seconds", "Mbit/s", "links busy", "CPUs busy")


def _find(rows: list[Row], nics: int, op: str, shaped: bool = True) -> Row | None:
    return next((r for r in rows if (r["nics"], r["op"], r["shaped"]) == (nics, op, shaped)), None)


def _rate(row: Row | None) -> float | None:
    return None if row is None else float(str(row["mbit_s"]))


def goals(figures: Mapping[str, object]) -> list[Verdict]:
    """The goals and checks of the module's docstring (pure)."""
    rows = figures["cells"]
    assert isinstance(rows, list)
    ratios = []
    for op in ("write", "read"):
        one, two = _rate(_find(rows, 1, op)), _rate(_find(rows, 2, op))
        ratios.append(two / one if one and two else None)
    known = [r for r in ratios if r is not None]
    failure = figures["nic_failure"]
    assert isinstance(failure, dict)
    one_write, two_write, unshaped = _find(rows, 1, "write"), _rate(_find(rows, 2, "write")), None
    unshaped_rate = _rate(_find(rows, 2, "write", shaped=False))
    if unshaped_rate is not None and two_write:
        unshaped = unshaped_rate / two_write
    busy = None if one_write is None else float(str(one_write["link_busy"]))
    return [
        goal("two_nics_x_one", "two NICs x one NIC (worse of write, read)", min(known) if known else None, ">=", 1.8),
        goal("failed_batches_nic_down", "batches failed with a NIC down mid-run", float(failure["failed"]), "<=", 0),
        goal("one_nic_link_busy", "one NIC's link busy x its rate (write)", busy, ">=", 0.8),
        goal("unshaped_x_shaped", "unshaped two NICs x shaped (write): links bound", unshaped, ">=", 1.2),
    ]


def _rows(figures: Mapping[str, object]) -> list[list[str]]:
    rows = figures["cells"]
    assert isinstance(rows, list)
    return [
        [
            str(r["nics"]),
            str(r["op"]),
            "yes" if r["shaped"] else "no",
            f"{float(str(r['batch_bytes'])) / (1 << 20):g}",
            f"{float(str(r['seconds'])):.3f}",
            f"{float(str(r['mbit_s'])):.0f}",
            f"{float(str(r['link_busy'])):.2f}",
            f"{float(str(r['cpu_busy'])):.2f}",
        ]
        for r in rows
    ]


def _title(figures: Mapping[str, object]) -> str:
    topo = figures["topology"]
    assert isinstance(topo, dict)
    rate = float(str(topo["nic_rate_bps"])) / 1e6
    return f"tsukimi bench transfer --lab: hosts a and b, two NICs each, every NIC {rate:g} Mbit/s each way (tbf)"


def _failure_line(figures: Mapping[str, object]) -> str:
    failure = figures["nic_failure"]
    assert isinstance(failure, dict)
    return (
        f"b's eth1 down {failure['cut_after_s']} s into {len(failure['batches'])} batches: {failure['failed']} failed,"
        f" slowest {failure['slowest_s']} s, time lost {failure['time_lost_s']} s"
    )


def render_table(figures: Mapping[str, object]) -> Table:
    """The cells as a rich table, the failure run in its caption. Pure."""
    return cells_table(_title(figures), COLUMNS, _rows(figures), caption=_failure_line(figures))


def render_markdown(figures: Mapping[str, object]) -> str:
    """The cells as a Markdown table and the failure run in a line (docs/benchmarks.md). Pure."""
    return "\n".join([_title(figures), "", *cells_markdown(COLUMNS, _rows(figures)), "", _failure_line(figures)])


VIEWS = FigureViews(render_markdown, render_table)
