"""Hot-prefix replication in the simulator (tsukimi/sim/hotspots.py): replicas land in the
prefill instances' caches, and the run stays deterministic."""

from __future__ import annotations

import dataclasses
import json

from tsukimi.config import SIMULATOR_CONDUCTOR, SimConfig
from tsukimi.scheduler.cost_model import RooflineCostModel
from tsukimi.scheduler.hotspots import HotSpotConfig
from tsukimi.scheduler.prefix_index import location
from tsukimi.sim.hotspots import SkewedWorkload, skewed_trace
from tsukimi.sim.instances import Job
from tsukimi.sim.report import Slo, summarize
from tsukimi.sim.simulator import _PdRun, simulate

WORKLOAD = SkewedWorkload(requests=200, rate_rps=2.0, prefix_blocks=16, phase_s=1000.0)
SIM = SimConfig(num_prefill=4, num_decode=2)
CONDUCTOR = dataclasses.replace(SIMULATOR_CONDUCTOR, rejection="none", reuse="local")
HOT = HotSpotConfig(threshold_rps=0.5, max_replicas=4)


def test_skewed_trace_is_deterministic_and_mostly_shared() -> None:
    trace = skewed_trace(WORKLOAD)
    assert trace == skewed_trace(WORKLOAD)
    prefix = trace[0].hash_ids[:16] if trace[0].input_length > 8 * 512 else trace[1].hash_ids[:16]
    shared = sum(r.hash_ids[:16] == prefix for r in trace)
    assert 0.8 * len(trace) <= shared <= len(trace)


def test_hot_prefix_is_replicated_to_every_prefill_instance() -> None:
    trace = skewed_trace(WORKLOAD)
    run = _PdRun(SIM, CONDUCTOR, RooflineCostModel(), HOT)
    jobs = [Job(i, r.timestamp_ms / 1000, r.input_length, r.output_length, r.hash_ids) for i, r in enumerate(trace)]
    run.run(jobs, None)
    assert run.hot is not None and run.hot.num_replicas > 0
    prefix = next(r.hash_ids[:16] for r in trace if r.input_length > 8 * 512)
    held = [name for name in run.prefill if run.index.match_at(location(name, "dram"), prefix) == 16]
    assert held == run.prefill


def test_deterministic_with_replication() -> None:
    trace = skewed_trace(WORKLOAD)
    reports = [json.dumps(summarize(simulate(trace, SIM, CONDUCTOR, hot=HOT), Slo(30, 0.1))) for _ in range(2)]
    assert reports[0] == reports[1]
