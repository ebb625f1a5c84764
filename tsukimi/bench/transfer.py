"""`tsukimi bench transfer`: Transfer Engine throughput between two processes on loopback.

For each cell (transport, op, block size, batch, connections) the initiator process runs
whole batches against the target process for a duration after a warm-up. In the same run it
measures the raw limits (a plain socket stream of 4 MiB sendall / recv_into between two
processes; numpy memcpy) and its peers on the same cells, alternating with tsukimi:
`cma-raw` (one process_vm_readv/writev per batch from Python, the kernel's floor for
same-host copies), with --compare-nixl NIXL itself (UCX, one prepared handle re-posted every
batch, no progress thread: bench/nixl_peer.py), with --compare-mooncake the real Mooncake TE
(TCP, P2P handshake). `cma+prepared` rows run `TransferEngine.prepare`d requests (validated
and routed once, like NIXL's re-posted handle). Each figure is the median of --repeats
rounds, in GB/s (1e9 B/s) (tsukimi/bench/measure.py).

Goals (issue 12), as the report's verdicts: same host, 64 KiB blocks, `auto` >= 1.0x NIXL
(read and write); 1-16 MiB, same host, `auto` >= 0.8x memcpy; tcp 64 KiB >= 1.0x Mooncake TE
tcp; tcp 4 MiB >= 0.9x the raw socket. Each is the worst of its rows; n/a when a peer did not run.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from rich.table import Table

from tsukimi.bench.child import module_args
from tsukimi.bench.measure import Spread, repeat
from tsukimi.bench.mooncake_te import MooncakePair, mooncake_available
from tsukimi.bench.nixl_peer import nixl_available
from tsukimi.bench.report import BenchReport, FigureViews, Verdict, begin, finish, goal
from tsukimi.errors import ConfigError
from tsukimi.testing.processes import JsonWorker

logger = logging.getLogger(__name__)

KIB, MIB = 1 << 10, 1 << 20
_CALL_MARGIN_S = 60.0
TRANSPORTS = ("auto", "shm", "cma", "cma+prepared", "tcp", "nixl")
# NOTE: these cells target the peer's plain process memory (as NIXL's cells do); the others
# its shared memory (which auto then moves over shm)
ANON_CELLS = ("cma", "cma+prepared", "cma-raw", "nixl")


@dataclass(frozen=True, slots=True)
class TransferBenchConfig:
    transports: tuple[str, ...] = ("auto", "shm", "cma", "cma+prepared", "tcp")
    ops: tuple[str, ...] = ("write", "read")
    block_bytes: tuple[int, ...] = (64 * KIB, MIB, 4 * MIB, 16 * MIB)
    batch: int = 4
    connections: tuple[int, ...] = (1, 4)
    duration_s: float = 2.0
    warmup_s: float = 0.5
    repeats: int = 3
    compare_mooncake: bool = False
    compare_nixl: bool = False

    def __post_init__(self) -> None:
        for t in self.transports:
            if t not in TRANSPORTS:
                raise ConfigError(f"transport must be one of {', '.join(TRANSPORTS)}, got {t!r}")
        for op in self.ops:
            if op not in ("read", "write"):
                raise ConfigError(f"op must be read or write, got {op!r}")
        if not self.block_bytes or min(self.block_bytes) < 4 * KIB or max(self.block_bytes) > 256 * MIB:
            raise ConfigError("block sizes must be within 4 KiB..256 MiB")
        if not 1 <= self.batch <= 256 or any(not 1 <= c <= 64 for c in self.connections):
            raise ConfigError("batch must be in 1..256 and connections in 1..64")
        if self.duration_s <= 0 or self.warmup_s < 0 or self.repeats < 1:
            raise ConfigError("duration must be > 0, warm-up >= 0, repeats >= 1")

    @property
    def buffer_bytes(self) -> int:
        return self.batch * max(self.block_bytes)


@dataclass(frozen=True, slots=True)
class TransferCell:
    transport: str
    op: str
    block_bytes: int
    batch: int
    connections: int


@dataclass(slots=True)
class TransferBenchResult:
    config: TransferBenchConfig
    results: list[dict[str, object]] = field(default_factory=list)
    peers: list[dict[str, object]] = field(default_factory=list)  # cma-raw, nixl: same fields
    mooncake: list[dict[str, object]] | None = None
    socket_gbps: float = 0.0
    memcpy_gbps: float = 0.0


def cells(cfg: TransferBenchConfig) -> list[TransferCell]:
    out: list[TransferCell] = []
    for transport in cfg.transports:
        conns = cfg.connections if transport == "tcp" else (1,)
        for op in cfg.ops:
            for block in cfg.block_bytes:
                out.extend(TransferCell(transport, op, block, cfg.batch, c) for c in conns)
    return out


def peer_cells(cfg: TransferBenchConfig, with_nixl: bool) -> list[TransferCell]:
    """The peers' cells: raw CMA always, NIXL when compared (same ops, blocks, batch)."""
    names = ("cma-raw", "nixl") if with_nixl else ("cma-raw",)
    return [
        TransferCell(name, op, block, cfg.batch, 1) for name in names for op in cfg.ops for block in cfg.block_bytes
    ]


