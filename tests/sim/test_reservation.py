"""Decode KV reserved by policy (not by the real output length): the policies' guesses, a
reservation that grows, and one that is preempted and recomputed."""

from __future__ import annotations

import pytest

from tsukimi.scheduler.cost_model import LinearCostModel
from tsukimi.sim.instances import DecodeInstance, Job
from tsukimi.sim.reservation import GROWTH_TOKENS, ReservationPolicy

# decode step 10 ms + 1 us per context token; prefill (recompute) 1 ms per token
COST = LinearCostModel(prefill_coef=(0.0, 1e-3, 0.0), decode_coef=(0.01, 0.0, 1e-6), kv_bytes_per_token=1)


def _run(capacity: int, policy: ReservationPolicy | None, output: int = 10) -> tuple[DecodeInstance, Job]:
    finished: list[Job] = []
    instance = DecodeInstance("d", COST, capacity, lambda job, now: finished.append(job), reservation=policy)
    job = Job(1, 0.0, 100, output, ())
    instance.join(job, 0.0)
    instance.advance(float("inf"))
    assert finished == [job] and instance.reserved == 0 and instance.batch == 0
    return instance, job


def test_policies_guess_from_the_cap_then_from_observed_outputs() -> None:
    assert ReservationPolicy("oracle", 2048).output_tokens(700, 1) == 700
    mean, p90 = ReservationPolicy("mean", 2048), ReservationPolicy("p90", 2048)
    assert mean.output_tokens(700, 1) == 2048 == ReservationPolicy("max_tokens", 2048).output_tokens(700, 1)
    for n in range(1, 11):  # 100, 200, ..., 1000
        mean.observe(100 * n)
        p90.observe(100 * n)
    assert (mean.output_tokens(700, 1), p90.output_tokens(700, 1)) == (550, 900)
    assert mean.output_tokens(700, 600) == 600 + GROWTH_TOKENS  # a preempted request asks for more


def test_an_outgrown_reservation_grows_when_there_is_room() -> None:
    _, oracle = _run(10_000, None)
    instance, job = _run(10_000, ReservationPolicy("max_tokens", 4))
    assert job.finish_s == pytest.approx(oracle.finish_s) and instance.preemptions == 0
    # 100 + 4 tokens for 3 steps, then 100 + 4 + 512 for the last 6 (vs 110 for all 9)
    steps = [0.01 + (100 + k) * 1e-6 for k in range(9)]
    assert job.decode_token_s == pytest.approx(104 * sum(steps[:3]) + 616 * sum(steps[3:]))
    assert oracle.decode_token_s == pytest.approx(110 * sum(steps))


def test_without_room_an_outgrown_request_is_preempted_and_recomputed() -> None:
    _, oracle = _run(200, None)
    instance, job = _run(200, ReservationPolicy("max_tokens", 4))
    assert instance.preemptions == job.preemptions == 1
    # preempted after 3 decode steps (4 tokens): its 103 tokens are recomputed (103 ms) in the step it rejoins
    assert job.finish_s == pytest.approx(oracle.finish_s + 0.103)
