"""Queue, then reject (`ConductorConfig.kv_wait`): a request whose decode placement lacks KV
memory waits in FIFO order when its predicted TTFT, the wait included, meets the TTFT SLO;
it is released when memory frees, and rejected only when predicted to miss the SLO.

Cost model as in test_conductor.py: prefill 1 ms per token, a decode step 10 ms; one prefill
and one decode instance holding 2,500 KV tokens, so one 1,000-token request fits at a time (its
reservation counts 256 output tokens, the mean assumed before any request finished)."""

from __future__ import annotations

import dataclasses

import pytest

from tsukimi.config import SIMULATOR_CONDUCTOR
from tsukimi.scheduler.conductor import Conductor, Decision, ScheduleRequest
from tsukimi.scheduler.cost_model import LinearCostModel
from tsukimi.scheduler.prefix_index import PrefixIndex

COST = LinearCostModel(prefill_coef=(0.0, 1e-3, 0.0), decode_coef=(0.01, 0.0, 0.0), kv_bytes_per_token=1)


def _conductor(capacity: int | dict[str, int] = 2500, decode: int = 1, **cfg: object) -> Conductor:
    config = dataclasses.replace(SIMULATOR_CONDUCTOR, block_tokens=100, kv_bandwidth_bytes_s=1e12, **cfg)  # type: ignore[arg-type]
    return Conductor(config, COST, PrefixIndex(), ["p0"], [f"d{i}" for i in range(decode)], capacity)


def _request(rid: int, max_tokens: int = 0) -> ScheduleRequest:
    return ScheduleRequest(rid, 1000, [], max_tokens=max_tokens)


def test_a_request_that_does_not_fit_waits_and_is_released_when_memory_frees() -> None:
    conductor = _conductor()
    first = conductor.schedule(_request(1), now=0.0)
    assert first.accepted and not first.queued and first.decode == "d0"
    second = conductor.schedule(_request(2), now=0.0)
    # NOTE: d0 frees when the first leaves decode: its prefill (1 s) + 256 tokens x 10 ms (its
    # TBT, before any stage is observed) = 3.56 s; then its own prefill, 1 s
    assert second.accepted and second.queued and second.decode == "d0"
    assert second.wait_s == pytest.approx(3.56) and second.ttft_s == pytest.approx(4.56)
    assert "waiting 3.56 s" in second.message and conductor.queued == 1
    assert conductor.release(0.5) == []  # nothing freed yet
    assert conductor.admit_decode(1, 1.0) == "d0"
    conductor.decode_finished(1, 9.0, 800)
    [released] = conductor.release(9.0)
    assert (released.request_id, released.queued, released.prefill, released.decode) == (2, True, "p0", "d0")
    assert released.wait_s == pytest.approx(9.0) and released.ttft_s == pytest.approx(10.0)
    assert conductor.queued == 0 and conductor.counters["released"] == 1


def test_requests_predicted_to_miss_the_slo_are_rejected_and_the_rest_queue_in_order() -> None:
    conductor = _conductor(ttft_slo_s=10.0)
    decisions = [conductor.schedule(_request(rid), now=0.0) for rid in range(1, 6)]
    # TTFTs of 1 + 3.56 k s: the fourth (11.68 s) and the fifth (behind it) would miss 10 s
    assert [(d.accepted, d.queued) for d in decisions] == [
        (True, False),
        (True, True),
        (True, True),
        (False, False),
        (False, False),
    ]
    assert [round(d.ttft_s, 2) for d in decisions] == [1.0, 4.56, 8.12, 11.68, 11.68]
    assert decisions[3].reason == "ttft_slo" and "> the TTFT SLO 10 s" in decisions[3].message
    assert conductor.counters["queued"] == 2 and conductor.counters["rejected_ttft_slo"] == 2
    conductor.admit_decode(1, 1.0)
    conductor.decode_finished(1, 5.0, 1000)
    assert [d.request_id for d in conductor.release(5.0)] == [2]  # one at a time: FIFO
    conductor.admit_decode(2, 6.0)
    conductor.decode_finished(2, 7.0, 1000)
    assert [d.request_id for d in conductor.release(7.0)] == [3]


