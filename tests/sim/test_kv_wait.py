"""Queue, then reject in the simulator: a trace whose decode KV memory is the bottleneck
queues requests (`ConductorConfig.kv_wait`) instead of rejecting them, serves them all, and
stays deterministic; with a tight TTFT SLO only requests predicted to miss it are rejected. A
burst whose decode batch would break the TBT SLO waits for it the same way.

One prefill and one decode instance; prefill 1 ms per token, a decode step 10 ms; the decode
instance holds 5,000 KV tokens, so two of these 2,000-token requests fit at a time."""

from __future__ import annotations

import dataclasses
import json

from tsukimi.config import SIMULATOR_CONDUCTOR, SimConfig
from tsukimi.scheduler.cost_model import LinearCostModel
from tsukimi.sim.report import Slo, summarize
from tsukimi.sim.simulator import simulate
from tsukimi.sim.trace import TraceRequest

COST = LinearCostModel(prefill_coef=(0.0, 1e-3, 0.0), decode_coef=(0.01, 0.0, 0.0), kv_bytes_per_token=1)
SIM = SimConfig(num_prefill=1, num_decode=1, decode_kv_tokens=5000, reservation="oracle")
TRACE = [TraceRequest(10 * n, 2000, 100, (n * 10 + 1, n * 10 + 2)) for n in range(12)]  # 12 in 0.11 s


def _run(**cfg: object) -> dict[str, object]:
    conductor = dataclasses.replace(SIMULATOR_CONDUCTOR, kv_bandwidth_bytes_s=1e9, **cfg)  # type: ignore[arg-type]
    return summarize(simulate(TRACE, SIM, conductor, COST), Slo(conductor.ttft_slo_s, conductor.tbt_slo_s))


def test_a_kv_bound_trace_queues_instead_of_rejecting_and_is_deterministic() -> None:
    rejecting = _run(kv_wait=False)
    assert rejecting["rejected_by_reason"] == {"kv_memory": 10} and rejecting["queued"] == 0
    waiting = _run()
    assert (waiting["completed"], waiting["rejected"], waiting["queued"]) == (12, 0, 10)
    assert waiting["queued_met_ttft_slo"] == 10
    assert json.dumps(waiting, sort_keys=True) == json.dumps(_run(), sort_keys=True)


def test_with_a_tight_ttft_slo_only_those_predicted_to_miss_it_are_rejected() -> None:
    conductor = dataclasses.replace(SIMULATOR_CONDUCTOR, kv_bandwidth_bytes_s=1e9, ttft_slo_s=8.0)
    result = simulate(TRACE, SIM, conductor, COST)
    assert set(result.rejected.values()) == {"ttft_slo"} and 0 < len(result.rejected) < len(TRACE) - 2
    assert all(ttft <= 8.0 for ttft in result.queued.values())  # every queued one was predicted to meet it
    done = {j.request_id for j in result.jobs if j.finish_s >= 0} - set(result.rejected)
    assert done == set(range(12)) - set(result.rejected)


def test_a_tbt_bound_burst_waits_for_the_decode_batch_and_is_served_whole() -> None:
    # NOTE: a decode step costs 10 ms + 1 ms per request; with a 12.5 ms TBT SLO the decode
    # instance takes two at a time, and the burst's twelve arrive within 0.11 s
    batched = LinearCostModel(prefill_coef=(0.0, 1e-4, 0.0), decode_coef=(0.01, 1e-3, 0.0), kv_bytes_per_token=1)
    sim = dataclasses.replace(SIM, decode_kv_tokens=10**6)
    conductor = dataclasses.replace(SIMULATOR_CONDUCTOR, kv_bandwidth_bytes_s=1e9, tbt_slo_s=0.0125)
    slo = Slo(conductor.ttft_slo_s, conductor.tbt_slo_s)
    rejecting = summarize(simulate(TRACE, sim, dataclasses.replace(conductor, kv_wait=False), batched), slo)
    assert rejecting["rejected"] >= 8  # type: ignore[operator]
    waiting = summarize(simulate(TRACE, sim, conductor, batched), slo)
    assert (waiting["completed"], waiting["rejected"], waiting["slo_attainment"]) == (12, 0, 1.0)
    again = summarize(simulate(TRACE, sim, conductor, batched), slo)
    assert json.dumps(waiting, sort_keys=True) == json.dumps(again, sort_keys=True)