def own_code_env(pythonpath: str | None = None) -> dict[str, str]:
    """The environment that makes a `python -m tsukimi.bench.child ...` child import the
    tsukimi this process imported, whatever its working directory holds: this checkout first
    on PYTHONPATH (`pythonpath`, default the current one, after it) and PYTHONSAFEPATH=1.

    NOTE: `python -m` puts the working directory on sys.path ahead of PYTHONPATH, so a bench
    started in one checkout with another on PYTHONPATH measured the other in its driver but
    the working directory's code in its peers (issue 27's "before" figures were the plan
    memo's own: docs/benchmarks.md). PYTHONSAFEPATH leaves the working directory out."""
    tree = str(Path(__file__).resolve().parents[2])  # the checkout holding this tsukimi package
    rest = os.environ.get("PYTHONPATH", "") if pythonpath is None else pythonpath
    return {"PYTHONSAFEPATH": "1", "PYTHONPATH": os.pathsep.join(p for p in (tree, rest) if p)}


def memcpy_gbps(nbytes: int = 256 * MIB, seconds: float = 1.0) -> float:
    """numpy copy bandwidth between two large arrays (bytes copied per second)."""
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)  # fault the pages in
    samples: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(samples) < 3:
        start = time.perf_counter()
        np.copyto(dst, src)
        samples.append(nbytes / (time.perf_counter() - start) / 1e9)
    return Spread.of(samples).median


def socket_gbps(seconds: float) -> float:
    """A plain Python socket stream between two processes: 4 MiB sendall -> recv_into."""
    sink = JsonWorker("socket sink", module_args("transfer-peer", "sink"), env=own_code_env())
    try:
        source = JsonWorker(
            "socket source",
            module_args("transfer-peer", "source", str(sink.ready["port"]), str(seconds)),
            env=own_code_env(),
        )
        try:
            source.read_reply(seconds + _CALL_MARGIN_S)
        finally:
            source.stop()
        return float(sink.read_reply(_CALL_MARGIN_S)["gbps"])
    finally:
        sink.stop()


class TsukimiPair:
    """A target and an initiator process running tsukimi Transfer Engines."""

    def __init__(self, buffer_bytes: int, metadata_url: str = "p2p", nixl: bool = False) -> None:
        args = [str(buffer_bytes), metadata_url]
        env = {"TSUKIMI_BENCH_NIXL": "1" if nixl else "0", **own_code_env()}
        self.target = JsonWorker("tsukimi target", module_args("transfer-peer", "target", *args), env=env)
        try:
            self.initiator = JsonWorker("tsukimi initiator", module_args("transfer-peer", "initiator", *args), env=env)
        except BaseException:
            self.target.stop()
            raise

    def measure(self, cell: TransferCell, duration_s: float, warmup_s: float) -> float:
        reply = self.initiator.call(
            duration_s + warmup_s + _CALL_MARGIN_S,
            name=self.target.ready["name"],
            base=self.target.ready["anon_base" if cell.transport in ANON_CELLS else "base"],
            pid=self.target.ready["pid"],
            transport=cell.transport,
            op=cell.op,
            block_bytes=cell.block_bytes,
            batch=cell.batch,
            connections=cell.connections,
            duration_s=duration_s,
            warmup_s=warmup_s,
        )
        return float(reply["gbps"])

    def close(self) -> None:
        self.initiator.stop()
        self.target.stop()


