"""`tsukimi bench store`: put/get throughput and latency of the store, against the real
Mooncake store in the same run.

A master and two holder processes (each mounting `holder_bytes`), and a client process that
mounts nothing and measures: for each value size, single calls and batches, 1 and 2
replicas, puts then gets (every byte read is verified), then exists/remove of small keys.
Same host, holders are reached through shared memory; `force_tcp` makes every process use
tcp. With `compare_mooncake`, a `mooncake_master`, two holders and a client run the same
cells, alternating with tsukimi. Each figure is the median of `repeats` rounds.
"""

from __future__ import annotations

import logging
import statistics
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

    def __post_init__(self) -> None:
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


def cells(cfg: StoreBenchConfig) -> list[Cell]:
    return [Cell(a, v, r) for v in cfg.value_bytes for a in cfg.apis for r in cfg.replicas]


class _Cluster(Protocol):
    master_addr: str

    def close(self) -> None: ...


class _System:
    """One system's processes: a cluster and its measuring client."""

    def __init__(self, name: str, cfg: StoreBenchConfig) -> None:
        self.name = name
        self.cfg = cfg
        buffer = str(cfg.client_buffer_bytes)
        if name == "tsukimi":
            # NOTE: objects removed while leased keep their blocks until the lease ends; a short
            # lease lets each cell start from an empty pool (see measure) without long waits.
            settings = ("master.lease_ttl_s=0.5",) + (("transfer.transport=tcp",) if cfg.force_tcp else ())
            self.cluster: _Cluster = TsukimiCluster(cfg.holder_bytes, settings=settings)
            transport = "tcp" if cfg.force_tcp else "auto"
            args = ["tsukimi.bench.store_peer", "tsukimi", self.cluster.master_addr, buffer, transport]
            env: dict[str, str] = {}
        else:
            from tsukimi.bench.mooncake_cluster import MooncakeCluster
            from tsukimi.bench.mooncake_te import MOONCAKE_ENV

            self.cluster = MooncakeCluster(cfg.holder_bytes)
            args = ["tsukimi.bench.store_peer", "mooncake", self.cluster.master_addr, buffer]
            env = MOONCAKE_ENV
        try:
            self.client = JsonWorker(f"{name} store client", args, startup_timeout_s=60, env=env)
        except BaseException:
            self.cluster.close()
            raise

    def measure(self, cell: Cell, round_no: int) -> dict[str, float]:
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

    def small_ops(self) -> dict[str, float]:
        reply = self.client.call(_CALL_MARGIN_S, cmd="small_ops")
        return {k: float(v) for k, v in reply.items() if k != "ok"}

    def close(self) -> None:
        self.client.stop()
        self.cluster.close()


def run(cfg: StoreBenchConfig, progress: object = None) -> dict[str, object]:
    """Run every cell `repeats` times per system (alternating); the JSON report."""
    say = progress if callable(progress) else (lambda _: None)
    names = ["tsukimi"]
    if cfg.compare_mooncake:
        from tsukimi.bench.mooncake_cluster import mooncake_store_available

        if mooncake_store_available():
            names.append("mooncake")
        else:
            logger.warning("--compare-mooncake: the mooncake store is not installed; skipped")
    systems: list[_System] = []
    samples: dict[tuple[str, Cell], list[dict[str, float]]] = {}
    small: dict[str, dict[str, float]] = {}
    try:
        for name in names:
            say(f"starting {name}")
            systems.append(_System(name, cfg))
        for round_no in range(cfg.repeats):
            for cell in cells(cfg):
                for system in systems:
                    what = f"{system.name} {cell.api} {cell.value_bytes} B x{cell.replicas}"
                    say(f"round {round_no + 1}/{cfg.repeats}: {what}")
                    samples.setdefault((system.name, cell), []).append(system.measure(cell, round_no))
        for system in systems:
            small[system.name] = system.small_ops()
    finally:
        for system in systems:
            system.close()
    results = []
    for (name, cell), runs in samples.items():
        row: dict[str, object] = {"system": name, "mode": cfg.mode if name == "tsukimi" else "tcp", **asdict(cell)}
        row.update({k: round(statistics.median(r[k] for r in runs), 4) for k in FIGURES})
        results.append(row)
    return {"results": results, "small_ops": small, "git_rev": git_rev(),
            "config": {**asdict(cfg), "unit": "GB/s (1e9 bytes/s), us"}}  # fmt: skip


