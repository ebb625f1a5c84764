"""The Conductor's decisions on small hand-built clusters: which instance, why, when rejected.

The cost model is linear with round numbers so every expected time is computed by hand:
prefill costs 1 ms per uncached token (no attention term, no fixed cost), a decode step
10 ms + 1 us per context token, KV moves at 1,000 tokens per ms (bandwidth 1e6 tokens/s of
1-byte KV). The rejection policies are tested as the paper has them, rejecting at once
(`kv_wait` off); queue, then reject is tests/scheduler/test_admission.py."""

from __future__ import annotations

import dataclasses

import pytest

from tsukimi.config import SIMULATOR_CONDUCTOR
from tsukimi.errors import ConfigError, InvalidArgument
from tsukimi.scheduler.conductor import Conductor, ScheduleRequest
from tsukimi.scheduler.cost_model import LinearCostModel
from tsukimi.scheduler.prefix_index import PrefixIndex, location

COST = LinearCostModel(prefill_coef=(0.0, 1e-3, 0.0), decode_coef=(0.01, 0.0, 1e-6), kv_bytes_per_token=1)
BLOCK = 100  # tokens per block in these tests
CHAIN = list(range(1, 11))  # a 10-block, 1000-token prompt


def _conductor(
    index: PrefixIndex | None = None, prefill: int = 2, decode: int = 2, capacity: int = 100_000, **cfg: object
) -> Conductor:
    settings = {"block_tokens": BLOCK, "kv_bandwidth_bytes_s": 1e6, "prefill_chunk_tokens": 10_000, "kv_wait": False}
    config = dataclasses.replace(SIMULATOR_CONDUCTOR, **{**settings, **cfg})  # type: ignore[arg-type]
    return Conductor(
        config,
        COST,
        index or PrefixIndex(),
        [f"p{i}" for i in range(prefill)],
        [f"d{i}" for i in range(decode)],
        capacity,
    )


def _request(request_id: int = 1, blocks: list[int] = CHAIN, tokens: int = 1000) -> ScheduleRequest:
    return ScheduleRequest(request_id, tokens, blocks)


def test_longest_local_prefix_wins_when_queues_are_equal() -> None:
    index = PrefixIndex()
    index.stored(location("p0", "dram"), CHAIN[:2])
    index.stored(location("p1", "dram"), CHAIN[:6])
    decision = _conductor(index, reuse="local").schedule(_request(), now=0.0)
    assert decision.accepted and decision.prefill == "p1"
    assert (decision.local_blocks, decision.cached_tokens, decision.fetch_from) == (6, 600, None)
    assert decision.prefill_s == pytest.approx(0.4) and decision.ttft_s == pytest.approx(0.4)


def test_a_long_queue_outweighs_a_cache_hit() -> None:
    index = PrefixIndex()
    index.stored(location("p1", "dram"), CHAIN[:6])
    conductor = _conductor(index, reuse="local")
    first = conductor.schedule(_request(1, [101, 102], 200), now=0.0)  # p0 (tie on name): busy 0.2 s
    assert first.prefill == "p0"
    busy = conductor.schedule(_request(2, [201, 202, 203, 204, 205, 206, 207, 208], 800), now=0.0)
    assert busy.prefill == "p1" and busy.queue_s == 0.0  # p0 would wait 0.2 s first: 1.0 > 0.8
    # p1 now waits 0.8 s: its 60% hit (0.8 + 0.4) ties with recomputing on p0 (0.2 + 1.0); ties go to p0
    third = conductor.schedule(_request(3), now=0.0)
    assert third.prefill == "p0" and third.queue_s == pytest.approx(0.2) and third.ttft_s == pytest.approx(1.2)
    assert conductor.prefill_queue_s("p0", 0.0) == pytest.approx(1.2)


