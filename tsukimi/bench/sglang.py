"""`tsukimi bench sglang`: SGLang's HiCache L3 calls (batch_set_v1 / batch_exists /
batch_get_v1 of MHA pages, in calls of SGLang's STORAGE_BATCH_SIZE) through three systems:

    mooncake   (a) SGLang's MooncakeStore on the real Mooncake wheel + the real `mooncake_master`
    compat     (b) the same MooncakeStore under `tsukimi compat exec`, `tsukimi compat mooncake-master`
    tsukimi    (c) tsukimi's TsukimiHiCacheStorage (integrations/sglang/hicache.py), `tsukimi master`

at each TP size: TP ranks are that many processes in `.venv-sglang` (bench/sglang_rank.py),
one rank each, running every op at once. Each rank mounts `segment_mib` of its memory into
the pool (SGLang's embedded mode; MooncakeStore divides `global_segment_size` by the TP size,
so it is given TP x that). `repeats` rounds of set, exists, get, each round on fresh keys (a
set of stored pages would only find them there). Figures: per system, TP and op, the pages, the
median over rounds of the slowest rank's seconds, pages/s and GB/s (pages x 64 KiB / s; exists
moves no bytes), and whether every page of every round came back byte-exact. Verdicts:
(c) >= 1.5x (a) and (b) >= 1.0x (a) in pages/s, per TP and op.

A system that cannot run here (no `.venv-sglang`, no real wheel / `mooncake_master` in it)
is skipped with its reason in `figures["skipped"]`; one that fails has its error in
`figures["errors"]`, and the others still run.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tsukimi.bench.child import module_args
from tsukimi.bench.report import BenchReport, Figures, FigureViews, Verdict, begin, finish, goal
from tsukimi.bench.sglang_rank import PAGE_BYTES
from tsukimi.clock import WallClock
from tsukimi.errors import ConfigError
from tsukimi.integrations.sglang.paths import check_venv
from tsukimi.netio import free_port
from tsukimi.testing.processes import JsonWorker, WorkerError

SYSTEMS = ("mooncake", "compat", "tsukimi")
OPS = ("set", "exists", "get")  # NOTE: in run order: gets and exists find what set stored
MIB = 1 << 20
_HOST = "127.0.0.1"
_MASTER_TIMEOUT_S = 30.0
_RANK_TIMEOUT_S = 180.0  # NOTE: SGLang's import alone takes ~10 s on a loaded 2-CPU machine
_OP_TIMEOUT_S = 300.0
_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class SglangBenchConfig:
    """What `bench sglang` runs: `pages` pages per rank in calls of `batch`, at each TP size
    in `tps`, through each of `systems` (in order)."""

    pages: int = 1000
    batch: int = 128
    tps: tuple[int, ...] = (1, 4)
    systems: tuple[str, ...] = SYSTEMS
    segment_mib: int = 256  # NOTE: every round's pages stay (3 x 64 MiB at the defaults): no eviction
    repeats: int = 3

    def __post_init__(self) -> None:
        if min(self.pages, self.batch, self.segment_mib, self.repeats, *self.tps, 1) < 1 or not self.tps:
            raise ConfigError("pages, batch, segment_mib, repeats and every TP size must be >= 1")
        unknown = sorted(set(self.systems) - set(SYSTEMS))
        if unknown or not self.systems:
            raise ConfigError(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")


QUICK = SglangBenchConfig(pages=128, tps=(1,), segment_mib=32, repeats=1)


def run_report(cfg: SglangBenchConfig, progress: Callable[[str], None] = lambda _: None) -> BenchReport:
    """`tsukimi bench sglang`: run every system and report."""
    start = begin("bench sglang", cfg)
    figures = run(cfg, progress)
    return finish(start, figures, verdicts(figures))


def run(cfg: SglangBenchConfig, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Every system at every TP size; the figures (see the module)."""
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    errors: dict[str, str] = {}
    try:
        python = check_venv()
    except ConfigError as exc:
        return {"rows": rows, "skipped": dict.fromkeys(cfg.systems, str(exc)), "errors": errors}
    for system in cfg.systems:
        reason = _missing(system, python)
        if reason:
            skipped[system] = reason
            continue
        for tp in cfg.tps:
            progress(f"{system}: TP {tp}, {cfg.pages} pages per rank")
            try:
                rows += _run_system(cfg, system, tp, python)
            except (WorkerError, RuntimeError, OSError) as exc:
                errors[f"{system}_tp{tp}"] = str(exc)[-2000:]
    return {"page_bytes": PAGE_BYTES, "rows": rows, "skipped": skipped, "errors": errors}