def ratios(report: dict[str, object]) -> list[dict[str, object]]:
    """tsukimi's rows with their ratio to Mooncake's same cell (throughput: higher is better)."""
    rows = report["results"]
    assert isinstance(rows, list)
    theirs = {(r["api"], r["value_bytes"], r["replicas"]): r for r in rows if r["system"] == "mooncake"}
    out = []
    for row in (r for r in rows if r["system"] == "tsukimi"):
        mc = theirs.get((row["api"], row["value_bytes"], row["replicas"]))
        entry = dict(row)
        if mc:
            entry["put_x_mooncake"] = round(float(row["put_gbps"]) / float(mc["put_gbps"]), 2)
            entry["get_x_mooncake"] = round(float(row["get_gbps"]) / float(mc["get_gbps"]), 2)
        out.append(entry)
    return out


def render_table(report: dict[str, object]) -> Table:
    table = Table(title="tsukimi bench store (medians; GB/s = 1e9 B/s)")
    for col in ("system", "mode", "api", "value", "repl", "put GB/s", "get GB/s", "put p50 us", "get p50 us",
                "put x MC", "get x MC"):  # fmt: skip
        table.add_column(col)
    rows = report["results"]
    assert isinstance(rows, list)
    by_key = {(r["api"], r["value_bytes"], r["replicas"]): r for r in ratios(report)}
    for row in rows:
        size = int(row["value_bytes"])
        label = f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"
        extra = by_key.get((row["api"], row["value_bytes"], row["replicas"]), {}) if row["system"] == "tsukimi" else {}
        table.add_row(
            str(row["system"]), str(row["mode"]), str(row["api"]), label, str(row["replicas"]),
            f"{row['put_gbps']:.3f}", f"{row['get_gbps']:.3f}", f"{row['put_p50_us']:.0f}", f"{row['get_p50_us']:.0f}",
            str(extra.get("put_x_mooncake", "-")), str(extra.get("get_x_mooncake", "-")),
        )  # fmt: skip
    small = report["small_ops"]
    assert isinstance(small, dict)
    table.caption = "small ops p50 (us): " + "; ".join(
        f"{name}: exists {v['exists_p50_us']:.0f}, remove {v['remove_p50_us']:.0f}" for name, v in small.items()
    )
    return table


def render_markdown(report: dict[str, object]) -> str:
    """The report as Markdown: one row per cell, tsukimi beside Mooncake."""
    rows = report["results"]
    small = report["small_ops"]
    assert isinstance(rows, list) and isinstance(small, dict)
    theirs = {(r["api"], r["value_bytes"], r["replicas"]): r for r in rows if r["system"] == "mooncake"}
    lines = [
        f"git {report['git_rev']}. Throughput in GB/s (1e9 B/s); latency p50 / p99 in us.",
        "",
        "| mode | api | value | repl | put GB/s | get GB/s | put p50/p99 | get p50/p99 | Mooncake put / get GB/s "
        "| put x | get x |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in (r for r in rows if r["system"] == "tsukimi"):
        size = int(row["value_bytes"])
        label = f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"
        mc = theirs.get((row["api"], row["value_bytes"], row["replicas"]))
        vs = (
            f"{mc['put_gbps']:.2f} / {mc['get_gbps']:.2f} | {row['put_gbps'] / mc['put_gbps']:.2f} "
            f"| {row['get_gbps'] / mc['get_gbps']:.2f}"
            if mc
            else "- | - | -"
        )
        lines.append(
            f"| {row['mode']} | {row['api']} | {label} | {row['replicas']} | {row['put_gbps']:.2f} | "
            f"{row['get_gbps']:.2f} | {row['put_p50_us']:.0f} / {row['put_p99_us']:.0f} | "
            f"{row['get_p50_us']:.0f} / {row['get_p99_us']:.0f} | {vs} |"
        )
    lines += ["", "Small keys, p50 (us): " + "; ".join(
        f"{name}: exists {v['exists_p50_us']:.0f}, remove {v['remove_p50_us']:.0f}" for name, v in small.items()
    )]  # fmt: skip
    return "\n".join(lines)
