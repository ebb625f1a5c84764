"""`tsukimi bench hot-lab`: hot-key replication (tsukimi/store/master/hot.py) on the pool
reads of the skewed workload (tsukimi/bench/skewed.py), across emulated hosts
(tsukimi/lab/) whose shaped links, not this machine's CPUs, bound it.

    hub --+------+------+-- .. --+------+-- .. --+     one bridge; every link shaped (tbf)
          |      |      |        |      |        |     to `link_rate` each way
          m     h1     h2  ..   hH     r1  ..   rR
   master + the   holders (one     readers: stand-ins for prefill instances
   writer client  segment each)    (hot_lab_reader.py, one process a host)

The shared system prompt's KV (`prefix_tokens` x `kv_bytes_per_token`, in `prefix_objects`
objects) is written once, before the clock starts, with 1 replica, all on h1 (as the prefill
instance that computed it would write it to its own holder). Request i of the skewed
workload (same seed: same arrivals, same shared/private draw) goes to reader i mod R, which
serves its requests one at a time: a shared request fetches the prompt's objects from the
pool (real gets over the shaped links, `transfer.transport=tcp`) then computes its suffix, a
private one recomputes everything (no pool read). Compute is a sleep of tokens /
`prefill_tokens_per_s`, a stated rate: the engine and its prefix cache are not in this bench.
TTFT = arrival -> done, queueing at the reader included.

Run twice in one invocation, each on a fresh lab and store: the master's hot_threshold 0
(off), then `hot_threshold` (on, extra replicas up to one per holder). Each run's probe
(p2p_lab.LinkProbe) gives the bytes each host's link carried (holders: what they served)
and the machine's CPU busy fraction over the timed part (other users' work included: the
machine is shared); each holder process's CPU time, as a fraction of one core, says
whether the holder or its link bounds what it serves.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np

from tsukimi.bench.hot_lab_reader import ReaderPlan, ReaderRequest, ReaderResult, tcp_client
from tsukimi.bench.hot_lab_report import goals
from tsukimi.bench.overload_monitor import cpu_seconds
from tsukimi.bench.p2p_lab import LinkProbe
from tsukimi.bench.p2p_report import Row
from tsukimi.bench.report import BenchReport, begin, finish
from tsukimi.bench.skewed import SkewedWorkload, hot_counters, skewed_requests
from tsukimi.errors import ConfigError, PeerError
from tsukimi.lab import Lab, LinkShape, Topology
from tsukimi.lab.topology import parse_rate
from tsukimi.testing.lab_store import start_spread_store

MIB = 1 << 20
MASTER = "m"
SLOW_LINK_S = 30.0  # the master's read lease and copy deadline
KV_BYTES_PER_TOKEN = 2 * 24 * 2 * 64 * 2  # NOTE: Qwen2-0.5B's shape: K and V x 24 layers x 2 heads x 64 dims x bf16


@dataclass(frozen=True, slots=True)
class HotLabConfig:
    """One invocation: the topology, the workload, the stated cost model and the master's
    hot-key settings of the "on" run."""

    holders: int = 4
    readers: int = 6
    link_rate: str = "100mbit"
    workload: SkewedWorkload = field(default_factory=lambda: SkewedWorkload(120, 0.9, 512, rate=1.6))
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN
    prefix_objects: int = 4
    prefill_tokens_per_s: float = 1000.0
    hot_threshold: float = 1.0
    hot_window_s: float = 2.0
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if parse_rate(self.link_rate, "--link-rate") == 0:
            raise ConfigError("the hot-lab bench needs shaped links: --link-rate such as 100mbit, not unlimited")
        if not 2 <= self.holders <= 8 or self.readers < 1:
            raise ConfigError("hot-lab needs 2..8 holders (hot_max_replicas' range) and at least 1 reader")
        if self.hot_threshold <= 0 or self.prefill_tokens_per_s <= 0 or self.prefix_objects < 1:
            raise ConfigError("hot-lab: --hot-threshold, the prefill rate and prefix objects must be > 0")

    @property
    def link_bps(self) -> int:
        return parse_rate(self.link_rate)

    @property
    def prefix_bytes(self) -> int:
        return self.workload.prefix_tokens * self.kv_bytes_per_token

    def holder_bytes(self) -> int:
        """Each holder's segment: room for every prefix object and some (whole MiB)."""
        return (2 * self.prefix_bytes // MIB + 4) * MIB


def holder_host(index: int) -> str:
    return f"h{index + 1}"


def reader_host(index: int) -> str:
    return f"r{index + 1}"


def topology(cfg: HotLabConfig) -> Topology:
    """m, h1..hH, r1..rR, every link shaped to `cfg.link_rate` (pure)."""
    names = [MASTER, *map(holder_host, range(cfg.holders)), *map(reader_host, range(cfg.readers))]
    return Topology.of(*names, link=LinkShape(rate_bps=cfg.link_bps))


def prefix_keys(cfg: HotLabConfig) -> list[str]:
    return [f"system-prompt/{j}" for j in range(cfg.prefix_objects)]


def plans(cfg: HotLabConfig) -> list[list[ReaderRequest]]:
    """Each reader's requests (request i to reader i mod R), with keys and compute time (pure)."""
    out: list[list[ReaderRequest]] = [[] for _ in range(cfg.readers)]
    w = cfg.workload
    for i, request in enumerate(skewed_requests(w)):
        keys = prefix_keys(cfg) if request.shared else []
        computed = w.suffix_tokens + (0 if request.shared else w.prefix_tokens)
        out[i % cfg.readers].append(ReaderRequest(i, request.at_s, keys, computed / cfg.prefill_tokens_per_s))
    return out


def _write_prefix(cfg: HotLabConfig, master: str, host: str, holder: str) -> None:
    """Write the shared prompt's objects, 1 replica each, all on `holder` (a TE segment)."""
    size = -(-cfg.prefix_bytes // cfg.prefix_objects)
    with tcp_client(master, host) as writer:
        for j, key in enumerate(prefix_keys(cfg)):
            writer.put(key, bytes([j % 251]) * size, replicas=1, preferred=(holder,))


def _start_readers(cfg: HotLabConfig, lab: Lab, master: str, stack: ExitStack) -> list[subprocess.Popen[bytes]]:
    procs = []
    for i, requests in enumerate(plans(cfg)):
        host = reader_host(i)
        argv = [sys.executable, "-m", "tsukimi.bench.hot_lab_reader"]
        proc = lab.popen(host, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        stack.callback(proc.kill)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(msgspec.json.encode(ReaderPlan(master, lab.address(host), requests)) + b"\n")
        proc.stdin.flush()
        procs.append(proc)
    for i, proc in enumerate(procs):
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":
            raise PeerError(f"reader {reader_host(i)} did not start: {_stderr(proc)}")
    return procs


def _stderr(proc: subprocess.Popen[bytes]) -> str:
    proc.kill()
    _, err = proc.communicate(timeout=10)
    return err.decode(errors="replace")[-2000:]


def _collect(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> list[ReaderResult]:
    results = []
    for i, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise PeerError(f"reader {reader_host(i)} ran past {timeout_s:g} s: {_stderr(proc)}") from None
        if proc.returncode != 0:
            raise PeerError(f"reader {reader_host(i)} failed: {err.decode(errors='replace')[-2000:]}")
        results += [msgspec.json.decode(line, type=ReaderResult) for line in out.splitlines() if line.strip()]
    return results


def _master_settings(cfg: HotLabConfig, threshold: float) -> list[str]:
    # NOTE: reads and copies share a slow link and may take seconds: the test deployments' 1 s
    # read lease and copy deadline (deployments.MASTER_SETTINGS) would fail them
    return [
        f"lease_ttl_s={SLOW_LINK_S}",
        f"put_timeout_s={SLOW_LINK_S}",
        f"hot_threshold={threshold}",
        f"hot_window_s={cfg.hot_window_s}",
        f"hot_max_replicas={cfg.holders}",
    ]


def one_run(cfg: HotLabConfig, threshold: float, log_dir: Path, progress: Callable[[str], None]) -> Row:
    """One run on a fresh lab and store with the master's hot_threshold `threshold` (0: off).

    Raises:
        ConfigError: no namespaces here (naming what is missing).
        PeerError: a process failed or ran past `cfg.timeout_s`.
    """
    holders = [holder_host(i) for i in range(cfg.holders)]
    log_dir.mkdir(parents=True, exist_ok=True)
    progress(f"hot_threshold {threshold:g}: building the lab ({len(topology(cfg).hosts)} hosts, {cfg.link_rate})")
    with Lab(topology(cfg)) as lab, ExitStack() as stack:
        with lab.entered(MASTER):
            settings = _master_settings(cfg, threshold)
            store = start_spread_store(lab, MASTER, holders, MASTER, log_dir, cfg.holder_bytes(), settings)
        stack.callback(lambda: _in(lab, store.close))
        master = store.deployment.endpoint
        with lab.entered(MASTER):
            _write_prefix(cfg, master, lab.address(MASTER), store.deployment.holder_names[0])
        progress(f"hot_threshold {threshold:g}: {cfg.workload.requests} requests on {cfg.readers} readers")
        procs = _start_readers(cfg, lab, master, stack)
        pids = {holder_host(i): store.cluster.process(f"holder-{i}").pid for i in range(cfg.holders)}
        results, probed = _timed(cfg, lab, procs, pids)
        with lab.entered(MASTER):
            counters = hot_counters(store.deployment.http_url)
            replicas = [store.deployment.copies(key)[0] for key in prefix_keys(cfg)]
    return _figures(cfg, threshold, results, probed, counters, replicas)


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of process `pid` and its descendants alive now (a launched holder is a
    lifeline wrapper around `ip netns exec ... tsukimi holder`; /proc, 0 for those gone)."""
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        total += cpu_seconds(current) or 0.0
        with contextlib.suppress(OSError):
            todo += [int(c) for c in Path(f"/proc/{current}/task/{current}/children").read_text().split()]
    return total


def _timed(
    cfg: HotLabConfig, lab: Lab, procs: list[subprocess.Popen[bytes]], holder_pids: dict[str, int]
) -> tuple[list[ReaderResult], dict[str, object]]:
    """Start the ready readers, wait for their results; the link probe's figures over that
    time, with each holder process's CPU seconds per second (`holder_cpu_x_core`)."""
    probe = LinkProbe(lab)
    cpu_before = {host: tree_cpu_seconds(pid) for host, pid in holder_pids.items()}
    probe.start()
    start_at = time.time() + 0.2
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(f"{start_at}\n".encode())
        proc.stdin.flush()  # NOTE: `communicate` closes it
    results = _collect(procs, cfg.timeout_s)
    probed = probe.stop()
    seconds = float(str(probed["probe_s"]))
    cpu = {h: round((tree_cpu_seconds(pid) - cpu_before[h]) / seconds, 3) for h, pid in holder_pids.items()}
    return results, {**probed, "holder_cpu_x_core": cpu}


def _in(lab: Lab, close: Callable[[], None]) -> None:
    with lab.entered(MASTER):
        close()


def _figures(
    cfg: HotLabConfig,
    threshold: float,
    results: list[ReaderResult],
    probed: dict[str, object],
    counters: dict[str, float],
    replicas: list[int],
) -> Row:
    ttft = np.array([r.ttft_s for r in results])
    shared = np.array([r.ttft_s for r in results if r.fetched_bytes])
    fetch = np.array([r.fetch_s for r in results if r.fetched_bytes])
    moved = probed["link_bytes"]
    assert isinstance(moved, dict)
    served = {holder_host(i): int(moved[holder_host(i)][0]) for i in range(cfg.holders)}
    seconds = float(str(probed["probe_s"]))
    return {
        "hot_threshold": threshold,
        "requests": len(results),
        "shared_requests": len(shared),
        "p50_ttft_s": round(float(np.percentile(ttft, 50)), 4),
        "p90_ttft_s": round(float(np.percentile(ttft, 90)), 4),
        "p90_shared_ttft_s": round(float(np.percentile(shared, 90)), 4) if len(shared) else None,
        "mean_fetch_s": round(float(fetch.mean()), 4) if len(fetch) else None,
        "fetched_bytes": sum(r.fetched_bytes for r in results),
        "holder_link_bytes": served,
        "busiest_holder_link_busy": round(max(served.values()) / seconds / (cfg.link_bps / 8), 3),
        "hot_replications": counters.get("hot_replications", 0.0),
        "prefix_replicas_at_end": replicas,
        "holder_cpu_x_core": probed["holder_cpu_x_core"],
        "cpu_busy": probed["cpu_busy"],
        "seconds": seconds,
    }


def run(cfg: HotLabConfig, progress: Callable[[str], None] = lambda _: None) -> dict[str, object]:
    """Both runs (off, then on); the figures (see the module). Raises as `one_run`."""
    with tempfile.TemporaryDirectory(prefix="tsukimi-hot-lab-") as logs:
        runs = [one_run(cfg, t, Path(logs) / f"t{t:g}", progress) for t in (0.0, cfg.hot_threshold)]
    hosts, w = [h.name for h in topology(cfg).hosts], cfg.workload
    return {
        "topology": {
            "hosts": hosts,
            "roles": {
                "master+writer": MASTER,
                "holders": hosts[1 : 1 + cfg.holders],
                "readers": hosts[1 + cfg.holders :],
            },
            "link_rate_bps": cfg.link_bps,
            "shaping": "tbf, each way, per host link",
            "transport": "tcp",
        },
        "prefix_bytes": cfg.prefix_bytes,
        "one_fetch_ideal_s": round(cfg.prefix_bytes * 8 / cfg.link_bps, 4),
        "offered_load_x_link": round(w.rate * w.shared * cfg.prefix_bytes * 8 / cfg.link_bps, 3),
        "runs": runs,
    }


def run_report(cfg: HotLabConfig, progress: Callable[[str], None] = lambda _: None) -> BenchReport:
    """`tsukimi bench hot-lab`: run both (see `run`) and report (hot_lab_report.py's verdicts).

    Raises:
        As `one_run`.
    """
    start = begin("bench hot-lab", cfg)
    figures = run(cfg, progress)
    runs = figures["runs"]
    assert isinstance(runs, list)
    return finish(start, figures, goals(runs))