def test_a_cancelled_request_leaves_the_queue() -> None:
    conductor = _conductor()
    conductor.schedule(_request(1), now=0.0)
    conductor.schedule(_request(2), now=0.0)
    conductor.schedule(_request(3), now=0.0)
    assert conductor.cancel(2) and not conductor.cancel(2) and conductor.queued == 1
    conductor.finished_at_prefill(1, 1.0)  # its only token came from prefill: memory frees
    assert [d.request_id for d in conductor.release(1.0)] == [3]


def test_a_request_larger_than_every_instance_is_rejected_for_kv_memory() -> None:
    decision = _conductor(capacity=1200).schedule(_request(1), now=0.0)
    assert not decision.accepted and decision.reason == "kv_memory" and "1256 KV tokens" in decision.message


def test_each_decode_instance_has_its_own_capacity() -> None:
    conductor = _conductor(capacity={"d0": 2500, "d1": 4000}, decode=2)  # 1 and 3 requests of 1,256
    placed = [conductor.schedule(_request(rid), now=0.0) for rid in range(1, 4)]
    placed += [conductor.schedule(_request(4), now=0.0)]
    assert [d.decode for d in placed] == ["d1", "d1", "d0", "d1"] and not any(d.queued for d in placed)
    assert conductor.schedule(_request(5), now=0.0).queued


def test_without_kv_wait_a_request_that_does_not_fit_is_rejected() -> None:
    conductor = _conductor(capacity=2000, kv_wait=False)
    conductor.schedule(_request(1), now=0.0)
    rejected = conductor.schedule(_request(2), now=0.0)
    assert not rejected.accepted and rejected.reason == "kv_memory"


def test_a_cold_conductor_prices_decode_stages_with_the_cost_model_when_no_prior_is_fixed() -> None:
    # NOTE: a burst of short-output requests (16 tokens: under 1 s in decode at this cost model's
    # TBT, 10 ms per step + 1 ms per request) must not be priced with a fixed 10 s stage: with it,
    # every request due in the next 10 s (prefills of 0.1 s) counts as in decode at once, and the
    # TBT forecast misses the 30 ms SLO from the 21st on, and they wait
    cost = LinearCostModel(prefill_coef=(0.0, 1e-4, 0.0), decode_coef=(0.01, 1e-3, 0.0), kv_bytes_per_token=1)

    def burst(prior_s: float) -> list[str]:
        config = dataclasses.replace(
            SIMULATOR_CONDUCTOR, block_tokens=100, kv_bandwidth_bytes_s=1e12, tbt_slo_s=0.03, decode_estimate_s=prior_s
        )
        conductor = Conductor(config, cost, PrefixIndex(), ["p0"], ["d0"], 10**9)
        decisions = [conductor.schedule(ScheduleRequest(i, 1000, [], max_tokens=16), now=0.0) for i in range(40)]
        return [d.reason or "queued" for d in decisions if d.queued or not d.accepted]

    assert burst(10.0) == ["queued"] * 20  # the last 20 wait for the first to leave decode
    assert burst(0.0) == []


def test_a_table_that_sets_one_key_keeps_the_rest_of_its_fields_default() -> None:
    from tsukimi.config import ROUTER_CONDUCTOR, RouterAppConfig, load

    # NOTE: `tsukimi router`'s Conductor prices cold decode stages with the cost model
    # (decode_estimate_s 0), also when [conductor] sets another key
    assert load(RouterAppConfig).conductor == ROUTER_CONDUCTOR and ROUTER_CONDUCTOR.decode_estimate_s == 0
    assert load(RouterAppConfig, None, ["conductor.ttft_slo_s=2"]).conductor.decode_estimate_s == 0


# -- waiting for the TBT SLO ------------------------------------------------------------------
# A decode step costs 10 ms + 1 ms per request in the batch; with a 12.5 ms TBT SLO a decode
# instance takes two requests at a time.
BATCHED = LinearCostModel(prefill_coef=(0.0, 1e-3, 0.0), decode_coef=(0.01, 1e-3, 0.0), kv_bytes_per_token=1)


def _batched(**cfg: object) -> Conductor:
    settings = {"block_tokens": 100, "kv_bandwidth_bytes_s": 1e12, "tbt_slo_s": 0.0125, **cfg}
    config = dataclasses.replace(SIMULATOR_CONDUCTOR, **settings)  # type: ignore[arg-type]
    return Conductor(config, BATCHED, PrefixIndex(), ["p0"], ["d0"], 10**6)