def test_a_longer_remote_prefix_is_fetched_and_replicated() -> None:
    index = PrefixIndex()
    index.stored(location("p0", "dram"), CHAIN[:2])
    index.stored(location("p1", "dram"), CHAIN[:9])
    conductor = _conductor(index)
    conductor.schedule(_request(7, [70], 100), now=0.0)  # p0 busy for 0.1 s; p1 idle
    conductor.schedule(_request(8, [80, 81, 82], 300), now=0.0)  # lands on p1 (idle): busy 0.3 s
    decision = conductor.schedule(_request(), now=0.0)
    # p0: wait 0.1 + fetch 700 tokens (0.7 ms) + compute 100 tokens (0.1 s) = 0.2007 s
    # p1: wait 0.3 + compute 100 tokens (0.1 s) = 0.4 s
    assert decision.prefill == "p0" and decision.fetch_from == location("p1", "dram")
    assert (decision.local_blocks, decision.fetch_blocks, decision.cached_tokens) == (2, 7, 900)
    assert decision.transfer_s == pytest.approx(0.0007) and decision.ttft_s == pytest.approx(0.2007)


def test_the_balancing_threshold_and_local_reuse_stop_fetching() -> None:
    index = PrefixIndex()
    index.stored(location("p0", "dram"), CHAIN[:4])
    index.stored(location("p1", "dram"), CHAIN[:6])
    for cfg, expected in (({}, "p0"), ({"balancing_threshold": 2.0}, "p1"), ({"reuse": "local"}, "p1")):
        conductor = _conductor(index, **cfg)
        assert conductor.schedule(_request(8, [], 5000), now=0.0).prefill == "p0"  # busy 5 s
        assert conductor.schedule(_request(9, [], 5100), now=0.0).prefill == "p1"  # busy 5.1 s
        decision = conductor.schedule(_request(), now=0.0)
        # p0 fetching 2 blocks: 5 + 0.0002 + 0.4; p0 alone: 5 + 0.6; p1: 5.1 + 0.4
        assert decision.prefill == expected
        if expected == "p0":
            assert decision.fetch_blocks == 2 and decision.ttft_s == pytest.approx(5.4002)
        else:
            assert decision.fetch_from is None and decision.cached_tokens == 600


def test_ttft_slo_rejects_unless_rejection_is_off() -> None:
    slow = _request(tokens=1000, blocks=[])
    assert _conductor(ttft_slo_s=0.5).schedule(slow, 0.0).reason == "ttft_slo"
    accepted = _conductor(ttft_slo_s=0.5, rejection="none").schedule(slow, 0.0)
    assert accepted.accepted and accepted.ttft_s == pytest.approx(1.0)


def test_decode_goes_to_the_least_loaded_instance_within_the_tbt_slo() -> None:
    conductor = _conductor(prefill=1, tbt_slo_s=0.1)
    first = conductor.schedule(_request(1, [], 1000), 0.0)
    assert conductor.admit_decode(1, 1.0) == first.decode == "d0"
    second = conductor.schedule(_request(2, [], 1000), 1.0)
    assert second.decode == "d1"  # d0 holds 1000 tokens of context already
    # 10 ms + (1000 + 128 (half the assumed 256-token output)) us
    assert second.tbt_s == pytest.approx(0.01 + 1128e-6)


def test_early_rejection_on_tbt_slo_and_kv_memory() -> None:
    conductor = _conductor(prefill=1, decode=1, tbt_slo_s=0.0125, rejection="early", ttft_slo_s=100)
    assert conductor.schedule(_request(1, [], 1000), 0.0).accepted
    assert conductor.admit_decode(1, 1.0) == "d0"
    # d0: 1000 + 128 + new 1000 + 128 + 128 tokens -> 12.384 ms <= 12.5 ms: accepted
    assert conductor.schedule(_request(2, [], 1000), 1.0).accepted
    assert conductor.admit_decode(2, 2.0) == "d0"
    rejected = conductor.schedule(_request(3, [], 1000), 2.0)
    assert (rejected.accepted, rejected.reason) == (False, "tbt_slo")
    small = _conductor(prefill=1, decode=1, capacity=1200, rejection="early", ttft_slo_s=100)
    assert small.schedule(_request(4, [], 1000), 0.0).reason == "kv_memory"  # 1000 + 256 > 1200


