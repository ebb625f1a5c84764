"""`tsukimi bench transfer --lab`: Transfer Engine tcp striped over two shaped NICs, between two
emulated hosts (tsukimi/lab/), against one NIC in the same run, and with a NIC failing mid-run.

    a (eth0, eth1) ---- br0 / br1 ---- b (eth0, eth1)      every NIC's link shaped (tbf) to
     initiator: this process            target_peer           `nic_rate`, each way
                   meta: the metadata server (unshaped)

Cells, each `rounds` batches of `batch` requests of `block_bytes` (the figure is the median
batch), after one warm-up batch:
  one NIC   the target serves on b's eth0 only (write, then read);
  two NICs  the target serves on both: the initiator's connections stripe over them;
  unshaped  two NICs with the shaping removed (`compare_unshaped`): what the CPUs allow, so
            that the shaped cells are seen to be bound by the links, not by the two CPUs.
Then the failure run: `failure_batches` batches (writes and reads in turn) over two NICs, b's
eth1 taken down `cut_after_s` into it; every batch is checked byte-exact. Time lost: what the
batches from the cut on took beyond the shaped cells' median batch times (the cut batch: two
NICs' rate up to the cut, one's after it).

Goals and checks, as verdicts, and the tables: transfer_lab_report.py.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np

from tsukimi.bench.p2p_lab import cpu_times
from tsukimi.bench.p2p_report import Row
from tsukimi.bench.report import BenchReport, begin, finish
from tsukimi.bench.transfer_lab_report import goals
from tsukimi.config import Config, MetadataConfig, TransferConfig
from tsukimi.errors import ConfigError, PeerError
from tsukimi.lab import HostSpec, Lab, LinkShape, Topology
from tsukimi.lab.counters import nic_bytes
from tsukimi.lab.topology import parse_rate
from tsukimi.testing.host_pairs import RemoteTarget
from tsukimi.testing.lab_services import worker_in
from tsukimi.testing.processes import WorkerError
from tsukimi.transfer import OpCode, RegisteredBuffer, RequestState, TransferEngine, TransferRequest
from tsukimi.transfer.metadata.http import start_in_thread

MIB = 1 << 20
META, INITIATOR, TARGET = "meta", "a", "b"


@dataclass(frozen=True, slots=True)
class TransferLabConfig:
    """One lab run (see the module)."""

    nic_rate: str = "300mbit"
    block_bytes: int = 16 * MIB
    batch: int = 4
    rounds: int = 3
    failure_batches: int = 8
    cut_after_s: float = 1.4  # NOTE: into the second batch (0.93 s each at 2 x 300 Mbit/s)
    connections: int = 4
    slice_bytes: int = MIB
    timeout_s: float = 30.0
    compare_unshaped: bool = True
    seed: int = 24

    def __post_init__(self) -> None:
        if parse_rate(self.nic_rate, "--nic-rate") == 0:
            raise ConfigError("the lab bench needs shaped NICs: --nic-rate such as 300mbit, not unlimited")
        if not MIB <= self.block_bytes <= 256 * MIB or not 1 <= self.batch <= 64:
            raise ConfigError("block_bytes must be in 1 MiB..256 MiB and batch in 1..64")
        if self.rounds < 1 or self.failure_batches < 2 or self.cut_after_s <= 0:
            raise ConfigError("rounds >= 1, failure_batches >= 2 and cut_after_s > 0 are needed")
        TransferConfig(num_connections=self.connections, slice_bytes=self.slice_bytes, timeout_s=self.timeout_s)

    @property
    def nic_bps(self) -> int:
        return parse_rate(self.nic_rate)

    @property
    def batch_bytes(self) -> int:
        return self.block_bytes * self.batch


def topology(cfg: TransferLabConfig) -> Topology:
    """a and b with two NICs shaped to `cfg.nic_rate`, meta with one unshaped (pure)."""
    nics = (LinkShape(rate_bps=cfg.nic_bps),) * 2
    return Topology((HostSpec(INITIATOR, nics), HostSpec(TARGET, nics), HostSpec(META, (LinkShape(),))))


class Cell:
    """One target buffer reached by one initiator engine: batches of writes or reads over it."""

    def __init__(self, cfg: TransferLabConfig, engine: TransferEngine, buf: RegisteredBuffer, segment: str) -> None:
        self.cfg, self.engine, self.buf, self.segment = cfg, engine, buf, segment
        rng = np.random.default_rng(cfg.seed)
        self.data = rng.integers(0, 256, cfg.batch_bytes, dtype=np.uint8)
        self.back = np.zeros(cfg.batch_bytes, np.uint8)

    def run_batch(self, op: str) -> tuple[float, str]:
        """One batch of `op`; its seconds and "" or what went wrong (an error, wrong bytes)."""
        block, target = self.cfg.block_bytes, np.frombuffer(self.buf.view, np.uint8)[: self.cfg.batch_bytes]
        if op == "write":
            self.data[::4096] += 1  # NOTE: new bytes each batch, so that a stale write shows
        else:
            self.back[:] = 0
        local = self.data if op == "write" else self.back
        code = OpCode.WRITE if op == "write" else OpCode.READ
        requests = [
            TransferRequest(code, self.segment, self.buf.base + i * block, local[i * block : (i + 1) * block])
            for i in range(self.cfg.batch)
        ]
        start = time.monotonic()
        statuses = self.engine.transfer(requests, timeout_s=self.cfg.timeout_s)
        seconds = time.monotonic() - start
        failed = [s for s in statuses if s.state is not RequestState.COMPLETED]
        if failed:
            return seconds, f"{failed[0].state.value}: {failed[0].reason[:160]}"
        if not np.array_equal(target, self.data if op == "write" else self.back):
            return seconds, "bytes differ"
        return seconds, ""


def _cell_row(cfg: TransferLabConfig, lab: Lab, cell: Cell, op: str, nics: int, shaped: bool) -> Row:
    """`rounds` batches of `op` after a warm-up, with the links' bytes and the CPUs' busy share."""
    cell.run_batch(op)
    before, cpu, times, errors = nic_bytes(lab, INITIATOR), cpu_times(), [], []
    for _ in range(cfg.rounds):
        seconds, error = cell.run_batch(op)
        times.append(seconds)
        if error:
            errors.append(error)
    moved = nic_bytes(lab, INITIATOR) - before
    busy, total = (x - y for x, y in zip(cpu_times(), cpu, strict=True))
    median_s = statistics.median(times)
    wire = {name: nic.tx_bytes + nic.rx_bytes for name, nic in moved.nics.items()}
    return {
        "nics": nics,
        "op": op,
        "shaped": shaped,
        "batch_bytes": cfg.batch_bytes,
        "seconds": round(median_s, 4),
        "mbit_s": round(cfg.batch_bytes * 8 / median_s / 1e6, 1),
        "nic_bytes": wire,
        "link_busy": round(sum(wire.values()) * 8 / sum(times) / (nics * cfg.nic_bps), 3),
        "cpu_busy": round(busy / total, 3) if total else None,
        "errors": errors,
    }


def _failure_run(cfg: TransferLabConfig, lab: Lab, cell: Cell, batch_s: dict[tuple[int, str], float]) -> Row:
    """Batches over two NICs, b's eth1 taken down `cut_after_s` in (see the module)."""
    cut = threading.Timer(cfg.cut_after_s, lab.link_down, (TARGET, 1))
    start = time.monotonic()
    cut.start()
    batches: list[Row] = []
    try:
        for i in range(cfg.failure_batches):
            op = ("write", "read")[i % 2]
            began = time.monotonic() - start
            seconds, error = cell.run_batch(op)
            batches.append({"op": op, "start_s": round(began, 3), "seconds": round(seconds, 4), "error": error})
    finally:
        cut.cancel()
        cut.join()
    lost = 0.0
    for b in batches:
        began, seconds, op = float(str(b["start_s"])), float(str(b["seconds"])), str(b["op"])
        if began + seconds <= cfg.cut_after_s:
            continue
        # NOTE: the cut batch should have moved its share before the cut at two NICs' rate,
        # the rest at one's; every later batch at one NIC's rate
        before = min(max(0.0, cfg.cut_after_s - began), batch_s[2, op])
        expected = before + (1 - before / batch_s[2, op]) * batch_s[1, op]
        lost += max(0.0, seconds - expected)
    return {
        "batches": batches,
        "failed": sum(1 for b in batches if b["error"]),
        "cut_after_s": cfg.cut_after_s,
        "slowest_s": max(float(str(b["seconds"])) for b in batches),
        "time_lost_s": round(lost, 3),
    }


