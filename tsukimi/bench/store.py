"""`tsukimi bench store`: put/get throughput and latency of the store, against the real
Mooncake store in the same run.

A master and two holder processes (each mounting `holder_bytes`), and a client process that
mounts nothing and measures: for each value size, single calls and batches, 1 and 2
replicas, puts then gets (every byte read is verified), then exists/remove of small keys.
Same host, holders are reached through shared memory; `force_tcp` makes every process use
tcp. With `compare_mooncake`, a `mooncake_master`, two holders and a client run the same
cells, alternating with tsukimi. Each figure is the median of `repeats` rounds.

Tiers: the cells above read objects in memory (tier "memory"). Tier "disk" reads objects
that live only on a holder's disk: a second cluster whose holders (`disk_holder_bytes` of
memory each) have disks, where the client puts its objects, pushes them out of memory by
putting filler, then gets them (gets get; puts are not measured). tsukimi runs it with
promotion off, so every get reads the disk; Mooncake with offload on eviction
(mooncake_cluster.py, `offload_dir`).

Goals (issue 12), as the report's verdicts, tier memory, vs Mooncake in the same run: on one
host (shm) 1 MiB and 16 MiB puts and gets >= 3x Mooncake; with `--force-tcp` >= 1x; `exists` p50
at most Mooncake's. n/a without `--compare-mooncake` (or without Mooncake installed).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Protocol

from rich.table import Table

from tsukimi.bench.child import module_args
from tsukimi.bench.measure import Spread, repeat
from tsukimi.bench.report import BenchReport, FigureViews, Verdict, begin, finish, goal
from tsukimi.errors import ConfigError
from tsukimi.testing.deployments import TsukimiCluster
from tsukimi.testing.processes import JsonWorker

logger = logging.getLogger(__name__)

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
FIGURES = ("put_gbps", "get_gbps", "put_p50_us", "put_p99_us", "get_p50_us", "get_p99_us")
DISK_FIGURES = ("get_gbps", "get_p50_us", "get_p99_us", "stayed_on_disk")
TIERS = ("memory", "disk")
_CALL_MARGIN_S = 120.0


@dataclass(frozen=True, slots=True)
class StoreBenchConfig:
    value_bytes: tuple[int, ...] = (4 * KIB, 64 * KIB, MIB, 4 * MIB, 16 * MIB)
    apis: tuple[str, ...] = ("single", "batch")
    replicas: tuple[int, ...] = (1, 2)
    batch: int = 16
    holder_bytes: int = GIB
    duration_s: float = 0.5
    repeats: int = 3
    force_tcp: bool = False
    compare_mooncake: bool = False
    tiers: tuple[str, ...] = TIERS
    disk_holder_bytes: int = 64 * MIB

    def __post_init__(self) -> None:
        if not self.tiers or not set(self.tiers) <= set(TIERS) or self.disk_holder_bytes < 16 * MIB:
            raise ConfigError(f"tiers must be some of {', '.join(TIERS)}; disk_holder_bytes >= 16 MiB")
        if not set(self.apis) <= {"single", "batch"} or not self.apis:
            raise ConfigError("apis must be single and/or batch")
        if any(r not in (1, 2) for r in self.replicas) or not self.replicas:
            raise ConfigError("replicas must be 1 and/or 2 (two holders)")
        if not self.value_bytes or min(self.value_bytes) < 1 or max(self.value_bytes) > 64 * MIB:
            raise ConfigError("value sizes must be within 1 B..64 MiB")
        if self.batch < 1 or self.duration_s <= 0 or self.repeats < 1 or self.holder_bytes < 64 * MIB:
            raise ConfigError("batch >= 1, duration > 0, repeats >= 1, holder_bytes >= 64 MiB")

    @property
    def client_buffer_bytes(self) -> int:
        return self.batch * max(self.value_bytes)

    @property
    def mode(self) -> str:
        return "tcp" if self.force_tcp else "shm"


@dataclass(frozen=True, slots=True)
class StoreCell:
    api: str
    value_bytes: int
    replicas: int
    tier: str = "memory"


def cells(cfg: StoreBenchConfig, tier: str = "memory") -> list[StoreCell]:
    if tier == "disk":
        return [StoreCell(a, v, 1, "disk") for v in cfg.value_bytes for a in cfg.apis]
    return [StoreCell(a, v, r) for v in cfg.value_bytes for a in cfg.apis for r in cfg.replicas]


class _Cluster(Protocol):
    master_addr: str

    def close(self) -> None: ...


class _System:
    """One system's processes: a cluster and its measuring client."""

    def __init__(self, name: str, cfg: StoreBenchConfig, tier: str = "memory") -> None:
        self.name = name
        self.cfg = cfg
        self.tier = tier
        self._disks = tempfile.TemporaryDirectory(prefix="tsukimi-bench-disk-") if tier == "disk" else None
        disk_dir = self._disks.name if self._disks is not None else ""
        buffer = str(cfg.client_buffer_bytes)
        if name == "tsukimi":
            # NOTE: objects removed while leased keep their blocks until the lease ends; a short
            # lease lets each cell start from an empty pool (see measure) without long waits.
            settings = ("master.lease_ttl_s=0.5",) + (("transfer.transport=tcp",) if cfg.force_tcp else ())
            settings += ("master.promotion_on_hit=false",) if disk_dir else ()  # NOTE: every get reads the disk
            holder_bytes = cfg.disk_holder_bytes if disk_dir else cfg.holder_bytes
            self.cluster: _Cluster = TsukimiCluster(holder_bytes, settings=settings, disk_dir=disk_dir)
            transport = "tcp" if cfg.force_tcp else "auto"
            args = module_args("store-client", "tsukimi", self.cluster.master_addr, buffer, transport)
            env: dict[str, str] = {}
        else:
            from tsukimi.bench.mooncake_cluster import MooncakeCluster
            from tsukimi.bench.mooncake_te import MOONCAKE_ENV

            holder_bytes = cfg.disk_holder_bytes if disk_dir else cfg.holder_bytes
            self.cluster = MooncakeCluster(holder_bytes, offload_dir=disk_dir)
            args = module_args("store-client", "mooncake", self.cluster.master_addr, buffer)
            env = MOONCAKE_ENV
        try:
            self.client = JsonWorker(f"{name} store client", args, startup_timeout_s=60, env=env)
        except BaseException:
            self.cluster.close()
            raise

    def measure(self, cell: StoreCell, round_no: int) -> dict[str, float]:
        if cell.tier == "disk":
            return self._measure_disk(cell, round_no)
        batch = self.cfg.batch if cell.api == "batch" else 1
        pool = 2 * self.cfg.holder_bytes
        reply = self.client.call(
            2 * self.cfg.duration_s + _CALL_MARGIN_S,
            cmd="measure",
            prefix=f"r{round_no}-{cell.api}-{cell.value_bytes}-{cell.replicas}",
            value_bytes=cell.value_bytes,
            batch=batch,
            replicas=cell.replicas,
            duration_s=self.cfg.duration_s,
            max_stored_bytes=max(batch * cell.value_bytes, int(0.4 * pool / cell.replicas)),
        )
        if isinstance(self.cluster, TsukimiCluster):
            self.cluster.wait_drained()
        return {k: float(reply[k]) for k in FIGURES}

    def _measure_disk(self, cell: StoreCell, round_no: int) -> dict[str, float]:
        batch = self.cfg.batch if cell.api == "batch" else 1
        reply = self.client.call(
            4 * self.cfg.duration_s + 2 * _CALL_MARGIN_S,
            cmd="measure_disk",
            prefix=f"d{round_no}-{cell.api}-{cell.value_bytes}",
            value_bytes=cell.value_bytes,
            batch=batch,
            duration_s=self.cfg.duration_s,
            target_bytes=max(batch * cell.value_bytes, 16 * MIB),
            fill_bytes=8 * self.cfg.disk_holder_bytes,
        )
        return {k: float(reply[k]) for k in DISK_FIGURES}

    def small_ops(self) -> dict[str, float]:
        reply = self.client.call(_CALL_MARGIN_S, cmd="small_ops")
        return {k: float(v) for k, v in reply.items() if k != "ok"}

    def close(self) -> None:
        self.client.stop()
        self.cluster.close()
        if self._disks is not None:
            self._disks.cleanup()


