"""The figures of `tsukimi bench prefix-link` (tsukimi/bench/prefix_link.py): issue 24's goals
as verdicts, the check that the link bounds the fetch, and the table.

Per link rate R (the Conductor's estimates at the shaped rate, each request's made just before
it ran; an error is the median over the requests of estimated / measured - 1, the table's
estimates the medians of the estimates):
  fetch_error_R        |that error| of the pooled-prefix TTFT                   <= 0.2
  recompute_error_R    the same for recomputing the prefix                      <= 0.2
  link_bound_R         the prefix's read rate / the shaped rate                 >= 0.8
Over the rates:
  slow_link_recompute  at the slowest link the Conductor picks recompute, and recompute is
                       measured faster (met: both)
  fast_link_fetch      at the fastest link it picks fetch, and fetch is measured faster
(its pick: the most frequent over the requests' decisions; `picks` counts them all)
Reported, never asserted (the machine is shared: docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Mapping

from rich.table import Table

from tsukimi.bench.report import FigureViews, Verdict, cells_markdown, cells_table, goal

Row = dict[str, object]
COLUMNS = (
    "link",
    "read rate (x link)",
    "fetch TTFT",
    "est. fetch",
    "error",
    "recompute TTFT",
    "est. recompute",
    "error",
    "Conductor picks",
    "faster",
    "load (1 min)",
)


def _num(row: Mapping[str, object], key: str) -> float:
    return float(str(row[key]))


def _estimate(row: Row) -> Mapping[str, object]:
    estimate = row["estimate"]
    assert isinstance(estimate, dict)
    return estimate


def _picked(row: Row, choice: str) -> Verdict:
    """Whether the Conductor picks `choice` at this link and `choice` is measured faster."""
    pick, faster = _estimate(row)["pick"], row["faster"]
    name = "slow_link_recompute" if choice == "recompute" else "fast_link_fetch"
    what = f"{row['link_rate']}: the Conductor picks {choice} and {choice} is measured faster"
    fetch_s, recompute_s = _num(row, "fetch_ttft_s"), _num(row, "recompute_ttft_s")
    detail = f"picks {pick}; measured fetch {fetch_s:.3g} s, recompute {recompute_s:.3g} s"
    return Verdict(name, what, pick == choice and faster == choice, detail)


def goals(links: list[Row]) -> list[Verdict]:
    """The goals and checks above (pure)."""
    out: list[Verdict] = []
    for row in links:
        rate = row["link_rate"]
        for mode in ("fetch", "recompute"):
            what, error = f"{rate}: |estimated / measured {mode} TTFT - 1|", abs(_num(row, f"{mode}_error"))
            out.append(goal(f"{mode}_error_{rate}", what, error, "<=", 0.2))
        what, bound = f"{rate}: the prefix's read rate x the shaped rate", _num(row, "fetch_x_link")
        out.append(goal(f"link_bound_{rate}", what, bound, ">=", 0.8))
    if links:
        by_rate = sorted(links, key=lambda r: _num(r, "link_bytes_s"))
        out.append(_picked(by_rate[0], "recompute"))
        if len(by_rate) > 1:
            out.append(_picked(by_rate[-1], "fetch"))
    return out


def _cells(row: Row) -> list[str]:
    estimate = _estimate(row)
    return [
        str(row["link_rate"]),
        f"{_num(row, 'fetch_bytes_s') / 1e6:.1f} MB/s ({_num(row, 'fetch_x_link'):.2f})",
        f"{_num(row, 'fetch_ttft_s'):.3f} s",
        f"{_num(estimate, 'fetch_s'):.3f} s",
        f"{_num(row, 'fetch_error'):+.1%}",
        f"{_num(row, 'recompute_ttft_s'):.3f} s",
        f"{_num(estimate, 'recompute_s'):.3f} s",
        f"{_num(row, 'recompute_error'):+.1%}",
        str(estimate["pick"]),
        str(row["faster"]),
        f"{_num(row, 'load_avg_1m'):.2f}",
    ]


def _title(figures: Mapping[str, object]) -> str:
    kv = _num(figures, "kv_bytes_per_token")
    links = figures["links"]
    assert isinstance(links, list)
    prefix = _num(links[0], "prefix_bytes") / 2**20 if links else 0.0
    return (
        f"tsukimi bench prefix-link: {figures['model']}, {figures['input_tokens']}-token prompts, "
        f"the pooled prefix {prefix:.1f} MiB ({kv:g} B of KV a token), store and prefill on two hosts, "
        "estimates at the shaped rate"
    )


def render_table(figures: Mapping[str, object]) -> Table:
    """The links as a rich table (the goals are the report's verdicts). Pure."""
    links = figures["links"]
    assert isinstance(links, list)
    return cells_table(_title(figures), COLUMNS, [_cells(row) for row in links], left=("link",))


def render_markdown(figures: Mapping[str, object]) -> str:
    """The links as a Markdown table (what docs/benchmarks.md shows). Pure."""
    links = figures["links"]
    assert isinstance(links, list)
    return "\n".join([_title(figures), "", *cells_markdown(COLUMNS, [_cells(row) for row in links])])


VIEWS = FigureViews(render_markdown, render_table)
