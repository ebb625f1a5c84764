"""The one report every `tsukimi bench ...` command builds, and how it is printed and read back.

    start = begin("bench cpp", cfg)          the command, its configuration, the load average now
    ... run the bench ...
    report = finish(start, figures, verdicts) the revision, the host, the load average now, the
                                               figures and verdicts, plus `quiet_machine`
    print_report(report, "json" | "markdown" | "table", console, views)
    BenchReport.from_json(text)               the same report back (what tests and scripts read)

A report holds: `command` ("bench transfer"), `configuration` (the bench's config as plain
JSON), `revision` (the git revision of the checkout the package runs from, "unknown" outside
one), `host` (CPU count, 1/5/15-minute load averages at the start and at the end, the device,
Python's and torch's versions), `figures` (the bench's numbers, plain JSON) and `verdicts`
(each goal the docs state, met True / False, or None when the run could not tell).

Every report carries the verdict `quiet_machine`: a run whose 1-minute load average at its
start or end exceeded the CPU count says "loaded machine: figures not comparable with quiet
runs" (met False), so loaded and quiet numbers are never mixed silently. Benchmarks never
assert speed: verdicts are reported, not enforced.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Literal

import msgspec
from rich.console import Console, RenderableType
from rich.markdown import Markdown
from rich.table import Table

from tsukimi.errors import ProtocolError

OutputFormat = Literal["json", "markdown", "table"]
Figures = Mapping[str, object]
QUIET_MACHINE = "quiet_machine"
LOADED = "loaded machine: figures not comparable with quiet runs"


class Verdict(msgspec.Struct, frozen=True):
    """One goal: its `name`, the `goal` in words ("k = 2 TTFT <= 0.65x k = 1"), whether the run
    `met` it (None: it could not tell, e.g. a baseline did not run) and the `detail` (the value)."""

    name: str
    goal: str
    met: bool | None
    detail: str = ""


class HostFacts(msgspec.Struct, frozen=True):
    """The machine a report was measured on. Load averages are (1, 5, 15)-minute ones; `device`
    is "cpu" or the CUDA device torch sees; `torch` is "" when torch is not installed."""

    cpus: int
    load_avg_start: tuple[float, float, float]
    load_avg_end: tuple[float, float, float]
    device: str
    python: str
    torch: str
    platform: str


class BenchReport(msgspec.Struct, frozen=True):
    """What one `tsukimi bench ...` run measured (see the module)."""

    command: str
    configuration: dict[str, object]
    revision: str
    host: HostFacts
    figures: dict[str, object]
    verdicts: list[Verdict]

    def to_json(self) -> str:
        """The report as one line of JSON (NaN figures become null). Pure."""
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> BenchReport:
        """Parses what `to_json` (or `tsukimi bench ... --json`) printed.

        Raises:
            ProtocolError: not JSON, or not a report (names the field that is wrong).
        """
        try:
            return _DECODER.decode(text)
        except msgspec.DecodeError as exc:  # NOTE: ValidationError is a DecodeError
            raise ProtocolError(f"not a bench report: {exc}") from exc

    def verdict(self, name: str) -> Verdict | None:
        """The verdict called `name` (None when the report has none). Pure."""
        return next((v for v in self.verdicts if v.name == name), None)


_DECODER = msgspec.json.Decoder(BenchReport)


@dataclass(frozen=True, slots=True)
class ReportStart:
    """What `begin` notes before a bench runs: the command, its configuration (plain JSON) and
    the load average then."""

    command: str
    configuration: dict[str, object]
    load_avg: tuple[float, float, float]


def begin(command: str, configuration: object) -> ReportStart:
    """Notes the start of a bench run.

    Args:
        command: what ran, as typed after `tsukimi` ("bench store").
        configuration: the bench's config: a dataclass, a msgspec Struct or a mapping (made
            plain JSON here: tuples become lists, paths strings).
    """
    plain = _plain(configuration)
    return ReportStart(command, plain if isinstance(plain, dict) else {"value": plain}, os.getloadavg())


def finish(start: ReportStart, figures: object, verdicts: Sequence[Verdict] = ()) -> BenchReport:
    """The report of a run begun with `start`: its figures (made plain JSON), its verdicts and
    `quiet_machine` after them. Reads the host's state (load average, device) now."""
    host = host_facts(start.load_avg, os.getloadavg())
    plain = _plain(figures)
    return BenchReport(
        start.command,
        start.configuration,
        git_revision(),
        host,
        plain if isinstance(plain, dict) else {"value": plain},
        [*verdicts, quiet_machine(host)],
    )


def goal(name: str, what: str, value: float | None, op: Literal["<=", ">="], target: float) -> Verdict:
    """The verdict "`what` `op` `target`" on a measured `value` (None: not measured). Pure."""
    text = f"{what} {op} {target:g}"
    if value is None or value != value:
        return Verdict(name, text, None, "not measured in this run")
    return Verdict(name, text, value <= target if op == "<=" else value >= target, f"{value:.4g}")


def quiet_machine(host: HostFacts) -> Verdict:
    """Whether the 1-minute load average stayed within the CPU count at both ends of the run. Pure."""
    start, end = host.load_avg_start[0], host.load_avg_end[0]
    loads = f"1-min load average {start:.2f} at the start, {end:.2f} at the end, {host.cpus} CPUs"
    met = max(start, end) <= host.cpus
    goal_text = "1-min load average <= CPU count at the start and the end"
    return Verdict(QUIET_MACHINE, goal_text, met, loads if met else f"{LOADED} ({loads})")