def _names(cfg: StoreBenchConfig) -> list[str]:
    names = ["tsukimi"]
    if cfg.compare_mooncake:
        from tsukimi.bench.mooncake_cluster import mooncake_store_available

        if mooncake_store_available():
            names.append("mooncake")
        else:
            logger.warning("--compare-mooncake: the mooncake store is not installed; skipped")
    return names


def run(cfg: StoreBenchConfig, progress: Callable[[str], None] = lambda _: None) -> dict[str, object]:
    """Run every cell of every tier `repeats` times per system (alternating); the figures.
    A system that fails the disk tier is left out of it, its error in `disk_errors`."""
    samples: dict[tuple[str, StoreCell], list[dict[str, float]]] = {}
    small: dict[str, dict[str, float]] = {}
    errors: dict[str, str] = {}
    for tier in cfg.tiers:
        systems: list[_System] = []
        try:
            for name in _names(cfg):
                progress(f"starting {name} ({tier} tier)")
                systems.append(_System(name, cfg, tier))

            def one_round(round_no: int, tier: str = tier, systems: list[_System] = systems) -> None:
                for cell in cells(cfg, tier):
                    for system in [s for s in systems if s.name not in errors or tier == "memory"]:
                        progress(
                            f"round {round_no + 1}/{cfg.repeats}: {system.name} {tier} {cell.api} "
                            f"{cell.value_bytes} B x{cell.replicas}"
                        )
                        try:
                            samples.setdefault((system.name, cell), []).append(system.measure(cell, round_no))
                        except RuntimeError as exc:
                            if tier == "memory" or system.name == "tsukimi":
                                raise
                            errors[system.name] = str(exc).splitlines()[0][:300]

            repeat(one_round, repeats=cfg.repeats)
            if tier == "memory":
                small = {system.name: system.small_ops() for system in systems}
        finally:
            for system in systems:
                system.close()
    results = []
    for (name, cell), runs in samples.items():
        row: dict[str, object] = {"system": name, "mode": cfg.mode if name == "tsukimi" else "tcp", **asdict(cell)}
        figures = DISK_FIGURES if cell.tier == "disk" else FIGURES
        row.update({k: round(Spread.of(r[k] for r in runs).median, 4) for k in figures})
        results.append(row)
    return {"results": results, "small_ops": small, "disk_errors": errors, "unit": "GB/s (1e9 bytes/s), us"}