def test_prediction_counts_decode_requests_that_will_have_left() -> None:
    """d0 is full now, but its requests will be done when the new one reaches decode."""
    cfg = {"prefill": 1, "decode": 1, "tbt_slo_s": 0.013, "ttft_slo_s": 100, "decode_estimate_s": 2.0}
    early, predicted = _conductor(rejection="early", **cfg), _conductor(rejection="predicted", **cfg)  # type: ignore[arg-type]
    for conductor in (early, predicted):
        assert conductor.schedule(_request(1, [], 1000), 0.0).accepted
        assert conductor.admit_decode(1, 1.0) == "d0"  # in decode until about 1.0 + 2.0
    arriving = _request(2, [], 2500)  # prefill 2.5 s: reaches decode at 3.5 s, after request 1 left
    # now: 10 ms + (1128 + 2500 + 128 + 128) us = 13.9 ms; predicted alone: 10 ms + 2628 us = 12.6 ms
    assert early.schedule(arriving, 1.0).reason == "tbt_slo"
    assert predicted.schedule(arriving, 1.0).accepted


def test_baseline_rejects_at_decode_time_and_finished_requests_free_the_load() -> None:
    conductor = _conductor(prefill=1, decode=1, tbt_slo_s=0.0112, rejection="baseline", ttft_slo_s=100)
    assert conductor.schedule(_request(1, [], 1000), 0.0).accepted
    assert conductor.schedule(_request(2, [], 1000), 0.0).accepted  # baseline does not look at decode
    assert conductor.admit_decode(1, 1.0) == "d0"
    assert conductor.admit_decode(2, 2.0) is None  # wasted prefill
    assert conductor.counters["rejected_at_decode"] == 1
    conductor.decode_finished(1, 5.0, output_tokens=300)
    assert conductor.schedule(_request(3, [], 1000), 5.0).accepted
    assert conductor.admit_decode(3, 6.0) == "d0"


