"""`tsukimi bench serve --workload overload`: the API under 4x the sustainable request rate
(issue 17, item 3). One run, in order:

1. baseline: a fixed greedy prompt, answered once (its text and token count are kept);
2. sustainable rate (after `idle_health_s` of /health probes on the idle cluster, the baseline
   of the probe's latency): a closed-loop step ramp (`concurrency` clients each sending the next
   request as soon as the last ended, for `calibrate_s` split over the steps); the highest
   served requests/s of any step is the rate the cluster keeps up with;
3. overload: Poisson arrivals at `factor` times that rate for `duration_s` (the mixed workload,
   `mixed_requests`), every request bounded by `request_timeout_s`, then the requests
   still running are drained (each ends by its timeout at the latest); meanwhile /health is
   probed on a connection of its own, on the API's port and on the router's health port
   (off its loop and process) (`health_url`; the bench's own cluster gets one: `router.health_port`), and
   every cluster process's RSS is sampled (overload_monitor.py); then each request's
   admission latency (from the router's door to its Conductor decision) is read from the
   decision log (`GET /decisions`; the newest 4096 requests: all of a --quick run's);
4. after: `post_checks` requests of the baseline prompt (streamed and not) must all be served
   with the baseline's text and token count.

Requests go through the bench's one client (tsukimi/bench/client.py: a connection of its own
per request, never raising, sorting each into served / rejected / error / failed).
overload_report.py turns the outcomes into figures and a verdict per criterion.

The mixed workload: prompts of mixed lengths (a few token ids to a few hundred), half of them
after one of a few shared system prefixes, small `max_tokens`, streamed or not at random.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tsukimi.bench.client import CompletionRequest, CompletionResult, complete
from tsukimi.bench.overload_monitor import HealthProbe, Probe, RssSampler, admission_latencies
from tsukimi.bench.overload_report import LoadRun, summarize, verdicts
from tsukimi.bench.report import BenchReport, begin, finish
from tsukimi.bench.up_cluster import launch_up, serving_settings
from tsukimi.errors import PeerError
from tsukimi.netio import free_port

_BASELINE = CompletionRequest(tuple(range(20, 52)), 8, stream=False)  # NOTE: fixed and greedy: the same answer
_VOCAB = (3, 250)  # NOTE: ids every tokenizer here has (as in the chat and skewed workloads)


@dataclass(frozen=True, slots=True)
class OverloadConfig:
    """`url` of a running API ("" starts `tsukimi up --model model --mode mode`, with a health
    port; RSS is only sampled then), and the phases' lengths and rates (see the module)."""

    url: str = ""
    model: str = "tiny"
    mode: str = "pd"
    duration_s: float = 60.0
    factor: float = 4.0
    calibrate_s: float = 16.0
    concurrency: tuple[int, ...] = (2, 4, 8, 16)
    idle_health_s: float = 3.0  # /health probed this long before any load: the idle baseline
    request_timeout_s: float = 60.0  # NOTE: twice the Conductor's default TTFT SLO (30 s): admitted ones fit
    health_interval_s: float = 0.2
    post_checks: int = 4
    num_blocks: int = 512  # each worker's KV cache: `tsukimi up`'s default
    seed: int = 0
    health_url: str = ""  # with `url`: its router's health port ("" = none)


@dataclass(frozen=True, slots=True)
class Calibration:
    concurrency: int
    seconds: float
    served: int
    rejected: int
    other: int

    @property
    def served_rps(self) -> float:
        return self.served / self.seconds if self.seconds else 0.0