def _missing(system: str, python: Path) -> str:
    """Why `system` cannot run with the SGLang venv of `python` ("" when it can)."""
    if system != "mooncake":
        return ""
    if not (python.parent / "mooncake_master").is_file():
        return f"no real Mooncake wheel (mooncake_master) in {python.parent.parent}"
    return ""


def _run_system(cfg: SglangBenchConfig, system: str, tp: int, python: Path) -> list[dict[str, Any]]:
    port = free_port(_HOST)
    with _master(system, port, python), _ranks(cfg, system, tp, port, python) as ranks:
        rounds: dict[str, list[list[dict[str, Any]]]] = {op: [] for op in OPS}
        for round_ in range(cfg.repeats):
            for op in OPS:
                for rank in ranks:
                    rank.send(cmd=op, round=round_)
                rounds[op].append([rank.read_reply(_OP_TIMEOUT_S) for rank in ranks])
        return [_row(system, tp, op, cfg.pages * tp, rounds[op]) for op in OPS]


def _row(system: str, tp: int, op: str, pages: int, rounds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One figure row: per round the slowest rank's time counts (the ranks ran at once); the
    median round. `pages_ok`: the fewest pages any round got right. Pure."""
    seconds = statistics.median(max(float(r["seconds"]) for r in replies) for replies in rounds)
    rate = pages / seconds if seconds > 0 else float("nan")
    return {
        "system": system,
        "tp": tp,
        "op": op,
        "pages": pages,
        "pages_ok": min(sum(int(r["pages_ok"]) for r in replies) for replies in rounds),
        "seconds": round(seconds, 4),
        "pages_per_s": round(rate, 1),
        "gb_per_s": None if op == "exists" else round(rate * PAGE_BYTES / 1e9, 3),
        "exact": all(r.get("exact", True) for replies in rounds for r in replies),
        "rounds": len(rounds),
    }


@contextlib.contextmanager
def _master(system: str, port: int, python: Path) -> Iterator[None]:
    """The system's master on 127.0.0.1:`port`, until the block ends. Raises RuntimeError:
    it exited or did not listen in time (its output is quoted)."""
    tsukimi_cli = str(Path(sys.executable).parent / "tsukimi")
    mooncake_flags = [f"--rpc_port={port}", f"--rpc_address={_HOST}", "--metrics_port=0"]
    argv = {
        "mooncake": [str(python.parent / "mooncake_master"), *mooncake_flags, "--enable_metric_reporting=false"],
        "compat": [tsukimi_cli, "compat", "mooncake-master", *mooncake_flags],
        "tsukimi": [tsukimi_cli, "master", "--set", f"master.rpc_port={port}", "--set", "master.http_port=0"],
    }[system]
    clock = WallClock()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = clock.now() + _MASTER_TIMEOUT_S
            while not _accepts(port):
                if proc.poll() is not None or clock.now() > deadline:
                    log.seek(0)
                    tail = log.read()[-2000:].decode(errors="replace")
                    raise RuntimeError(f"{system} master (rc={proc.poll()}) is not listening:\n{tail}")
                clock.sleep(_POLL_S)
            yield
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((_HOST, port), timeout=1.0):
        return True
    return False


@contextlib.contextmanager
def _ranks(cfg: SglangBenchConfig, system: str, tp: int, port: int, python: Path) -> Iterator[list[JsonWorker]]:
    """`tp` rank processes, started at once, all ready; stopped when the block ends."""
    prefix = [str(python)]
    if system == "compat":
        prefix = [str(Path(sys.executable).parent / "tsukimi"), "compat", "exec", "--", str(python)]
    # NOTE: JsonWorker runs `WRAPPER sys.executable -m ...`: the wrapper drops that interpreter
    # and execs SGLang's (under the compat hook for (b)) with the same `-m ...` arguments
    wrapper = ["sh", "-c", f'shift; exec {shlex.join(prefix)} "$@"', "sh"]
    checkout = Path(__file__).resolve().parents[2]  # NOTE: this checkout first on the ranks' path
    key_prefix = f"bench-{uuid.uuid4().hex[:8]}"

    def start(rank: int) -> JsonWorker:
        spec = {
            "backend": "mooncake" if system != "tsukimi" else "dynamic",
            "extra_config": _extra_config(system, port, tp, cfg.segment_mib * MIB),
            "tp_rank": rank,
            "tp_size": tp,
            "pages": cfg.pages,
            "batch": cfg.batch,
            "key_prefix": key_prefix,
        }
        args = module_args("sglang-rank", json.dumps(spec))
        return JsonWorker(f"{system} rank {rank}", args, _RANK_TIMEOUT_S, pythonpath=[checkout], wrapper=wrapper)

    with ThreadPoolExecutor(tp) as pool:
        futures = [pool.submit(start, rank) for rank in range(tp)]
    ranks = []
    failure: BaseException | None = None
    for future in futures:
        try:
            ranks.append(future.result())
        except BaseException as exc:  # NOTE: stop the ranks that did start, then raise
            failure = failure or exc
    try:
        if failure is not None:
            raise failure
        yield ranks
    finally:
        for rank in ranks:
            rank.stop()


def _extra_config(system: str, port: int, tp: int, segment_bytes: int) -> dict[str, object]:
    """SGLang's `--hicache-storage-backend-extra-config` for `system`. Pure but the hostname."""
    if system == "tsukimi":
        return {
            "backend_name": "tsukimi",
            "module_path": "tsukimi.integrations.sglang.hicache",
            "class_name": "TsukimiHiCacheStorage",
            "interface_v1": 1,  # NOTE: unused by the bench (it calls v1 itself), as SGLang needs it
            "master": f"tcp://{_HOST}:{port}",
            "segment_bytes": segment_bytes,
        }
    return {
        "master_server_address": f"{_HOST}:{port}",
        "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp",
        "device_name": "",
        "global_segment_size": segment_bytes * tp,  # NOTE: MooncakeStore gives each rank 1/tp
        "local_hostname": f"{_HOST}:{free_port(_HOST)}",  # NOTE: the segment's name: one per rank
    }


def verdicts(figures: Figures) -> list[Verdict]:
    """(c) >= 1.5x (a) and (b) >= 1.0x (a) in pages/s, per TP size and op. Pure."""
    rows = figures.get("rows", [])
    assert isinstance(rows, list)
    rate = {(r["system"], r["tp"], r["op"]): r["pages_per_s"] for r in rows if r["pages_ok"] == r["pages"]}
    out = [Verdict("byte_exact", "every page read back equals the page written", all(r["exact"] for r in rows))]
    for tp in sorted({r["tp"] for r in rows}):
        for op in OPS:
            base = rate.get(("mooncake", tp, op))
            for system, target in (("tsukimi", 1.5), ("compat", 1.0)):
                mine = rate.get((system, tp, op))
                ratio = mine / base if mine is not None and base else None
                name = f"{system}_vs_mooncake_tp{tp}_{op}"
                out.append(goal(name, f"{system} / mooncake pages/s, TP {tp} {op}", ratio, ">=", target))
    return out


def markdown(figures: Figures) -> str:
    """The table docs/benchmarks.md holds, then what was skipped or failed. Pure."""
    rows = figures.get("rows", [])
    assert isinstance(rows, list)
    lines = [
        f"{PAGE_BYTES // 1024} KiB MHA pages (k + v), calls of SGLang's batch size.",
        "",
        "| system | TP | op | pages | s | pages/s | GB/s | all ok | exact |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gbps = "-" if r["gb_per_s"] is None else f"{r['gb_per_s']:.3f}"
        ok = "yes" if r["pages_ok"] == r["pages"] else f"{r['pages_ok']}/{r['pages']}"
        lines.append(
            f"| {r['system']} | {r['tp']} | {r['op']} | {r['pages']} | {r['seconds']:.3f} | {r['pages_per_s']:.0f}"
            f" | {gbps} | {ok} | {'yes' if r['exact'] else 'NO'} |"
        )
    for kind in ("skipped", "errors"):
        found = figures.get(kind) or {}
        assert isinstance(found, dict)
        lines += [f"- {kind} {name}: {why}" for name, why in found.items()]
    return "\n".join(lines)


VIEWS = FigureViews(markdown)