def test_bad_requests_and_configs_are_refused() -> None:
    with pytest.raises(InvalidArgument):
        _conductor().schedule(ScheduleRequest(1, 0, []), 0.0)
    with pytest.raises(InvalidArgument):
        Conductor(SIMULATOR_CONDUCTOR, COST, PrefixIndex(), [], ["d0"], 10)
    with pytest.raises(ConfigError, match="rejection"):
        dataclasses.replace(SIMULATOR_CONDUCTOR, rejection="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="reuse"):
        dataclasses.replace(SIMULATOR_CONDUCTOR, reuse="everywhere")  # type: ignore[arg-type]


def test_regression_queue_estimates_follow_each_finished_job_once() -> None:
    """Each finished job shifts the jobs behind it by its own error, not again by earlier ones."""
    conductor = _conductor(prefill=1, decode=1, rejection="none")
    for request_id in range(4):  # 10 s each: booked to end at 10, 20, 30, 40
        conductor.schedule(_request(request_id, [], 10_000), 0.0)
    conductor.admit_decode(0, 5.0)  # 5 s early: the rest end at 15, 25, 35
    assert conductor.prefill_queue_s("p0", 5.0) == pytest.approx(30.0)
    conductor.admit_decode(1, 15.0)  # on time, after the shift
    assert conductor.prefill_queue_s("p0", 15.0) == pytest.approx(20.0)
    conductor.admit_decode(2, 25.0)
    assert conductor.prefill_queue_s("p0", 25.0) == pytest.approx(10.0)
    conductor.admit_decode(3, 36.0)
    assert conductor.prefill_queue_s("p0", 36.0) == 0.0


def test_a_request_that_ends_at_prefill_leaves_no_decode_load() -> None:
    conductor = _conductor(prefill=1, decode=1, tbt_slo_s=0.0112, rejection="early", ttft_slo_s=100)
    assert conductor.schedule(_request(1, [], 1000), 0.0).accepted
    conductor.finished_at_prefill(1, 1.0)
    assert conductor.prefill_queue_s("p0", 1.0) == 0.0
    assert conductor.schedule(_request(2, [], 1000), 1.0).accepted and conductor.admit_decode(2, 2.0) == "d0"


def test_excluded_instances_are_never_picked() -> None:
    conductor = _conductor(prefill=2, decode=2, rejection="none")
    decision = conductor.schedule(_request(1, [], 1000), 0.0, exclude={"p0", "d0"})
    assert (decision.prefill, decision.decode) == ("p1", "d1")
    assert conductor.admit_decode(1, 1.0, exclude={"d1"}) == "d0"
    assert conductor.schedule(_request(2, [], 100), 1.0, exclude={"p0", "p1"}).reason == "no_instance"
    assert conductor.schedule(_request(3, [], 100), 1.0).accepted
    assert conductor.admit_decode(3, 2.0, exclude={"d0", "d1"}) is None


def test_uniform_prediction_drops_requests_older_than_the_mean_stage() -> None:
    """The paper's rule counts a request as gone once the mean stage has passed, even when it
    is still there; the survival model keeps a request that outlived every observation."""
    cfg = {"prefill": 1, "decode": 1, "tbt_slo_s": 0.013, "ttft_slo_s": 100, "decode_estimate_s": 2.0}
    predicted, uniform = _conductor(rejection="predicted", **cfg), _conductor(rejection="predicted_uniform", **cfg)  # type: ignore[arg-type]
    for conductor in (predicted, uniform):
        assert conductor.schedule(_request(1, [], 1000), 0.0).accepted
        assert conductor.admit_decode(1, 1.0) == "d0"
    # at 10 s request 1 is 9 s into decode; request 2 reaches decode at 12.5 s
    # with request 1: 10 ms + (1128 + 2500 + 256) us = 13.9 ms; without: 12.6 ms
    assert predicted.schedule(_request(2, [], 2500), 10.0).reason == "tbt_slo"
    assert uniform.schedule(_request(2, [], 2500), 10.0).accepted


def test_uniform_prediction_tests_the_average_over_decode_instances() -> None:
    conductors = []
    for mode in ("predicted", "predicted_uniform"):
        conductor = _conductor(
            prefill=1, decode=2, rejection="none", tbt_slo_s=0.013, ttft_slo_s=100, decode_estimate_s=20.0
        )
        for request_id in (1, 2, 3):  # three 5000-token requests on d0 (d1 excluded), over the SLO
            assert conductor.schedule(_request(request_id, [], 5000), 0.0, exclude={"d1"}).accepted
        for request_id in (1, 2, 3):
            assert conductor.admit_decode(request_id, 15.0, exclude={"d1"}) == "d0"
        conductor.config = dataclasses.replace(conductor.config, rejection=mode)  # type: ignore[arg-type]
        conductors.append(conductor)
    predicted, uniform = conductors
    # at 16 s: d0 10 ms + (15000 + 3 x 128) us = 25.4 ms; d1 with the new one 10 ms + 1128 us = 11.1 ms
    decision = predicted.schedule(_request(4, [], 1000), 15.0)
    assert decision.accepted and decision.decode == "d1"
    assert uniform.schedule(_request(4, [], 1000), 15.0).reason == "tbt_slo"  # (25.4 + 11.1) / 2 > 13


def test_without_recheck_an_admitted_request_always_reaches_decode() -> None:
    for recheck, expected in ((True, None), (False, "d0")):
        conductor = _conductor(
            prefill=1, decode=1, tbt_slo_s=0.0112, rejection="early", ttft_slo_s=100, recheck_decode=recheck
        )
        assert conductor.schedule(_request(1, [], 1000), 0.0).accepted
        assert conductor.schedule(_request(2, [], 1000), 0.0).accepted  # d0 is still empty now
        assert conductor.admit_decode(1, 1.0) == "d0"
        assert conductor.admit_decode(2, 2.0) == expected  # 10 ms + 2384 us > 11.2 ms


def test_an_own_ssd_prefix_is_loaded_at_the_ssd_bandwidth() -> None:
    index = PrefixIndex()
    index.stored(location("p0", "dram"), CHAIN[:2])
    index.stored(location("p0", "ssd"), CHAIN[:8])
    decision = _conductor(index, prefill=1, reuse="local", ssd_read_bytes_s=1e5).schedule(_request(), 0.0)
    # 600 tokens from SSD at 1e5 B/s (6 ms) + 200 computed (0.2 s) beats computing 800 (0.8 s)
    assert decision.fetch_from == location("p0", "ssd") and decision.fetch_blocks == 6
    assert decision.transfer_s == pytest.approx(0.006) and decision.ttft_s == pytest.approx(0.206)