class NixlPair:
    """NIXL itself in two processes (bench/nixl_peer.py)."""

    def __init__(self, buffer_bytes: int) -> None:
        env = own_code_env()
        self.target = JsonWorker("nixl target", module_args("nixl-peer", "target", str(buffer_bytes)), env=env)
        try:
            self.initiator = JsonWorker(
                "nixl initiator", module_args("nixl-peer", "initiator", str(buffer_bytes)), env=env
            )
        except BaseException:
            self.target.stop()
            raise

    def measure(self, cell: TransferCell, duration_s: float, warmup_s: float) -> float:
        reply = self.initiator.call(
            duration_s + warmup_s + _CALL_MARGIN_S,
            metadata=self.target.ready["metadata"],
            base=self.target.ready["base"],
            op=cell.op,
            block_bytes=cell.block_bytes,
            batch=cell.batch,
            duration_s=duration_s,
            warmup_s=warmup_s,
        )
        return float(reply["gbps"])

    def close(self) -> None:
        self.initiator.stop()
        self.target.stop()


def run(cfg: TransferBenchConfig, progress: Callable[[str], None] = lambda _: None) -> TransferBenchResult:
    """Measure every cell `cfg.repeats` times (tsukimi and its peers alternating, each cell
    warmed up in its peer process first); medians."""
    result = TransferBenchResult(cfg)
    progress("baselines: memcpy")
    result.memcpy_gbps = memcpy_gbps()
    use_nixl = cfg.compare_nixl and nixl_available()
    use_mooncake = cfg.compare_mooncake and mooncake_available()
    for flag, used, what in ((cfg.compare_nixl, use_nixl, "nixl"), (cfg.compare_mooncake, use_mooncake, "mooncake")):
        if flag and not used:
            logger.warning("--compare-%s: %s is not importable; skipped", what, what)
    grid, peers = cells(cfg), peer_cells(cfg, use_nixl)
    mooncake_cells = [c for c in grid if c.transport == "tcp" and c.connections == cfg.connections[0]]
    pair = TsukimiPair(cfg.buffer_bytes, nixl="nixl" in cfg.transports)
    nixl = NixlPair(cfg.buffer_bytes) if use_nixl else None
    mooncake = MooncakePair(cfg.buffer_bytes) if use_mooncake else None

    def one_round(index: int) -> dict[tuple[str, TransferCell], float]:
        """socket -> GB/s, then ("tsukimi" | "mooncake", cell) -> GB/s of every cell."""
        say = f"round {index + 1}/{cfg.repeats}"
        progress(f"{say}: socket baseline")
        out = {("socket", TransferCell("socket", "", 0, 0, 1)): socket_gbps(cfg.duration_s)}
        for cell in [*grid, *peers]:
            progress(f"{say}: {_label(cell)}")
            measurer = nixl if cell.transport == "nixl" and cell in peers else pair
            assert measurer is not None
            out[("tsukimi", cell)] = measurer.measure(cell, cfg.duration_s, cfg.warmup_s)
            if mooncake is not None and cell in mooncake_cells:
                progress(f"{say}: mooncake {_label(cell)}")
                op: Literal["read", "write"] = "read" if cell.op == "read" else "write"
                out[("mooncake", cell)] = mooncake.measure(
                    op, cell.block_bytes, cell.batch, cfg.duration_s, cfg.warmup_s
                )
        return out

    try:
        rounds = repeat(one_round, repeats=cfg.repeats)
    finally:
        for closer in (pair, nixl, mooncake):
            if closer is not None:
                closer.close()
    medians = {key: Spread.of(r[key] for r in rounds).median for key in rounds[0]}
    result.socket_gbps = next(v for (who, _), v in medians.items() if who == "socket")
    result.results = [_row(c, medians[("tsukimi", c)]) for c in grid]
    result.peers = [_row(c, medians[("tsukimi", c)]) for c in peers]
    if use_mooncake:
        result.mooncake = [_row(c, v, "mooncake-tcp") for (who, c), v in medians.items() if who == "mooncake"]
    return result