def mixed_requests(count: int, seed: int) -> list[CompletionRequest]:
    """`count` requests of the mixed workload (pure: the same for the same seed)."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(*_VOCAB, 192).tolist() for _ in range(3)]
    out = []
    for _ in range(count):
        own = rng.integers(*_VOCAB, int(rng.choice((8, 32, 96, 256)))).tolist()
        shared = rng.random() < 0.5
        prompt = prefixes[int(rng.integers(len(prefixes)))] + own if shared else own
        out.append(CompletionRequest(tuple(prompt), int(rng.integers(2, 13)), stream=bool(rng.random() < 0.5)))
    return out


def run_bench(cfg: OverloadConfig, progress: Callable[[str], None]) -> dict[str, object]:
    """The whole run (see the module) against cfg.url or a `tsukimi up` cluster of its own
    (tsukimi/bench/up_cluster.py); the figures. Raises PeerError when the cluster does not
    start or serves nothing at all."""
    if cfg.url:
        return asyncio.run(_run(cfg, cfg.url, {}, progress))
    progress(f"starting tsukimi up --model {cfg.model} --mode {cfg.mode}")
    port = free_port()
    settings = serving_settings(cfg.model, cfg.mode, num_blocks=cfg.num_blocks, extra=[f"router.health_port={port}"])
    with (
        tempfile.TemporaryDirectory(prefix="tsukimi-bench-overload-") as workdir,
        launch_up(settings, Path(workdir)) as cluster,
        cluster.tending(),
    ):
        pids = {p.name: p.pid for p in cluster.processes}
        own = dataclasses.replace(cfg, health_url=f"http://127.0.0.1:{port}")
        return asyncio.run(_run(own, cluster.api, pids, progress))


def run_report(cfg: OverloadConfig, progress: Callable[[str], None]) -> BenchReport:
    """`tsukimi bench serve --workload overload`: run and report, a verdict per criterion."""
    start = begin("bench serve --workload overload", cfg)
    figures = run_bench(cfg, progress)
    return finish(start, figures, verdicts(figures))


async def _run(
    cfg: OverloadConfig, url: str, pids: dict[str, int], progress: Callable[[str], None]
) -> dict[str, object]:
    rss = RssSampler(pids)
    baseline = await complete(url, cfg.model, _BASELINE, cfg.request_timeout_s)
    if baseline.kind != "served":
        raise PeerError(f"the baseline request was not served: {baseline}")
    rss.start()
    try:
        idle_probes = await _idle_probes(url, cfg)
        progress(f"measuring the sustainable rate: closed loop at {cfg.concurrency} clients")
        steps = await _calibrate(url, cfg)
        sustainable = max(step.served_rps for step in steps)
        if sustainable <= 0:
            raise PeerError(f"the cluster served nothing in the closed loop: {steps}")
        progress(
            f"sustainable {sustainable:.2f} req/s; offering {cfg.factor * sustainable:.2f} req/s "
            f"for {cfg.duration_s:g} s"
        )
        load = await _overload(url, cfg, cfg.factor * sustainable, rss)
        progress(f"{len(load.outcomes)} requests ended; checking that the cluster serves normally")
        admission = await admission_latencies(url, [o.request_id for o in load.outcomes if o.request_id])
        after = await _post_load(url, cfg)
    finally:
        samples = rss.stop()
    calibration = [asdict(s) | {"served_rps": round(s.served_rps, 3)} for s in steps]
    run = dataclasses.replace(
        load,
        sustainable_rps=sustainable,
        calibration=calibration,
        rss=samples,
        baseline=baseline,
        after=after,
        idle_probes=idle_probes,
        admission_s=admission,
    )
    return summarize(run)


async def _idle_probes(url: str, cfg: OverloadConfig) -> list[Probe]:
    """/health probed for cfg.idle_health_s with nothing else running: the probe's baseline."""
    idle = HealthProbe(url, cfg.health_interval_s)
    try:
        idle.start()
        await asyncio.sleep(cfg.idle_health_s)
    finally:
        probes = idle.stop()
    return probes