def _engine(cfg: TransferLabConfig, lab: Lab, url: str) -> TransferEngine:
    transfer = TransferConfig(
        transport="tcp",
        bind_host=",".join(lab.addresses(INITIATOR)),
        num_connections=cfg.connections,
        slice_bytes=cfg.slice_bytes,
        timeout_s=cfg.timeout_s,
    )
    return TransferEngine("initiator", Config(transfer, MetadataConfig(url=url)))


def run(cfg: TransferLabConfig, progress: Callable[[str], None] = lambda _: None) -> Row:
    """Build the lab, run the cells and the failure run, tear it down; the figures.

    Raises:
        ConfigError: no namespaces here (naming what is missing).
        PeerError: the target process failed or hung.
    """
    rows: list[Row] = []
    progress(f"building the lab: two hosts of two NICs at {cfg.nic_rate}")
    with Lab(topology(cfg)) as lab, ExitStack() as stack:
        with lab.entered(META):
            server, _ = start_in_thread(lab.address(META))
        stack.callback(server.stop)
        try:
            peer = worker_in(lab, TARGET, "target", ["tsukimi.testing.target_peer", server.url])
            stack.callback(peer.stop)
            target = RemoteTarget(peer)
            stack.callback(target.close)
            cells = [(1, True), (2, True)] + ([(2, False)] if cfg.compare_unshaped else [])
            for nics, shaped in cells:
                progress(f"{nics} NIC(s), {'shaped' if shaped else 'unshaped'}")
                opened, buf = target.open(",".join(lab.addresses(TARGET)[:nics]), cfg.batch_bytes)
                if not shaped:
                    _reshape(lab, "unlimited")
                with lab.entered(INITIATOR), _engine(cfg, lab, server.url) as engine:
                    cell = Cell(cfg, engine, buf, str(opened["name"]))
                    rows += [_cell_row(cfg, lab, cell, op, nics, shaped) for op in ("write", "read")]
                if not shaped:
                    _reshape(lab, cfg.nic_rate)
            progress("two NICs, one taken down mid-run")
            batch_s = {(int(str(r["nics"])), str(r["op"])): float(str(r["seconds"])) for r in rows if r["shaped"]}
            opened, buf = target.open(",".join(lab.addresses(TARGET)), cfg.batch_bytes)
            with lab.entered(INITIATOR), _engine(cfg, lab, server.url) as engine:
                cell = Cell(cfg, engine, buf, str(opened["name"]))
                cell.run_batch("write")  # NOTE: the warm-up: every connection up
                failure = _failure_run(cfg, lab, cell, batch_s)
        except WorkerError as exc:
            raise PeerError(str(exc)) from exc
    hosts = [{"name": h.name, "addresses": lab.addresses(h.name)} for h in lab.topology.hosts]
    return {
        "topology": {"hosts": hosts, "nic_rate_bps": cfg.nic_bps, "shaping": "tbf, each way, every NIC of a and b"},
        "cells": rows,
        "nic_failure": failure,
    }


def _reshape(lab: Lab, rate: str) -> None:
    for host in (INITIATOR, TARGET):
        for nic in (0, 1):
            lab.set_link(host, nic, rate=rate)


def run_report(cfg: TransferLabConfig, progress: Callable[[str], None] = lambda _: None) -> BenchReport:
    """`tsukimi bench transfer --lab`: run (see `run`) and report, with the goals as verdicts.

    Raises:
        As `run`.
    """
    start = begin("bench transfer --lab", cfg)
    figures = run(cfg, progress)
    return finish(start, figures, goals(figures))