def _row(cell: TransferCell, gbps: float, transport: str | None = None) -> dict[str, object]:
    row: dict[str, object] = asdict(cell)
    if transport:
        row["transport"] = transport
        row["connections"] = 1
    row["gbps"] = round(gbps, 4)
    return row


def _label(cell: TransferCell) -> str:
    conns = f" x{cell.connections}" if cell.transport == "tcp" else ""
    return f"{cell.transport}{conns} {cell.op} {_size(cell.block_bytes)} batch {cell.batch}"


def ratios(result: TransferBenchResult) -> list[dict[str, object]]:
    """Each tsukimi figure against its baseline (socket for tcp, memcpy for the same-host
    transports) and, in the same cell, against its peers: NIXL (same-host rows), raw CMA
    (cma and auto rows), Mooncake (tcp rows)."""
    peers = {(r["transport"], r["op"], r["block_bytes"], r["batch"]): float(str(r["gbps"])) for r in result.peers}
    for r in result.mooncake or []:
        peers[("mooncake", r["op"], r["block_bytes"], r["batch"])] = float(str(r["gbps"]))
    out = []
    for row in result.results:
        gbps, cell = float(str(row["gbps"])), (row["op"], row["block_bytes"], row["batch"])
        base = result.socket_gbps if row["transport"] == "tcp" else result.memcpy_gbps
        entry: dict[str, object] = {**row, "vs_baseline": round(gbps / base, 3) if base else None}
        same_host = row["transport"] != "tcp"
        for key, peer, applies in (
            ("vs_nixl", "nixl", same_host),
            ("vs_cma_raw", "cma-raw", same_host),
            ("vs_mooncake", "mooncake", not same_host),
        ):
            theirs = peers.get((peer, *cell))
            if applies and theirs:
                entry[key] = round(gbps / theirs, 3)
        out.append(entry)
    return out


def to_json(result: TransferBenchResult) -> dict[str, object]:
    """The figures of a run as plain JSON (the report's `figures`). Pure."""
    return {
        "results": result.results,
        "peers": result.peers,
        "baselines": {"socket_gbps": round(result.socket_gbps, 4), "memcpy_gbps": round(result.memcpy_gbps, 4)},
        "mooncake": result.mooncake,
        "ratios": ratios(result),
        "unit": "GB/s (1e9 bytes/s)",
    }


def verdicts(figures: Mapping[str, object]) -> list[Verdict]:
    """The issue-12 goals (see the module), each the worst of its rows (pure)."""
    rows = figures["ratios"]
    assert isinstance(rows, list)

    def worst(key: str, keep: Callable[[Mapping[str, object]], bool]) -> float | None:
        values = [float(str(r[key])) for r in rows if keep(r) and r.get(key) is not None]
        return min(values) if values else None

    def block(r: Mapping[str, object]) -> int:
        return int(str(r["block_bytes"]))

    return [
        goal(
            "auto_64k_vs_nixl",
            "same host, 64 KiB blocks: auto / NIXL",
            worst("vs_nixl", lambda r: r["transport"] == "auto" and block(r) == 64 * KIB),
            ">=",
            1.0,
        ),
        goal(
            "auto_1_16mib_vs_memcpy",
            "same host, 1-16 MiB: auto / memcpy",
            worst("vs_baseline", lambda r: r["transport"] == "auto" and MIB <= block(r) <= 16 * MIB),
            ">=",
            0.8,
        ),
        goal(
            "tcp_64k_vs_mooncake",
            "tcp 64 KiB: tsukimi / Mooncake TE tcp",
            worst("vs_mooncake", lambda r: r["transport"] == "tcp" and block(r) == 64 * KIB),
            ">=",
            1.0,
        ),
        goal(
            "tcp_4mib_vs_socket",
            "tcp 4 MiB: tsukimi / raw socket",
            worst("vs_baseline", lambda r: r["transport"] == "tcp" and block(r) == 4 * MIB),
            ">=",
            0.9,
        ),
    ]


