"""The per-request term of the Conductor's TTFT estimate (tsukimi/scheduler/ttft_overhead.py):
learned from how late first tokens come against the engine-time prediction, added to every TTFT
the Conductor predicts, never feeding on itself, and forgotten when it goes stale."""

from __future__ import annotations

import dataclasses

import pytest

from tsukimi.config import ROUTER_CONDUCTOR
from tsukimi.errors import ConfigError
from tsukimi.scheduler.conductor import Conductor, ScheduleRequest
from tsukimi.scheduler.cost_model import LinearCostModel
from tsukimi.scheduler.prefix_index import PrefixIndex
from tsukimi.scheduler.ttft_overhead import TtftOverhead

COST = LinearCostModel(prefill_coef=(0.0, 1e-3, 0.0), decode_coef=(0.01, 0.0, 0.0), kv_bytes_per_token=1)


def test_the_estimate_is_a_high_quantile_of_recent_errors_floored_capped_and_forgotten() -> None:
    overhead = TtftOverhead(prior_s=0.1, window=10, horizon_s=60.0, q=0.9, cap_s=2.0)
    assert overhead.estimate_s(0.0) == 0.1  # nothing seen: the prior
    for i, error in enumerate([0.3, 0.35, 0.4, 0.32, 0.31, 0.33, 0.34, 0.36, 0.38, 0.9]):
        overhead.observe(float(i), error)
    assert overhead.estimate_s(10.0) == pytest.approx(0.4)  # the 9th of 10: one late outlier is not it
    for t in (11.0, 12.0):
        overhead.observe(t, 50.0)
    assert overhead.estimate_s(12.0) == 2.0  # capped
    assert overhead.estimate_s(100.0) == 0.1 and overhead.observed == 0  # all older than 60 s: the prior
    for t in (200.0, 201.0):
        overhead.observe(t, -0.5)  # early first tokens never make the term negative
    assert overhead.estimate_s(201.0) == 0.0


@pytest.mark.parametrize(
    "settings", [{"prior_s": -1.0}, {"window": 0}, {"horizon_s": 0.0}, {"q": 0.0}, {"q": 1.5}, {"cap_s": -1.0}]
)
def test_bad_settings_are_refused(settings: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        TtftOverhead(**settings)  # type: ignore[arg-type]


def _conductor(ttft_slo_s: float) -> Conductor:
    config = dataclasses.replace(ROUTER_CONDUCTOR, block_tokens=100, ttft_slo_s=ttft_slo_s, rejection="early")
    conductor = Conductor(config, COST, PrefixIndex(), ["p0"], ["d0"], 10**6)
    conductor.overhead = TtftOverhead()
    return conductor


def test_the_conductor_adds_the_learned_term_and_measures_errors_against_engine_time() -> None:
    conductor = _conductor(ttft_slo_s=1.5)
    first = conductor.schedule(ScheduleRequest(1, 1000, [], 16), now=0.0)
    assert first.ttft_s == pytest.approx(1.0) and first.overhead_s == 0.0
    conductor.first_token(1, now=1.4)  # 0.4 s later than its 1 s of prefill
    conductor.finished_at_prefill(1, 1.4)
    second = conductor.schedule(ScheduleRequest(2, 1000, [], 16), now=2.0)
    assert second.overhead_s == pytest.approx(0.4) and second.ttft_s == pytest.approx(1.4)
    conductor.first_token(2, now=3.4)  # 1 s of prefill + the 0.4 s: the same error, not 0.4 on top
    conductor.finished_at_prefill(2, 3.4)
    assert conductor.overhead is not None and conductor.overhead.estimate_s(3.4) == pytest.approx(0.4)
    # NOTE: 1.2 s of prefill fits the 1.5 s SLO in engine time, not with the 0.4 s the requests need
    rejected = conductor.schedule(ScheduleRequest(3, 1200, [], 16), now=4.0)
    assert (rejected.accepted, rejected.reason) == (False, "ttft_slo") and "1.60 s" in rejected.message


def test_a_queued_requests_predicted_ttft_counts_the_term_and_the_simulator_learns_none() -> None:
    conductor = _conductor(ttft_slo_s=30.0)
    conductor.schedule(ScheduleRequest(1, 1000, [], 16), now=0.0)
    conductor.first_token(1, now=1.5)
    queued = dataclasses.replace(ROUTER_CONDUCTOR, block_tokens=100)
    small = Conductor(queued, COST, PrefixIndex(), ["p0"], ["d0"], 1100)
    small.overhead = conductor.overhead
    small.schedule(ScheduleRequest(1, 1000, [], 16), now=2.0)
    waiting = small.schedule(ScheduleRequest(2, 1000, [], 16), now=2.0)
    assert waiting.queued and waiting.overhead_s == pytest.approx(0.5)
    assert waiting.ttft_s == pytest.approx(waiting.wait_s + 1.0 + 0.5)
    plain = Conductor(queued, COST, PrefixIndex(), ["p0"], ["d0"], 1100)
    assert plain.overhead is None and plain.schedule(ScheduleRequest(1, 1000, [], 16), now=0.0).overhead_s == 0.0
