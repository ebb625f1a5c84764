"""`tsukimi bench p2p`: one origin process broadcasts a checkpoint to N receiver processes.

For each N, three systems in turn on loopback (the origin process lives through the run):
  tsukimi  every receiver calls `P2PStore.get_replica` on the payload the origin registered
           (64 MiB shards, each read from a random holder: other receivers first, the origin
           as fallback);
  naive    every receiver READs the origin's registered buffer itself, shard by shard, with
           the same shards in flight as the P2P store (`p2p.max_inflight`): raw Transfer
           Engine reads, no P2P store;
  gloo     `torch.distributed.broadcast` (gloo, CPU tensors, TCP) from rank 0 over N+1 fresh
           processes, one broadcast per shard.
Receivers start together: all of them are up (buffers faulted in, engines started) before
the driver sends one "go" to each (gloo: a `dist.barrier()`). seconds = the last receiver's
end - the first one's start (CLOCK_MONOTONIC, shared by the host's processes); then every
receiver checks each shard's crc32c against the origin's (not timed, and a run with a wrong
byte fails). origin_bytes: for tsukimi and naive the bytes the receivers read from the
origin (`P2PStats.bytes_from_gold`; naive: everything); for gloo what rank 0's process wrote
(`/proc/self/io` wchar: every write-like syscall of its threads, the broadcast's socket
writes and little else); replica_bytes likewise what came from / was sent by the others.
Transports: gloo moves bytes over TCP, so tcp (the default) is the like-for-like comparison
of the two designs; `auto` lets tsukimi pick what it would on one host (cma, one copy).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Protocol

from tsukimi.bench.child import module_args
from tsukimi.bench.p2p_report import Row, goals
from tsukimi.bench.report import BenchReport, begin, finish
from tsukimi.config import P2PConfig
from tsukimi.errors import ConfigError, PeerError
from tsukimi.netio import free_port
from tsukimi.quantiles import rank_index
from tsukimi.testing.processes import JsonWorker, Reply, WorkerError, gather
from tsukimi.transfer.metadata.http import start_in_thread

logger = logging.getLogger(__name__)

MIB, GIB = 1 << 20, 1 << 30
SYSTEMS = ("tsukimi", "naive", "gloo")
TRANSPORTS = ("tcp", "auto")
# resident memory of a worker besides its checkpoint copy (interpreter, numpy, engine; torch)
_PROCESS_OVERHEAD_BYTES = 200 * MIB
_TORCH_OVERHEAD_BYTES = 450 * MIB
_MEMORY_HEADROOM = 0.85
_LOOPBACK_GLOO_ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


@dataclass(frozen=True, slots=True)
class Where:
    """Where one worker runs: under `launcher` (the lab bench: `ip netns exec NS`, an emulated
    host), with `env` added to ours and `args` merged into its JSON arguments."""

    launcher: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    args: Mapping[str, object] = field(default_factory=dict)


Placement = Callable[[str, int], Where]  # (role "origin" | "receiver" | "gloo", index) -> where it runs
Spec = tuple[str, list[str], Where]  # a worker's label, role and arguments, where it runs


def on_this_host(role: str, index: int) -> Where:
    """Every worker a plain child of this process, on loopback (`tsukimi bench p2p`)."""
    return Where(env=_LOOPBACK_GLOO_ENV if role == "gloo" else {})


class RoundProbe(Protocol):
    """Watches the timed part of a round (the lab bench: link counters, CPU): `start` just
    before the workers get "go", `stop` once every one replied; its figures join the row."""

    def start(self) -> None: ...

    def stop(self) -> dict[str, object]: ...


class _NoProbe:
    def start(self) -> None:
        pass

    def stop(self) -> dict[str, object]:
        return {}


@dataclass(frozen=True, slots=True)
class P2PBenchConfig:
    receivers: tuple[int, ...] = (1, 2, 4, 8)
    checkpoint_bytes: int = 512 * MIB
    shard_bytes: int = 64 * MIB
    transports: tuple[str, ...] = ("tcp",)
    systems: tuple[str, ...] = SYSTEMS
    inflight: int = P2PConfig().max_inflight
    timeout_s: float = 300.0
    repeats: int = 3
    seed: int = 15

    def __post_init__(self) -> None:
        if not self.systems or not set(self.systems) <= set(SYSTEMS):
            raise ConfigError(f"systems must be some of {', '.join(SYSTEMS)}, got {','.join(self.systems)!r}")
        if not self.transports or not set(self.transports) <= set(TRANSPORTS):
            raise ConfigError(f"transport must be some of {', '.join(TRANSPORTS)}, got {','.join(self.transports)!r}")
        if not self.receivers or any(not 1 <= n <= 64 for n in self.receivers):
            raise ConfigError("receivers must be counts in 1..64")
        if not 4096 <= self.shard_bytes <= self.checkpoint_bytes:
            raise ConfigError("shard size must be >= 4 KiB and at most the checkpoint size")
        if self.inflight < 1 or self.timeout_s <= 0 or self.repeats < 1:
            raise ConfigError("inflight must be >= 1, timeout > 0 and repeats >= 1")

    @property
    def te_systems(self) -> tuple[str, ...]:
        return tuple(s for s in self.systems if s != "gloo")


def memory_needed(cfg: P2PBenchConfig) -> int:
    """Peak resident bytes of the run: the biggest round's processes (the Transfer Engine
    origin stays up through the gloo rounds)."""
    procs = max(cfg.receivers) + 1
    te = procs * (cfg.checkpoint_bytes + _PROCESS_OVERHEAD_BYTES) if cfg.te_systems else 0
    gloo = procs * (cfg.checkpoint_bytes + _TORCH_OVERHEAD_BYTES) if "gloo" in cfg.systems else 0
    if gloo and te:
        gloo += cfg.checkpoint_bytes + _PROCESS_OVERHEAD_BYTES
    return max(te, gloo)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def check_memory(cfg: P2PBenchConfig, available: int | None = None) -> None:
    """Raises ConfigError, naming a size that fits, when the run would not fit in memory."""
    available = mem_available() if available is None else available
    needed, usable = memory_needed(cfg), int(available * _MEMORY_HEADROOM)
    if needed <= usable:
        return
    procs = max(cfg.receivers) + 2
    fits = (usable - procs * _TORCH_OVERHEAD_BYTES) // procs // cfg.shard_bytes * cfg.shard_bytes
    hint = f"try --size {fits // MIB}MiB" if fits >= cfg.shard_bytes else "use fewer --receivers"
    raise ConfigError(
        f"this run needs about {needed / GIB:.1f} GiB of memory ({max(cfg.receivers)} receivers and an "
        f"origin each holding {cfg.checkpoint_bytes / GIB:.2f} GiB), {available / GIB:.1f} GiB is available: {hint}"
    )


def _start(stack: ExitStack, specs: list[Spec], timeout_s: float) -> list[JsonWorker]:
    """Start the workers at once, each ready within `timeout_s`; each stops when `stack`
    closes. Raises WorkerError."""
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [
            pool.submit(
                JsonWorker, label, module_args("p2p-worker", *args), timeout_s, dict(where.env), wrapper=where.launcher
            )
            for label, args, where in specs
        ]
    workers: list[JsonWorker] = []
    errors: list[BaseException] = []
    for future in futures:
        if (exc := future.exception()) is not None:
            errors.append(exc)
        else:
            workers.append(future.result())
            stack.callback(workers[-1].stop)
    if errors:
        raise errors[0]
    return workers


def _row(system: str, transport: str, n: int, cfg: P2PBenchConfig, pulls: list[Reply]) -> Row:
    seconds = max(float(p["done"]) for p in pulls) - min(float(p["start"]) for p in pulls)
    return {
        "system": system,
        "transport": transport,
        "receivers": n,
        "checkpoint_bytes": cfg.checkpoint_bytes,
        "seconds": round(seconds, 6),
        "gbps": round(n * cfg.checkpoint_bytes / seconds / 1e9, 4),
    }


def _timed(workers: list[JsonWorker], cfg: P2PBenchConfig, probe: RoundProbe, **cmd: object) -> tuple[list[Reply], Row]:
    """Send every worker `cmd` (its "go") and gather the replies, `probe` watching."""
    probe.start()
    replies = gather(workers, cfg.timeout_s, **cmd)
    return replies, probe.stop()


def _spec(label: str, role: str, args: Mapping[str, object], where: Where) -> Spec:
    return label, [role, json.dumps({**args, **where.args})], where


def te_round(
    cfg: P2PBenchConfig,
    cell: tuple[str, str, int, int],
    origin: JsonWorker,
    url: str,
    place: Placement = on_this_host,
    probe: RoundProbe | None = None,
) -> Row:
    """N receivers pull the origin's checkpoint (naive: its buffer; tsukimi: a payload);
    `cell` is (system, transport, N, round); receiver i runs at `place("receiver", i)`.

    Raises:
        WorkerError: a worker failed, exited or hung.
    """
    system, transport, n, rep = cell
    args = {
        "system": system,
        "transport": transport,
        "metadata_url": url,
        "checkpoint_bytes": cfg.checkpoint_bytes,
        "shard_bytes": cfg.shard_bytes,
        "inflight": cfg.inflight,
        "timeout_s": cfg.timeout_s,
    }
    payload = f"bench-p2p-{transport}-{n}-{rep}"
    if system == "tsukimi":
        origin.call(cfg.timeout_s, cmd="publish", payload=payload)
    with ExitStack() as stack:
        specs = [_spec(f"{system} receiver {i}", "receiver", args, place("receiver", i)) for i in range(n)]
        receivers = _start(stack, specs, cfg.timeout_s)
        target = {"origin": origin.ready["name"], "base": origin.ready["base"], "payload": payload}
        pulls, watched = _timed(receivers, cfg, probe or _NoProbe(), cmd="go", **target)
        checks = gather(receivers, cfg.timeout_s, cmd="verify", crcs=origin.ready["crcs"])
        if system == "tsukimi":
            gather(receivers, cfg.timeout_s, cmd="close")
    if system == "tsukimi":
        origin.call(cfg.timeout_s, cmd="withdraw", payload=payload)
    used = sorted({str(p["transport"]) for p in pulls})
    return {
        **_row(system, "+".join(used), n, cfg, pulls),
        "origin_bytes": sum(int(p["origin_bytes"]) for p in pulls),
        "replica_bytes": sum(int(p["replica_bytes"]) for p in pulls),
        "verified": all(c["verified"] for c in checks),
        **_cpu(pulls),
        **_spent(pulls),
        **watched,
    }


def _spent(pulls: list[Reply]) -> Row:
    """tsukimi's fetch threads' seconds (P2PStats), averaged over the receivers; none for naive."""
    keys = [k for k in ("read_s", "announce_s", "idle_s") if all(k in p for p in pulls)]
    return {f"mean_{k}": round(sum(float(p[k]) for p in pulls) / len(pulls), 3) for k in keys}


def _cpu(pulls: list[Reply]) -> Row:
    """The busiest worker's CPU time during the pull, and that as a fraction of one core."""
    seconds = max(float(p["done"]) for p in pulls) - min(float(p["start"]) for p in pulls)
    busiest = max(float(p.get("cpu_s", 0.0)) for p in pulls)
    return {"max_cpu_s": round(busiest, 4), "max_cpu_x_core": round(busiest / seconds, 3) if seconds > 0 else None}