async def _overload(url: str, cfg: OverloadConfig, rate: float, rss: RssSampler) -> LoadRun:
    """The open loop at `rate`, with /health probed (the API's, the health port's) and each
    process's CPU time noted."""
    health = HealthProbe(url, cfg.health_interval_s)
    side = HealthProbe(cfg.health_url, cfg.health_interval_s) if cfg.health_url else None
    try:
        health.start()
        if side is not None:
            side.start()
        load_from, cpu_from = time.perf_counter() - rss.origin, rss.cpu_mark() | {"bench": time.process_time()}
        outcomes, sending_s, wall_s, lag_s = await _open_loop(url, cfg, rate)
        load_to, cpu_to = time.perf_counter() - rss.origin, rss.cpu_mark() | {"bench": time.process_time()}
    finally:
        probes = health.stop()
        port_probes = side.stop() if side is not None else []
    cpu = {
        name: round(100 * (cpu_to[name] - cpu_from[name]) / (load_to - load_from), 1)
        for name in cpu_to
        if name in cpu_from
    }
    window = (load_from, load_to)
    return LoadRun(
        cfg.duration_s, rate, outcomes, sending_s, wall_s, lag_s, probes, window, cpu, port_probes=port_probes
    )


async def _calibrate(url: str, cfg: OverloadConfig) -> list[Calibration]:
    """The closed-loop step ramp: each step's served rate (see the module)."""
    requests = itertools.cycle(mixed_requests(512, cfg.seed))
    seconds = cfg.calibrate_s / len(cfg.concurrency)
    return [await _closed_loop(url, cfg, n, seconds, requests) for n in cfg.concurrency]


async def _closed_loop(
    url: str, cfg: OverloadConfig, concurrency: int, seconds: float, requests: Iterator[CompletionRequest]
) -> Calibration:
    outcomes: list[CompletionResult] = []
    start = time.perf_counter()

    async def loop() -> None:
        while time.perf_counter() - start < seconds:
            outcome = await complete(url, cfg.model, next(requests), cfg.request_timeout_s)
            outcomes.append(outcome)
            if outcome.kind != "served":
                await asyncio.sleep(0.05)  # NOTE: a rejection is quick; do not spin on it

    await asyncio.gather(*(loop() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    kinds = [o.kind for o in outcomes]
    served, rejected = kinds.count("served"), kinds.count("rejected")
    return Calibration(concurrency, round(elapsed, 3), served, rejected, len(kinds) - served - rejected)


async def _open_loop(url: str, cfg: OverloadConfig, rate: float) -> tuple[list[CompletionResult], float, float, float]:
    """Poisson arrivals at `rate` for cfg.duration_s, then every request drained. Returns the
    outcomes (one per request sent), the seconds spent sending, the seconds until the last
    request ended, and the latest a request was sent after its arrival time (how far the load
    generator fell behind)."""
    rng = np.random.default_rng(cfg.seed + 1)
    tasks: list[asyncio.Task[CompletionResult]] = []
    workload = itertools.cycle(mixed_requests(1024, cfg.seed + 2))
    start, at, lag = time.perf_counter(), float(rng.exponential(1 / rate)), 0.0
    while at < cfg.duration_s:
        delay = at - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        lag = max(lag, -delay)
        tasks.append(asyncio.create_task(complete(url, cfg.model, next(workload), cfg.request_timeout_s)))
        at += float(rng.exponential(1 / rate))
    sending = time.perf_counter() - start
    outcomes = list(await asyncio.gather(*tasks))
    return outcomes, sending, time.perf_counter() - start, lag


async def _post_load(url: str, cfg: OverloadConfig) -> list[CompletionResult]:
    """cfg.post_checks baseline requests, one after the other, streamed and not in turn."""
    await asyncio.sleep(1.0)  # NOTE: let the last aborted streams' frees reach the workers
    out = []
    for i in range(cfg.post_checks):
        request = dataclasses.replace(_BASELINE, stream=i % 2 == 1)
        out.append(await complete(url, cfg.model, request, cfg.request_timeout_s))
    return out
