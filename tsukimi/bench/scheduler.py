"""`tsukimi bench scheduler`: how fast the Conductor decides, and how fast the simulator
replays a whole trace.

- decision latency: a Conductor over `num_prefill` prefill and `num_decode` decode instances
  whose index holds `indexed_blocks` distinct blocks (the trace's own chains, spread over the
  instances' caches, hot prefixes on several); every trace request is scheduled, admitted to
  decode and finished, and each `schedule` call is timed (p50 / p99 / max, microseconds);
- simulation time: the whole trace through the Mooncake cluster (8P+8D, predicted
  rejection) and the colocated baseline (16 instances), wall seconds.

Goals (docs/benchmarks.md), as the report's verdicts: a decision's p99 within 1 ms; the whole
trace through the Mooncake cluster within 30 s.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tsukimi.bench.report import BenchReport, FigureViews, Verdict, begin, finish, goal
from tsukimi.config import SIMULATOR_CONDUCTOR, SimConfig
from tsukimi.quantiles import quantiles
from tsukimi.scheduler.conductor import Conductor, ScheduleRequest
from tsukimi.scheduler.cost_model import RooflineCostModel
from tsukimi.scheduler.prefix_index import PrefixIndex, location
from tsukimi.sim.simulator import simulate
from tsukimi.sim.trace import TraceRequest, load_trace


@dataclass(frozen=True, slots=True)
class SchedulerBenchConfig:
    trace: str
    num_prefill: int = 32
    num_decode: int = 32
    indexed_blocks: int = 100_000
    decisions: int = 5000
    simulate: bool = True


def decision_latency(trace: Sequence[TraceRequest], cfg: SchedulerBenchConfig) -> dict[str, float]:
    """Per-decision wall time of `Conductor.schedule`, in microseconds."""
    index = PrefixIndex()
    prefill = [f"prefill-{i}" for i in range(cfg.num_prefill)]
    seen: set[int] = set()
    for n, request in enumerate(trace):  # each chain on one instance, its first block on four
        if len(seen) >= cfg.indexed_blocks:
            break
        index.stored(location(prefill[n % len(prefill)], "dram"), request.hash_ids)
        for k in range(1, 4):
            index.stored(location(prefill[(n + k) % len(prefill)], "dram"), request.hash_ids[:1])
        seen.update(request.hash_ids)
    cost = RooflineCostModel()
    conductor = Conductor(
        replace(SIMULATOR_CONDUCTOR, rejection="predicted", ttft_slo_s=1e9, tbt_slo_s=1e9),
        cost,
        index,
        prefill,
        [f"decode-{i}" for i in range(cfg.num_decode)],
        cost.kv_capacity_tokens(),
    )
    times: list[float] = []
    clock = time.perf_counter
    now = 0.0
    decoding: deque[int] = deque()  # about 64 requests stay in decode, as in a busy cluster
    for i in range(cfg.decisions):
        request = trace[i % len(trace)]
        ask = ScheduleRequest(i, request.input_length, request.hash_ids)
        start = clock()
        decision = conductor.schedule(ask, now)
        times.append(clock() - start)
        now += 0.3
        if decision.accepted and conductor.admit_decode(i, now) is not None:
            decoding.append(i)
        if len(decoding) > 64:
            conductor.decode_finished(decoding.popleft(), now, 300)
    p50, p99, top = quantiles(times, (0.5, 0.99, 1.0))
    return {"indexed_blocks": float(index.num_blocks()), "p50_us": p50 * 1e6, "p99_us": p99 * 1e6, "max_us": top * 1e6}


def simulation_time(trace: Sequence[TraceRequest]) -> dict[str, float]:
    """Wall seconds to replay `trace` through each cluster shape."""
    figures: dict[str, float] = {"requests": float(len(trace))}
    for name, sim in (("pd_s", SimConfig()), ("colocated_s", SimConfig(shape="colocated"))):
        start = time.perf_counter()
        simulate(trace, sim, SIMULATOR_CONDUCTOR)
        figures[name] = time.perf_counter() - start
    return figures


def run(cfg: SchedulerBenchConfig) -> dict[str, object]:
    """The decision latency and, unless cfg.simulate is off, the whole-trace simulations; the figures."""
    trace = load_trace(cfg.trace)
    shape = {"trace": Path(cfg.trace).name, "num_prefill": cfg.num_prefill, "num_decode": cfg.num_decode}
    figures: dict[str, object] = {"shape": shape, "decision": decision_latency(trace, cfg)}
    if cfg.simulate:
        figures["simulation"] = simulation_time(trace)
    return figures


def verdicts(figures: Mapping[str, object]) -> list[Verdict]:
    """The goals (see the module); the simulation's is n/a when it did not run. Pure."""
    decision, sim = figures["decision"], figures.get("simulation")
    assert isinstance(decision, dict)
    whole = float(sim["pd_s"]) if isinstance(sim, dict) else None
    return [
        goal("decision_p99", "Conductor decision p99 (us)", float(decision["p99_us"]), "<=", 1000.0),
        goal("whole_trace", "whole trace, Mooncake 8P+8D (s)", whole, "<=", 30.0),
    ]


def run_report(cfg: SchedulerBenchConfig) -> BenchReport:
    """`tsukimi bench scheduler`: run (see `run`) and report, with the goals as verdicts."""
    start = begin("bench scheduler", cfg)
    figures = run(cfg)
    return finish(start, figures, verdicts(figures))


def markdown(figures: Mapping[str, object]) -> str:
    """The figures as the table docs/benchmarks.md holds (pure)."""
    decision, cfg = figures["decision"], figures["shape"]
    assert isinstance(decision, dict) and isinstance(cfg, dict)
    lines = [
        f"trace {cfg['trace']}.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| Conductor decision, {cfg['num_prefill']}P + {cfg['num_decode']}D, "
        f"{int(decision['indexed_blocks']):,} indexed blocks: p50 / p99 / max | "
        f"{decision['p50_us']:.0f} / {decision['p99_us']:.0f} / {decision['max_us']:.0f} us |",
    ]
    sim = figures.get("simulation")
    if isinstance(sim, dict):
        lines.append(f"| whole trace ({int(sim['requests']):,} requests), Mooncake 8P+8D | {sim['pd_s']:.1f} s |")
        lines.append(f"| whole trace, colocated 16 instances | {sim['colocated_s']:.1f} s |")
    return "\n".join(lines)


VIEWS = FigureViews(markdown)