def test_a_request_whose_decode_batch_would_break_the_tbt_slo_waits_at_arrival_and_is_released() -> None:
    conductor = _batched(rejection="early", ttft_slo_s=60.0)
    for rid, now in ((1, 0.0), (2, 0.0)):
        assert conductor.schedule(_request(rid), now).accepted
    conductor.admit_decode(1, 1.0)
    conductor.admit_decode(2, 2.0)
    third = conductor.schedule(_request(3), now=2.0)  # a batch of three: 13 ms > 12.5 ms
    assert third.accepted and third.queued and "for TBT on d0" in third.message
    # NOTE: the first is expected to leave after its 256 tokens at 13 ms (the ledger's stage before
    # any is observed), at 4.328 s; then 1 s of prefill
    assert third.wait_s == pytest.approx(2.328) and third.ttft_s == pytest.approx(3.328)
    assert conductor.release(5.0) == []  # nobody left: the batch is still two
    conductor.decode_finished(1, 6.0, 100)
    [released] = conductor.release(6.0)
    assert (released.request_id, released.queued, released.decode) == (3, True, "d0")
    assert released.wait_s == pytest.approx(4.0)


def test_a_request_predicted_to_wait_past_the_ttft_slo_for_the_tbt_is_rejected_saying_so() -> None:
    conductor = _batched(rejection="early", ttft_slo_s=3.0)
    for rid in (1, 2):
        conductor.schedule(_request(rid), 0.0)
        conductor.admit_decode(rid, float(rid))
    rejected = conductor.schedule(_request(3), now=2.0)
    assert (rejected.accepted, rejected.reason) == (False, "ttft_slo")
    assert "for TBT on d0" in rejected.message and "> the TTFT SLO 3 s" in rejected.message


def test_a_prefilled_request_waits_for_a_place_in_the_decode_batch_instead_of_being_rejected() -> None:
    # NOTE: a 0.5 s prior: at arrival each request is predicted to find the others gone
    conductor = _batched(rejection="predicted", decode_estimate_s=0.5, ttft_slo_s=60.0)
    assert all(conductor.schedule(_request(rid), 0.0).accepted for rid in (1, 2, 3, 4))
    assert conductor.admit_decode(1, 1.0, wait=True) == "d0"
    assert conductor.admit_decode(2, 2.0, wait=True) == "d0"
    waiting = conductor.admit_decode(3, 3.0, wait=True)  # the batch is still two: 13 ms > 12.5 ms
    assert isinstance(waiting, Decision) and waiting.accepted and waiting.queued and waiting.decode == "d0"
    assert "d0's batch to meet the TBT SLO" in waiting.message and conductor.queued == 1
    # NOTE: the fourth waits behind the third, in arrival order; a newcomer queues behind both
    assert isinstance(conductor.admit_decode(4, 4.0, wait=True), Decision) and conductor.queued == 2
    assert conductor.schedule(_request(5), 4.0).queued and conductor.queued == 3
    assert conductor.release(4.5) == []
    conductor.decode_finished(1, 5.0, 100)
    [third] = conductor.release(5.0)
    assert (third.request_id, third.decode, third.queued) == (3, "d0", True) and third.wait_s == pytest.approx(5.0)
    assert conductor.cancel(4) and conductor.queued == 1  # its client left: its booking goes too
    conductor.decode_finished(2, 6.0, 100)
    assert [d.request_id for d in conductor.release(6.0)] == [5]
    conductor.decode_finished(3, 7.0, 100)
    assert conductor.decode_capacity_tokens() == {"d0": 10**6}


def test_without_wait_or_past_the_ttft_slo_a_request_is_rejected_at_decode() -> None:
    for wait, slo in ((False, 60.0), (True, 3.5)):
        conductor = _batched(rejection="predicted", decode_estimate_s=0.5, ttft_slo_s=slo)
        for rid in (1, 2, 3):
            conductor.schedule(_request(rid), 0.0)
        conductor.admit_decode(1, 1.0)
        conductor.admit_decode(2, 2.0)
        answer = conductor.admit_decode(3, 3.0, wait=wait)
        if wait:
            assert isinstance(answer, Decision) and not answer.accepted and answer.reason == "ttft_slo"
            assert "> the TTFT SLO 3.5 s" in answer.message
        else:
            assert answer is None
        assert conductor.counters["rejected_at_decode"] == 1 and conductor.queued == 0
