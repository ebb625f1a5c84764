"""`tsukimi bench p2p --lab`: the broadcast of `tsukimi bench p2p` (tsukimi/bench/p2p.py)
across emulated hosts (tsukimi/lab/) whose shaped links, not this machine's CPUs, bound it.

    hub ----+--------+--------+-- ... --+          one bridge; every link shaped (tbf) to
            |        |        |         |          `link_rate` each way
          meta    origin     r1   ...   rN         one process a host (meta: this process's
     metadata server  origin   receiver i /        metadata server thread, on that host's
                    (gloo rank 0)  gloo rank i      network)

`transfer.transport=tcp` (the hosts' identities differ: "auto" would choose it anyway), every
Transfer Engine serving on its host's address; gloo's ranks talk over the hosts' eth0. In one
run, each cell `repeats` times, the systems interleaved round by round:
  one_link  naive with one receiver (r1): the time one link takes to move the checkpoint,
            next to size / shaped rate;
  tsukimi, naive, gloo   as `tsukimi bench p2p` (N receivers, one per host).
Each round's probe (`LinkProbe`) adds what bounds it: the bytes through every host's link over
the timed part (`ip -s link`: the origin's egress, each receiver's ingress, as a fraction of
the shaped rate), the machine's CPU busy fraction (/proc/stat: softirq, where the veth pairs,
the bridge and tbf do their work, included), and the busiest worker's CPU (p2p_worker.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

from tsukimi.bench.p2p import (
    SYSTEMS,
    P2PBenchConfig,
    Placement,
    Where,
    check_memory,
    gloo_round,
    median,
    start_origin,
    te_round,
)
from tsukimi.bench.p2p_lab_report import goals
from tsukimi.bench.p2p_report import Row
from tsukimi.bench.report import BenchReport, begin, finish
from tsukimi.config import P2PConfig
from tsukimi.errors import ConfigError, PeerError
from tsukimi.lab import HOST_ID_ENV, Lab, LinkShape, Topology, netns
from tsukimi.lab.topology import parse_rate
from tsukimi.testing.processes import WorkerError
from tsukimi.transfer.metadata.http import start_in_thread

MIB = 1 << 20
META, ORIGIN = "meta", "origin"


@dataclass(frozen=True, slots=True)
class P2PLabConfig:
    """One lab run: `receivers` hosts of one receiver each, every link `link_rate` each way."""

    receivers: int = 8
    link_rate: str = "1gbit"
    checkpoint_bytes: int = 256 * MIB
    shard_bytes: int = 8 * MIB
    systems: tuple[str, ...] = SYSTEMS
    inflight: int = P2PConfig().max_inflight
    timeout_s: float = 300.0
    repeats: int = 3
    seed: int = 15

    def __post_init__(self) -> None:
        if parse_rate(self.link_rate, "--link-rate") == 0:
            raise ConfigError("the lab bench needs shaped links: --link-rate such as 1gbit, not unlimited")
        self.bench()  # NOTE: the same checks as `tsukimi bench p2p` (receivers, sizes, systems)

    @property
    def link_bps(self) -> int:
        return parse_rate(self.link_rate)

    def bench(self) -> P2PBenchConfig:
        """The loopback bench's configuration of the same run (pure)."""
        return P2PBenchConfig(
            receivers=(self.receivers,),
            checkpoint_bytes=self.checkpoint_bytes,
            shard_bytes=self.shard_bytes,
            transports=("tcp",),
            systems=self.systems,
            inflight=self.inflight,
            timeout_s=self.timeout_s,
            repeats=self.repeats,
            seed=self.seed,
        )


def receiver_host(index: int) -> str:
    return f"r{index + 1}"


def topology(cfg: P2PLabConfig) -> Topology:
    """meta, origin, r1..rN, every link shaped to `cfg.link_rate` (pure)."""
    names = [META, ORIGIN, *(receiver_host(i) for i in range(cfg.receivers))]
    return Topology.of(*names, link=LinkShape(rate_bps=cfg.link_bps))