def gloo_round(
    cfg: P2PBenchConfig,
    n: int,
    place: Placement = on_this_host,
    rendezvous: str = "127.0.0.1",
    probe: RoundProbe | None = None,
) -> Row:
    """N+1 fresh processes (rank r at `place("gloo", r)`, rank 0 listening on `rendezvous`);
    rank 0 broadcasts the checkpoint, shard by shard.

    Raises:
        WorkerError: a rank failed, exited or hung.
    """
    args = {
        "checkpoint_bytes": cfg.checkpoint_bytes,
        "shard_bytes": cfg.shard_bytes,
        "seed": cfg.seed,
        "timeout_s": cfg.timeout_s,
        "world_size": n + 1,
        "init_method": f"tcp://{rendezvous}:{free_port()}",
    }
    with ExitStack() as stack:
        specs = [_spec(f"gloo rank {r}", "gloo", {**args, "rank": r}, place("gloo", r)) for r in range(n + 1)]
        ranks = _start(stack, specs, cfg.timeout_s)
        gather(ranks, cfg.timeout_s, cmd="init")
        pulls, watched = _timed(ranks, cfg, probe or _NoProbe(), cmd="go")
        checks = gather(ranks[1:], cfg.timeout_s, cmd="verify", crcs=ranks[0].ready["crcs"])
    return {
        **_row("gloo", "tcp", n, cfg, pulls),
        "origin_bytes": int(pulls[0]["written_bytes"]),
        "replica_bytes": sum(int(p["written_bytes"]) for p in pulls[1:]),
        "verified": all(c["verified"] for c in checks),
        **_cpu(pulls),
        **watched,
    }


