"""The router's waiting room for requests the Conductor queued for decode KV memory or the TBT SLO
(tsukimi/serving/router/kv_wait.py): released on wake, rejected past the deadline, out of the queue
when the client leaves, given back when released onto a worker it must not use."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tsukimi.clock import WallClock
from tsukimi.config import ROUTER_CONDUCTOR
from tsukimi.errors import Rejected
from tsukimi.scheduler.conductor import Conductor, Decision, ScheduleRequest
from tsukimi.scheduler.cost_model import LinearCostModel
from tsukimi.scheduler.prefix_index import PrefixIndex
from tsukimi.serving.router.kv_wait import ReleaseWaits

COST = LinearCostModel(prefill_coef=(0.0, 1e-4, 0.0), decode_coef=(0.001, 0.0, 0.0), kv_bytes_per_token=1)


def _setup() -> tuple[Conductor, ReleaseWaits, WallClock]:
    """A conductor whose one decode instance holds one 1,000-token request (+ 16 output) at a time;
    request 1 placed, request 2 queued behind it."""
    clock = WallClock()
    conductor = Conductor(
        dataclasses.replace(ROUTER_CONDUCTOR, block_tokens=100), COST, PrefixIndex(), ["p0", "p1"], ["d0"], 1500
    )
    assert not conductor.schedule(ScheduleRequest(1, 1000, [], 16), clock.now()).queued
    assert conductor.schedule(ScheduleRequest(2, 1000, [], 16), clock.now()).queued
    return conductor, ReleaseWaits(clock), clock


def _nothing() -> set[str]:
    return set()


def test_a_queued_request_is_released_when_memory_frees() -> None:
    asyncio.run(_test_a_queued_request_is_released_when_memory_frees())


async def _test_a_queued_request_is_released_when_memory_frees() -> None:
    conductor, waits, clock = _setup()
    queued = conductor.schedule(ScheduleRequest(3, 10, [], 1), clock.now())  # FIFO: behind request 2
    waiter = asyncio.ensure_future(waits.wait(conductor, queued, clock.now() + 30, _nothing))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    conductor.finished_at_prefill(1, clock.now())
    waits.wake(conductor)  # request 2 goes first, then 3 (still fits)
    decision = await asyncio.wait_for(waiter, 10)
    assert decision is not None and decision.request_id == 3 and decision.queued and conductor.queued == 0


def test_past_the_deadline_it_is_rejected_and_leaves_the_queue() -> None:
    asyncio.run(_test_past_the_deadline_it_is_rejected_and_leaves_the_queue())


async def _test_past_the_deadline_it_is_rejected_and_leaves_the_queue() -> None:
    conductor, waits, clock = _setup()
    queued = conductor.schedule(ScheduleRequest(3, 1000, [], 16), clock.now())
    with pytest.raises(Rejected, match="waited past the TTFT deadline") as caught:
        await waits.wait(conductor, queued, clock.now() + 0.05, _nothing)
    assert caught.value.reason == "ttft_slo" and conductor.queued == 1  # request 2 still waits


def test_a_client_that_leaves_takes_its_request_out_of_the_queue() -> None:
    asyncio.run(_test_a_client_that_leaves_takes_its_request_out_of_the_queue())


async def _test_a_client_that_leaves_takes_its_request_out_of_the_queue() -> None:
    conductor, waits, clock = _setup()
    queued = conductor.schedule(ScheduleRequest(3, 1000, [], 16), clock.now())
    waiter = asyncio.ensure_future(waits.wait(conductor, queued, clock.now() + 30, _nothing))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert conductor.queued == 1 and conductor.counters["cancelled"] == 1


def test_released_onto_a_forbidden_worker_it_is_given_back() -> None:
    asyncio.run(_test_released_onto_a_forbidden_worker_it_is_given_back())


async def _test_released_onto_a_forbidden_worker_it_is_given_back() -> None:
    conductor, waits, clock = _setup()
    queued = conductor.schedule(ScheduleRequest(3, 10, [], 1), clock.now())
    waiter = asyncio.ensure_future(waits.wait(conductor, queued, clock.now() + 30, lambda: {"p0", "p1"}))
    await asyncio.sleep(0.01)
    conductor.finished_at_prefill(1, clock.now())
    waits.wake(conductor)
    assert await asyncio.wait_for(waiter, 10) is None
    # NOTE: request 2 holds 1,016 of 1,500 tokens; 474 more fit only if request 3's 26 were given back
    assert not conductor.schedule(ScheduleRequest(4, 458, [], 16), clock.now()).queued


def _at_decode() -> tuple[Conductor, ReleaseWaits, WallClock, Decision]:
    """A decode step of 10 ms + 1 ms per request under a 12.5 ms TBT SLO: two at a time; requests
    1 and 2 decode, 3 is prefilled and waits for a place (a 50 ms prior stage let all three in)."""
    clock = WallClock()
    cost = LinearCostModel(prefill_coef=(0.0, 1e-4, 0.0), decode_coef=(0.01, 1e-3, 0.0), kv_bytes_per_token=1)
    config = dataclasses.replace(ROUTER_CONDUCTOR, block_tokens=100, tbt_slo_s=0.0125, decode_estimate_s=0.05)
    conductor = Conductor(config, cost, PrefixIndex(), ["p0"], ["d0"], 10**6)
    for rid in (1, 2, 3):
        assert conductor.schedule(ScheduleRequest(rid, 1000, [], 16), clock.now()).accepted
    assert conductor.admit_decode(1, clock.now()) == conductor.admit_decode(2, clock.now()) == "d0"
    waiting = conductor.admit_decode(3, clock.now(), wait=True)
    assert isinstance(waiting, Decision) and waiting.queued and conductor.queued == 1
    return conductor, ReleaseWaits(clock), clock, waiting


def test_a_prefilled_request_waiting_for_the_decode_batch_is_released_when_one_leaves() -> None:
    asyncio.run(_test_a_prefilled_request_waiting_for_the_decode_batch_is_released_when_one_leaves())


async def _test_a_prefilled_request_waiting_for_the_decode_batch_is_released_when_one_leaves() -> None:
    conductor, waits, clock, waiting = _at_decode()
    waiter = asyncio.ensure_future(waits.wait_at_decode(conductor, waiting, clock.now() + 30))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    conductor.decode_finished(1, clock.now(), 16)
    waits.wake(conductor)
    decision = await asyncio.wait_for(waiter, 10)
    assert (decision.request_id, decision.decode, decision.queued) == (3, "d0", True) and conductor.queued == 0


def test_a_request_waiting_at_decode_past_its_deadline_or_left_gives_back_its_booking() -> None:
    asyncio.run(_test_a_request_waiting_at_decode_past_its_deadline_or_left_gives_back_its_booking())


async def _test_a_request_waiting_at_decode_past_its_deadline_or_left_gives_back_its_booking() -> None:
    conductor, waits, clock, waiting = _at_decode()
    with pytest.raises(Rejected, match=r"waited past the TTFT deadline .*batch to meet the TBT SLO") as caught:
        await waits.wait_at_decode(conductor, waiting, clock.now() + 0.05)
    assert caught.value.reason == "ttft_slo" and conductor.queued == 0
    conductor, waits, clock, waiting = _at_decode()
    waiter = asyncio.ensure_future(waits.wait_at_decode(conductor, waiting, clock.now() + 30))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert conductor.queued == 0 and conductor.counters["cancelled"] == 1
    for rid in (1, 2):  # NOTE: request 3 holds nothing any more: the two leave and the books are empty
        conductor.decode_finished(rid, clock.now(), 16)
    assert conductor.schedule(ScheduleRequest(4, 1000, [], 16), clock.now()).decode == "d0"