def verdicts(figures: Mapping[str, object], force_tcp: bool) -> list[Verdict]:
    """The issue-12 goals (see the module), each the worst of its cells (pure)."""
    rows = ratios(figures)
    target = 1.0 if force_tcp else 3.0
    where = "tcp" if force_tcp else "same host"
    out = []
    for size, label in ((MIB, "1mib"), (16 * MIB, "16mib")):
        values = [
            float(str(r[k]))
            for r in rows
            if r["value_bytes"] == size and r.get("tier", "memory") == "memory"
            for k in ("put_x_mooncake", "get_x_mooncake")
            if k in r
        ]
        what = f"{where}, {_label(size)} put and get: tsukimi / Mooncake"
        out.append(goal(f"{label}_vs_mooncake", what, min(values) if values else None, ">=", target))
    small = figures["small_ops"]
    assert isinstance(small, dict)
    ours, theirs = small.get("tsukimi") or {}, small.get("mooncake") or {}
    exists = ours["exists_p50_us"] / theirs["exists_p50_us"] if ours and theirs else None
    out.append(goal("exists_vs_mooncake", "exists p50: tsukimi / Mooncake", exists, "<=", 1.0))
    return out


def run_report(cfg: StoreBenchConfig, progress: Callable[[str], None] = lambda _: None) -> BenchReport:
    """`tsukimi bench store`: run (see `run`) and report, with the goals as verdicts."""
    start = begin("bench store", cfg)
    figures = run(cfg, progress)
    return finish(start, figures, verdicts(figures, cfg.force_tcp))


def _cell_key(row: dict[str, object]) -> tuple[object, ...]:
    return row["api"], row["value_bytes"], row["replicas"], row.get("tier", "memory")