def start_origin(stack: ExitStack, cfg: P2PBenchConfig, url: str, where: Where | None = None) -> JsonWorker:
    """The origin worker (stopped when `stack` closes), at `where` (default: here).

    Raises:
        WorkerError: it failed to start.
    """
    args = {
        "transport": "auto",
        "metadata_url": url,
        "seed": cfg.seed,
        "checkpoint_bytes": cfg.checkpoint_bytes,
        "shard_bytes": cfg.shard_bytes,
    }
    return _start(stack, [_spec("origin", "origin", args, where or on_this_host("origin", 0))], cfg.timeout_s)[0]


def _cells(cfg: P2PBenchConfig) -> list[tuple[str, str]]:
    """(system, transport) of each round of one N (gloo is tcp only)."""
    return [(system, t) for system in cfg.systems for t in (("tcp",) if system == "gloo" else cfg.transports)]


def median(rows: list[Row]) -> Row:
    """The round of median completion time (its figures kept together), with every round's."""
    ordered = sorted(rows, key=lambda r: float(str(r["seconds"])))
    return {**ordered[rank_index(len(ordered), 0.5)], "round_seconds": [r["seconds"] for r in rows]}


def run(cfg: P2PBenchConfig, progress: Callable[[str], None] = lambda _: None) -> Row:
    """Every (N, system, transport) cell `cfg.repeats` times, N ascending, the systems
    interleaved round by round; each cell's median round.

    Raises:
        ConfigError: the run would not fit in memory.
        PeerError: a worker failed, exited or hung (the message quotes its stderr tail).
    """
    check_memory(cfg)
    server, _ = start_in_thread()
    rounds: dict[tuple[int, str, str], list[Row]] = {}
    try:
        with ExitStack() as stack:
            origin = None
            if cfg.te_systems:
                progress("starting the origin")
                origin = start_origin(stack, cfg, server.url)
            for n in cfg.receivers:
                for rep in range(cfg.repeats):
                    for system, transport in _cells(cfg):
                        progress(f"{n} receivers, round {rep + 1}/{cfg.repeats}: {system} ({transport})")
                        if system == "gloo":
                            row = gloo_round(cfg, n)
                        else:
                            assert origin is not None
                            row = te_round(cfg, (system, transport, n, rep), origin, server.url)
                        rounds.setdefault((n, system, transport), []).append(row)
    except WorkerError as exc:
        raise PeerError(str(exc)) from exc
    finally:
        server.stop()
    return {"runs": [median(rows) for rows in rounds.values()]}


def run_report(cfg: P2PBenchConfig, progress: Callable[[str], None] = lambda _: None) -> BenchReport:
    """`tsukimi bench p2p`: run (see `run`) and report, with the goals (p2p_report.py) as verdicts.

    Raises:
        As `run`.
    """
    start = begin("bench p2p", cfg)
    figures = run(cfg, progress)
    runs = figures["runs"]
    assert isinstance(runs, list)
    return finish(start, figures, goals(runs))