def placement(lab: Lab) -> Placement:
    """The origin and gloo's rank 0 on "origin", receiver i and gloo rank i + 1 on r(i+1)."""

    def place(role: str, index: int) -> Where:
        host = (
            ORIGIN if role == "origin" or (role == "gloo" and index == 0) else receiver_host(index - (role == "gloo"))
        )
        env = {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"} if role == "gloo" else {}
        env[HOST_ID_ENV] = lab.host_id(host)  # NOTE: `ip netns exec` keeps our environment, this added
        return Where(tuple(lab.command(host, [])), env, {"bind_host": lab.address(host)})

    return place


class LinkProbe:
    """Bytes through each host's eth0 (both ways) and the machine's CPU busy fraction between
    `start` and `stop` (a `RoundProbe`)."""

    def __init__(self, lab: Lab) -> None:
        self._lab = lab
        self._before: dict[str, tuple[int, int]] = {}
        self._cpu: tuple[int, int] = (0, 0)
        self._at = 0.0

    def _counters(self) -> dict[str, tuple[int, int]]:
        out = {}
        for host in (h.name for h in self._lab.topology.hosts):
            shown = netns.run_tool("ip", "-n", self._lab.namespace(host), "-s", "-j", "link", "show", "dev", "eth0")
            stats = json.loads(shown)[0]["stats64"]
            out[host] = (int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"]))
        return out

    def start(self) -> None:
        self._before, self._cpu, self._at = self._counters(), cpu_times(), time.monotonic()

    def stop(self) -> dict[str, object]:
        busy, total = (a - b for a, b in zip(cpu_times(), self._cpu, strict=True))
        wall_s, after = time.monotonic() - self._at, self._counters()
        moved = {h: [after[h][0] - tx, after[h][1] - rx] for h, (tx, rx) in self._before.items()}
        return {"link_bytes": moved, "cpu_busy": round(busy / total, 3) if total else None, "probe_s": round(wall_s, 3)}


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of every CPU of the machine (/proc/stat; busy: not idle or iowait)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]  # NOTE: guest time is inside user
    return sum(fields) - fields[3] - fields[4], sum(fields)


def _links(row: Row, cfg: P2PLabConfig, receivers: int) -> Row:
    """The row with its link figures as fractions of the shaped rate over its timed part."""
    moved = row["link_bytes"]
    assert isinstance(moved, dict)
    seconds, rate_bytes = float(str(row["seconds"])), cfg.link_bps / 8
    ingress = [moved[receiver_host(i)][1] for i in range(receivers)]
    return {
        **row,
        "origin_link_bytes": moved[ORIGIN][0],
        "origin_link_busy": round(moved[ORIGIN][0] / seconds / rate_bytes, 3),
        "receiver_link_busy": round(sum(ingress) / len(ingress) / seconds / rate_bytes, 3),
    }


def run(cfg: P2PLabConfig, progress: Callable[[str], None] = lambda _: None) -> Row:
    """Build the lab, run every round, tear it down; the figures (see the module).

    Raises:
        ConfigError: no namespaces here (naming what is missing), or the run would not fit
            in memory.
        PeerError: a worker failed, exited or hung (the message quotes its stderr tail).
    """
    bench = cfg.bench()
    check_memory(bench)
    rounds: dict[str, list[Row]] = {}
    n = cfg.receivers
    progress(f"building the lab: {n + 2} hosts, links {cfg.link_rate}")
    with Lab(topology(cfg)) as lab, ExitStack() as stack:
        with lab.entered(META):
            server, _ = start_in_thread(lab.address(META))
        stack.callback(server.stop)
        place, probe = placement(lab), LinkProbe(lab)
        try:
            progress("starting the origin")
            origin = start_origin(stack, bench, server.url, place("origin", 0))
            for rep in range(cfg.repeats):
                progress(f"round {rep + 1}/{cfg.repeats}: one link (naive, 1 receiver)")
                row = te_round(bench, ("naive", "tcp", 1, rep), origin, server.url, place, probe)
                rounds.setdefault("one_link", []).append(_links({**row, "system": "one_link"}, cfg, 1))
                for system in cfg.systems:
                    progress(f"round {rep + 1}/{cfg.repeats}: {system}, {n} receivers")
                    if system == "gloo":
                        row = gloo_round(bench, n, place, lab.address(ORIGIN), probe)
                    else:
                        row = te_round(bench, (system, "tcp", n, rep), origin, server.url, place, probe)
                    rounds.setdefault(system, []).append(_links(row, cfg, n))
        except WorkerError as exc:
            raise PeerError(str(exc)) from exc
    hosts = [{"name": h.name, "address": lab.address(h.name), "link": cfg.link_rate} for h in lab.topology.hosts]
    return {
        "topology": {"hosts": hosts, "link_rate_bps": cfg.link_bps, "shaping": "tbf, each way, per host link"},
        "one_link_ideal_s": round(cfg.checkpoint_bytes * 8 / cfg.link_bps, 4),
        "runs": [median(rows) for rows in rounds.values()],
    }


def run_report(cfg: P2PLabConfig, progress: Callable[[str], None] = lambda _: None) -> BenchReport:
    """`tsukimi bench p2p --lab`: run (see `run`) and report, the issue's goals as verdicts
    (p2p_lab_report.py).

    Raises:
        As `run`.
    """
    start = begin("bench p2p --lab", cfg)
    figures = run(cfg, progress)
    runs = figures["runs"]
    assert isinstance(runs, list)
    return finish(start, figures, goals(runs))