def ratios(figures: Mapping[str, object]) -> list[dict[str, object]]:
    """tsukimi's rows with their ratio to Mooncake's same cell (throughput: higher is better)."""
    rows = figures["results"]
    assert isinstance(rows, list)
    theirs = {_cell_key(r): r for r in rows if r["system"] == "mooncake"}
    out = []
    for row in (r for r in rows if r["system"] == "tsukimi"):
        mc = theirs.get(_cell_key(row))
        entry = dict(row)
        if mc and "put_gbps" in row:
            entry["put_x_mooncake"] = round(float(row["put_gbps"]) / float(mc["put_gbps"]), 2)
        if mc:
            entry["get_x_mooncake"] = round(float(row["get_gbps"]) / float(mc["get_gbps"]), 2)
        out.append(entry)
    return out


def _label(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"


def _figure(row: dict[str, object], name: str, fmt: str) -> str:
    return format(float(str(row[name])), fmt) if name in row else "-"


def render_table(report: Mapping[str, object]) -> Table:
    table = Table(title="tsukimi bench store (medians; GB/s = 1e9 B/s; tier disk: objects only on a holder's disk)")
    for col in (
        "system",
        "mode",
        "tier",
        "api",
        "value",
        "repl",
        "put GB/s",
        "get GB/s",
        "put p50 us",
        "get p50 us",
        "put x MC",
        "get x MC",
    ):
        table.add_column(col)
    rows = report["results"]
    assert isinstance(rows, list)
    by_key = {_cell_key(r): r for r in ratios(report)}
    for row in rows:
        extra = by_key.get(_cell_key(row), {}) if row["system"] == "tsukimi" else {}
        table.add_row(
            str(row["system"]),
            str(row["mode"]),
            str(row.get("tier", "memory")),
            str(row["api"]),
            _label(int(row["value_bytes"])),
            str(row["replicas"]),
            _figure(row, "put_gbps", ".3f"),
            _figure(row, "get_gbps", ".3f"),
            _figure(row, "put_p50_us", ".0f"),
            _figure(row, "get_p50_us", ".0f"),
            str(extra.get("put_x_mooncake", "-")),
            str(extra.get("get_x_mooncake", "-")),
        )
    table.caption = _caption(report)
    return table


def _caption(report: Mapping[str, object]) -> str:
    small, errors = report["small_ops"], report.get("disk_errors") or {}
    assert isinstance(small, dict) and isinstance(errors, dict)
    text = "small ops p50 (us): " + "; ".join(
        f"{name}: exists {v['exists_p50_us']:.0f}, remove {v['remove_p50_us']:.0f}" for name, v in small.items()
    )
    return text + "".join(f"\n{name} disk tier not measured: {error}" for name, error in errors.items())


def render_markdown(report: Mapping[str, object]) -> str:
    """The figures as Markdown: one row per cell, tsukimi beside Mooncake (pure)."""
    rows = report["results"]
    assert isinstance(rows, list)
    theirs = {_cell_key(r): r for r in rows if r["system"] == "mooncake"}
    lines = [
        "Throughput in GB/s (1e9 B/s); latency p50 / p99 in us. Tier disk: gets of "
        "objects that live only on a holder's disk (puts not measured).",
        "",
        "| mode | tier | api | value | repl | put GB/s | get GB/s | put p50/p99 | get p50/p99 "
        "| Mooncake put / get GB/s | put x | get x |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in (r for r in rows if r["system"] == "tsukimi"):
        mc = theirs.get(_cell_key(row))
        put = "put_gbps" in row
        vs = "- | - | -"
        if mc:
            put_x = f"{float(row['put_gbps']) / float(mc['put_gbps']):.2f}" if put else "-"
            vs = (
                f"{_figure(mc, 'put_gbps', '.2f')} / {float(mc['get_gbps']):.2f} | {put_x} | "
                f"{float(row['get_gbps']) / float(mc['get_gbps']):.2f}"
            )
        put_lat = f"{row['put_p50_us']:.0f} / {row['put_p99_us']:.0f}" if put else "-"
        lines.append(
            f"| {row['mode']} | {row.get('tier', 'memory')} | {row['api']} | {_label(int(row['value_bytes']))} | "
            f"{row['replicas']} | {_figure(row, 'put_gbps', '.2f')} | {float(row['get_gbps']):.2f} | {put_lat} | "
            f"{row['get_p50_us']:.0f} / {row['get_p99_us']:.0f} | {vs} |"
        )
    lines += ["", _caption(report).replace("\n", "\n\n")]
    return "\n".join(lines)


VIEWS = FigureViews(render_markdown, render_table)
