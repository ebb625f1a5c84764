"""The per-job term of a prefill instance's service (tsukimi/scheduler/service_term.py): learned
from how much longer than their engine time prefills take, booked into every prefill (so into
the TTFT and the queue behind it), never feeding on itself, and forgotten when it goes stale."""

from __future__ import annotations

import dataclasses

import pytest

from tsukimi.config import ROUTER_CONDUCTOR
from tsukimi.errors import ConfigError
from tsukimi.scheduler.conductor import Conductor, ScheduleRequest
from tsukimi.scheduler.cost_model import LinearCostModel
from tsukimi.scheduler.prefix_index import PrefixIndex
from tsukimi.scheduler.service_term import ServiceTerm

COST = LinearCostModel(prefill_coef=(0.0, 1e-3, 0.0), decode_coef=(0.01, 0.0, 0.0), kv_bytes_per_token=1)


def test_the_estimate_is_a_quantile_of_recent_errors_floored_capped_and_forgotten() -> None:
    term = ServiceTerm(prior_s=0.1, window=10, horizon_s=60.0, q=0.9, cap_s=2.0)
    assert term.estimate_s(0.0) == 0.1  # nothing seen: the prior
    for i, error in enumerate([0.3, 0.35, 0.4, 0.32, 0.31, 0.33, 0.34, 0.36, 0.38, 0.9]):
        term.observe(float(i), error)
    assert term.estimate_s(10.0) == pytest.approx(0.4)  # the 9th of 10: one late outlier is not it
    for t in (11.0, 12.0):
        term.observe(t, 50.0)
    assert term.estimate_s(12.0) == 2.0  # capped
    assert term.estimate_s(100.0) == 0.1 and term.observed == 0  # all older than 60 s: the prior
    for t in (200.0, 201.0):
        term.observe(t, -0.5)  # jobs done sooner than their engine time never make it negative
    assert term.estimate_s(201.0) == 0.0
    assert ServiceTerm().q == 0.5  # the median by default: it adds up over a queue


@pytest.mark.parametrize(
    "settings", [{"prior_s": -1.0}, {"window": 0}, {"horizon_s": 0.0}, {"q": 0.0}, {"q": 1.5}, {"cap_s": -1.0}]
)
def test_bad_settings_are_refused(settings: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        ServiceTerm(**settings)  # type: ignore[arg-type]


def _conductor(ttft_slo_s: float = 30.0, capacity: int = 10**6) -> Conductor:
    config = dataclasses.replace(ROUTER_CONDUCTOR, block_tokens=100, ttft_slo_s=ttft_slo_s, rejection="early")
    conductor = Conductor(config, COST, PrefixIndex(), ["p0"], ["d0"], capacity)
    conductor.service = ServiceTerm()
    return conductor


def test_a_prefill_instance_learns_its_per_job_term_and_books_it_into_its_queue() -> None:
    conductor = _conductor()
    for rid in (1, 2):
        first = conductor.schedule(ScheduleRequest(rid, 1000, [], 16), now=0.0)
    assert first.ttft_s == pytest.approx(2.0)  # 1 s of prefill each, back to back, nothing learned
    # NOTE: each really took 1.5 s; the second began when the first ended
    for rid, done in ((1, 1.5), (2, 3.0)):
        conductor.finished_at_prefill(rid, done)
    assert conductor.service is not None and conductor.service.estimate_s(3.0) == pytest.approx(0.5)
    burst = [conductor.schedule(ScheduleRequest(rid, 1000, [], 16), now=3.0) for rid in (3, 4, 5)]
    assert [round(d.ttft_s, 3) for d in burst] == [1.5, 3.0, 4.5] and burst[0].prefill_s == pytest.approx(1.5)
    # NOTE: measured against the engine time: jobs that take the 1.5 s predicted teach 0.5 s again
    for rid, done in ((3, 4.5), (4, 6.0), (5, 7.5)):
        conductor.finished_at_prefill(rid, done)
    assert conductor.service.estimate_s(7.5) == pytest.approx(0.5)


def test_the_learned_term_decides_the_slo_and_counts_in_a_queued_wait() -> None:
    conductor = _conductor(ttft_slo_s=1.3)
    conductor.schedule(ScheduleRequest(1, 1000, [], 16), now=0.0)
    conductor.finished_at_prefill(1, 1.4)  # 0.4 s over its 1 s of engine time
    # NOTE: 1.2 s of prefill fits the 1.3 s SLO in engine time, not with the 0.4 s a job needs
    rejected = conductor.schedule(ScheduleRequest(2, 1200, [], 16), now=2.0)
    assert (rejected.accepted, rejected.reason) == (False, "ttft_slo") and "1.60 s" in rejected.message
    small = _conductor(capacity=1100)
    small.service = conductor.service
    small.schedule(ScheduleRequest(1, 1000, [], 16), now=2.0)
    waiting = small.schedule(ScheduleRequest(2, 1000, [], 16), now=2.0)
    assert waiting.queued and waiting.prefill_s == pytest.approx(1.4)
    assert waiting.ttft_s == pytest.approx(waiting.wait_s + 1.4)


def test_the_simulator_learns_none() -> None:
    config = dataclasses.replace(ROUTER_CONDUCTOR, block_tokens=100)
    plain = Conductor(config, COST, PrefixIndex(), ["p0"], ["d0"], 10**6)
    assert plain.service is None
    plain.schedule(ScheduleRequest(1, 1000, [], 16), now=0.0)
    plain.finished_at_prefill(1, 5.0)
    assert plain.schedule(ScheduleRequest(2, 1000, [], 16), now=5.0).prefill_s == pytest.approx(1.0)
