"""Contended KV links in the simulator (`simulate(..., contention=True)`): two prefill
instances fetching one prefix from its single holder at once share the holder's link, so
each fetch takes twice as long; replicas of a hot prefix are copied over the same links; the
run stays deterministic."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tsukimi.config import SIMULATOR_CONDUCTOR, SimConfig
from tsukimi.scheduler.cost_model import RooflineCostModel, chunked_prefill_s
from tsukimi.scheduler.hotspots import HotSpotConfig
from tsukimi.sim.hotspots import SkewedWorkload, skewed_trace
from tsukimi.sim.instances import Job
from tsukimi.sim.report import Slo, summarize
from tsukimi.sim.simulator import _PdRun, simulate
from tsukimi.sim.trace import TraceRequest

COST = RooflineCostModel()
BANDWIDTH = 50e9  # bytes/s per source link: the 8,192-token prefix (2.7 GB of LLaMA2-70B KV) takes 54 ms
CONDUCTOR = dataclasses.replace(SIMULATOR_CONDUCTOR, rejection="none", kv_bandwidth_bytes_s=BANDWIDTH)
SIM = SimConfig(num_prefill=3, num_decode=1)
PREFIX = tuple(range(1, 17))  # 16 blocks of 512 tokens
RAMPING = SkewedWorkload(requests=300, rate_rps=20.0, shared=0.95, phase_s=5.0, ramp_s=3.0)
RAMPING_SIM = SimConfig(num_prefill=6, num_decode=2)
RAMPING_CONDUCTOR = dataclasses.replace(SIMULATOR_CONDUCTOR, rejection="none", kv_bandwidth_bytes_s=25e9)
HOT = HotSpotConfig(threshold_rps=1.0)


def _trace() -> list[TraceRequest]:
    """The prefix computed once on one instance, then three requests for it at once: one runs
    on the holder, the other two fetch it from the holder together. One output token each,
    so no KV goes on to decode."""
    first = TraceRequest(0, 18 * 512, 1, (*PREFIX, 100, 101))
    burst = [TraceRequest(10_000, 18 * 512, 1, (*PREFIX, 200 + 2 * i, 201 + 2 * i)) for i in range(3)]
    return [first, *burst]


@pytest.mark.parametrize(("contention", "sharing"), [(False, 1), (True, 2)])
def test_two_fetches_from_one_holder_take_twice_as_long(contention: bool, sharing: int) -> None:
    jobs = simulate(_trace(), SIM, CONDUCTOR, COST, contention=contention).jobs
    fetchers = [job for job in jobs[1:] if job.fetch_tokens]
    assert len(fetchers) == 2 and len({job.instances[0] for job in fetchers}) == 2
    transfer_s = COST.transfer_s(16 * 512, BANDWIDTH)
    compute_s = chunked_prefill_s(COST, 2 * 512, 16 * 512, CONDUCTOR.prefill_chunk_tokens)
    for job in fetchers:
        assert job.fetch_tokens == 16 * 512
        assert job.first_token_s - job.arrival_s == pytest.approx(sharing * transfer_s + compute_s)


def test_deterministic_with_contention_and_replication() -> None:
    trace = skewed_trace(RAMPING)
    reports = [
        json.dumps(summarize(simulate(trace, RAMPING_SIM, RAMPING_CONDUCTOR, hot=HOT, contention=True), Slo(30, 0.1)))
        for _ in range(2)
    ]
    assert reports[0] == reports[1]


def test_replicas_are_copied_from_the_least_loaded_holder_over_its_link() -> None:
    run = _PdRun(RAMPING_SIM, RAMPING_CONDUCTOR, COST, HOT, True)
    trace = skewed_trace(RAMPING)
    jobs = [Job(i, r.timestamp_ms / 1000, r.input_length, r.output_length, r.hash_ids) for i, r in enumerate(trace)]
    run.run(jobs, None)
    assert run.hot is not None and run.links is not None and run.hot.num_replicas > 0
    fetches = sum(job.fetch_tokens > 0 for job in jobs)
    decode_pushes = sum(len(job.instances) == 2 for job in jobs)
    # every fetch, replica copy and prefill-to-decode push went over a contended link
    assert run.links.num_transfers == fetches + run.hot.num_replicas + decode_pushes