def host_facts(load_start: tuple[float, float, float], load_end: tuple[float, float, float]) -> HostFacts:
    """This machine's facts (reads the environment; see `device_name` on importing torch)."""
    return HostFacts(
        os.cpu_count() or 1,
        _rounded(load_start),
        _rounded(load_end),
        device_name(),
        platform.python_version(),
        _version("torch"),
        platform.platform(terse=True),
    )


def device_name() -> str:
    """ "cpu", or the name of the CUDA device torch sees. NOTE: torch is imported only when it
    already was or an NVIDIA driver is present (importing it costs seconds on a CPU host)."""
    if "torch" not in sys.modules and not Path("/proc/driver/nvidia/version").exists():
        return "cpu"
    try:
        import torch
    except ImportError:
        return "cpu"
    return str(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else "cpu"


def git_revision() -> str:
    """The git revision of the checkout this package runs from, `-dirty` when its tracked files
    differ from it; "unknown" outside a checkout of tsukimi (a wheel installed in a venv that
    happens to sit inside some other repository reports "unknown", not that repository's)."""
    git = shutil.which("git")
    if git is None:
        return "unknown"
    package = Path(__file__).resolve().parent.parent  # NOTE: the tsukimi package, not a repository path

    def run(*args: str) -> str:
        try:
            out = subprocess.run([git, *args], cwd=package, capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    top = run("rev-parse", "--show-toplevel")
    if not top or not (Path(top) / package.name / "__init__.py").is_file():
        return "unknown"
    if not (Path(top) / package.name).samefile(package):
        return "unknown"
    return run("describe", "--always", "--dirty", "--abbrev=7") or "unknown"


@dataclass(frozen=True, slots=True)
class FigureViews:
    """How one bench shows its figures: `markdown` (the tables docs/benchmarks.md holds) and a
    rich `table`; without them the figures are shown as Markdown, or as a list of key: value."""

    markdown: Callable[[Figures], str] | None = None
    table: Callable[[Figures], RenderableType] | None = None


def print_report(report: BenchReport, fmt: OutputFormat, console: Console, views: FigureViews | None = None) -> None:
    """Prints `report`: "json" one line on stdout, "markdown" on stdout, "table" on `console`
    (the header, the figures, the verdicts). Writes only; mutates nothing."""
    views = views or FigureViews()
    if fmt == "json":
        print(report.to_json(), flush=True)
    elif fmt == "markdown":
        print(render_markdown(report, views), flush=True)
    else:
        console.print(header(report), highlight=False)
        console.print(_figures_renderable(report.figures, views))
        console.print(verdict_table(report.verdicts))


def output_format(json_flag: bool, markdown_flag: bool) -> OutputFormat:
    """The format the flags `--json` / `--markdown` ask for (neither: a table). Pure."""
    return "json" if json_flag else "markdown" if markdown_flag else "table"


def header(report: BenchReport) -> str:
    """One line: the command, the revision and the host (pure)."""
    h = report.host
    torch = f", torch {h.torch}" if h.torch else ""
    return (
        f"`tsukimi {report.command}`, git {report.revision}, {h.cpus} CPUs, load average "
        f"{h.load_avg_start[0]:.2f} -> {h.load_avg_end[0]:.2f}, device {h.device}, Python {h.python}{torch}."
    )


def render_markdown(report: BenchReport, views: FigureViews | None = None) -> str:
    """The report as Markdown: the header, the bench's figures, the verdicts (pure)."""
    views = views or FigureViews()
    figures = views.markdown(report.figures) if views.markdown else generic_markdown(report.figures)
    rows = [f"| {v.name} | {v.goal} | {_met(v.met)} | {v.detail} |" for v in report.verdicts]
    return "\n".join([header(report), "", figures, "", "| verdict | goal | met | detail |", "|---|---|---|---|", *rows])


def cells_table(
    title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], left: Sequence[str] = (), caption: str = ""
) -> Table:
    """A rich table of text cells: `columns` right-aligned but those named in `left`. Pure."""
    table = Table(title=title, caption=caption or None)
    for name in columns:
        table.add_column(name, justify="left" if name in left else "right")
    for cells in rows:
        table.add_row(*cells)
    return table


def cells_markdown(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The lines of a Markdown table of text cells. Pure."""
    return [
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
        *("| " + " | ".join(c) + " |" for c in rows),
    ]


def verdict_table(verdicts: Sequence[Verdict]) -> Table:
    """The verdicts as a rich table (pure)."""
    table = Table(title="verdicts")
    for column in ("verdict", "goal", "met", "detail"):
        table.add_column(column)
    for v in verdicts:
        table.add_row(v.name, v.goal, _met(v.met), v.detail)
    return table


def generic_markdown(figures: Figures) -> str:
    """Figures without a view of their own: one `| figure | value |` row per key (pure)."""
    lines = ["| figure | value |", "|---|---|"]
    lines += [f"| {key} | {json.dumps(value)[:300]} |" for key, value in figures.items()]
    return "\n".join(lines)


def _figures_renderable(figures: Figures, views: FigureViews) -> RenderableType:
    if views.table is not None:
        return views.table(figures)
    return Markdown(views.markdown(figures) if views.markdown else generic_markdown(figures))


def _met(met: bool | None) -> str:
    return "n/a" if met is None else "yes" if met else "NO"


def _plain(value: object) -> object:
    """`value` as plain JSON types (dataclasses and Structs as dicts, tuples as lists)."""
    return msgspec.to_builtins(value, enc_hook=str)


def _rounded(load: tuple[float, ...]) -> tuple[float, float, float]:
    a, b, c = (round(x, 2) for x in load[:3])
    return a, b, c


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""