def run_report(cfg: TransferBenchConfig, progress: Callable[[str], None] = lambda _: None) -> BenchReport:
    """`tsukimi bench transfer`: run (see `run`) and report, with the goals as verdicts."""
    start = begin("bench transfer", cfg)
    figures = to_json(run(cfg, progress))
    return finish(start, figures, verdicts(figures))


def _size(block: int) -> str:
    return f"{block // MIB} MiB" if block >= MIB else f"{block // KIB} KiB"


def _x(row: dict[str, object], key: str) -> str:
    value = row.get(key)
    return f"{float(str(value)):.2f}" if value is not None else "-"


COLUMNS = ("transport", "op", "block", "batch", "conns", "GB/s", "x baseline", "x NIXL", "x cma-raw", "x Mooncake")


def _cells(row: dict[str, object]) -> list[str]:
    baseline = "socket" if row["transport"] == "tcp" else "memcpy"
    return [
        str(row["transport"]),
        str(row["op"]),
        _size(int(str(row["block_bytes"]))),
        str(row["batch"]),
        str(row["connections"]),
        f"{float(str(row['gbps'])):.2f}",
        f"{_x(row, 'vs_baseline')} ({baseline})",
        _x(row, "vs_nixl"),
        _x(row, "vs_cma_raw"),
        _x(row, "vs_mooncake"),
    ]


def render_table(figures: Mapping[str, object]) -> Table:
    """The figures as a rich table, peers and baselines in its caption (pure)."""
    table = Table(title="tsukimi bench transfer (GB/s = 1e9 bytes/s, medians)")
    for name in COLUMNS:
        table.add_column(name, justify="right" if name not in ("transport", "op") else "left")
    rows, baselines = figures["ratios"], figures["baselines"]
    assert isinstance(rows, list) and isinstance(baselines, dict)
    for row in rows:
        table.add_row(*_cells(row))
    peers = _peers(figures)
    table.caption = (
        f"baselines: socket stream {baselines['socket_gbps']:.2f} GB/s (tcp rows), memcpy "
        f"{baselines['memcpy_gbps']:.2f} GB/s; peers: "
        + ", ".join(f"{r['transport']} {r['op']} {_size(int(str(r['block_bytes'])))} {r['gbps']}" for r in peers)
    )
    return table


def _peers(figures: Mapping[str, object]) -> list[Mapping[str, object]]:
    peers, mooncake = figures.get("peers") or [], figures.get("mooncake") or []
    assert isinstance(peers, list) and isinstance(mooncake, list)
    return [*peers, *mooncake]


def render_markdown(figures: Mapping[str, object]) -> str:
    """The figures as Markdown tables (what docs/benchmarks.md shows). Pure."""
    baselines = figures["baselines"]
    assert isinstance(baselines, dict)
    lines = [
        f"Baselines: raw socket stream {baselines['socket_gbps']:.2f} GB/s, "
        f"memcpy {baselines['memcpy_gbps']:.2f} GB/s.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    rows = figures["ratios"]
    assert isinstance(rows, list)
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in rows]
    peers = _peers(figures)
    if peers:
        lines += [
            "",
            "Peers, same cells, same run:",
            "",
            "| peer | op | block | batch | GB/s |",
            "|---|---|---|---|---|",
        ]
        for row in peers:
            size = _size(int(str(row["block_bytes"])))
            gbps = float(str(row["gbps"]))
            lines.append(f"| {row['transport']} | {row['op']} | {size} | {row['batch']} | {gbps:.2f} |")
    return "\n".join(lines)


VIEWS = FigureViews(render_markdown, render_table)
