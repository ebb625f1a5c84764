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
"""

from __future__ import annotations

import logging
import statistics
import tempfile
from dataclasses import asdict, dataclass
from typing import Protocol

from rich.table import Table

from tsukimi.bench.transfer import git_rev
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
class Cell:
    api: str
    value_bytes: int
    replicas: int
    tier: str = "memory"


def cells(cfg: StoreBenchConfig, tier: str = "memory") -> list[Cell]:
    if tier == "disk":
        return [Cell(a, v, 1, "disk") for v in cfg.value_bytes for a in cfg.apis]
    return [Cell(a, v, r) for v in cfg.value_bytes for a in cfg.apis for r in cfg.replicas]


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
            args = ["tsukimi.bench.store_peer", "tsukimi", self.cluster.master_addr, buffer, transport]
            env: dict[str, str] = {}
        else:
            from tsukimi.bench.mooncake_cluster import MooncakeCluster
            from tsukimi.bench.mooncake_te import MOONCAKE_ENV

            holder_bytes = cfg.disk_holder_bytes if disk_dir else cfg.holder_bytes
            self.cluster = MooncakeCluster(holder_bytes, offload_dir=disk_dir)
            args = ["tsukimi.bench.store_peer", "mooncake", self.cluster.master_addr, buffer]
            env = MOONCAKE_ENV
        try:
            self.client = JsonWorker(f"{name} store client", args, startup_timeout_s=60, env=env)
        except BaseException:
            self.cluster.close()
            raise

    def measure(self, cell: Cell, round_no: int) -> dict[str, float]:
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

    def _measure_disk(self, cell: Cell, round_no: int) -> dict[str, float]:
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


def run(cfg: StoreBenchConfig, progress: object = None) -> dict[str, object]:
    """Run every cell of every tier `repeats` times per system (alternating); the JSON report.
    A system that fails the disk tier is left out of it, its error in `disk_errors`."""
    say = progress if callable(progress) else (lambda _: None)
    samples: dict[tuple[str, Cell], list[dict[str, float]]] = {}
    small: dict[str, dict[str, float]] = {}
    errors: dict[str, str] = {}
    for tier in cfg.tiers:
        systems: list[_System] = []
        try:
            for name in _names(cfg):
                say(f"starting {name} ({tier} tier)")
                systems.append(_System(name, cfg, tier))
            for round_no in range(cfg.repeats):
                for cell in cells(cfg, tier):
                    for system in [s for s in systems if s.name not in errors or tier == "memory"]:
                        say(
                            f"round {round_no + 1}/{cfg.repeats}: {system.name} {tier} {cell.api} "
                            f"{cell.value_bytes} B x{cell.replicas}"
                        )
                        try:
                            measured = system.measure(cell, round_no)
                            samples.setdefault((system.name, cell), []).append(measured)
                        except RuntimeError as exc:
                            if tier == "memory" or system.name == "tsukimi":
                                raise
                            errors[system.name] = str(exc).splitlines()[0][:300]
            if tier == "memory":
                small = {system.name: system.small_ops() for system in systems}
        finally:
            for system in systems:
                system.close()
    results = []
    for (name, cell), runs in samples.items():
        row: dict[str, object] = {"system": name, "mode": cfg.mode if name == "tsukimi" else "tcp", **asdict(cell)}
        figures = DISK_FIGURES if cell.tier == "disk" else FIGURES
        row.update({k: round(statistics.median(r[k] for r in runs), 4) for k in figures})
        results.append(row)
    return {
        "results": results,
        "small_ops": small,
        "disk_errors": errors,
        "git_rev": git_rev(),
        "config": {**asdict(cfg), "unit": "GB/s (1e9 bytes/s), us"},
    }


def _cell_key(row: dict[str, object]) -> tuple[object, ...]:
    return row["api"], row["value_bytes"], row["replicas"], row.get("tier", "memory")


def ratios(report: dict[str, object]) -> list[dict[str, object]]:
    """tsukimi's rows with their ratio to Mooncake's same cell (throughput: higher is better)."""
    rows = report["results"]
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


def render_table(report: dict[str, object]) -> Table:
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


def _caption(report: dict[str, object]) -> str:
    small, errors = report["small_ops"], report.get("disk_errors") or {}
    assert isinstance(small, dict) and isinstance(errors, dict)
    text = "small ops p50 (us): " + "; ".join(
        f"{name}: exists {v['exists_p50_us']:.0f}, remove {v['remove_p50_us']:.0f}" for name, v in small.items()
    )
    return text + "".join(f"\n{name} disk tier not measured: {error}" for name, error in errors.items())


def render_markdown(report: dict[str, object]) -> str:
    """The report as Markdown: one row per cell, tsukimi beside Mooncake."""
    rows = report["results"]
    assert isinstance(rows, list)
    theirs = {_cell_key(r): r for r in rows if r["system"] == "mooncake"}
    lines = [
        f"git {report['git_rev']}. Throughput in GB/s (1e9 B/s); latency p50 / p99 in us. Tier disk: gets of "
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
