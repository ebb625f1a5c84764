"""The Conductor with contended links (`links=`): a fetch from a source with n transfers in
flight is estimated at 1/(n + 1) of the bandwidth, and among equally long prefixes the least
loaded source is chosen. Same hand-computable cost model as tests/scheduler/test_conductor.py:
1 ms per uncached token, KV at 1,000 tokens per ms."""

from __future__ import annotations

import dataclasses

import pytest

from tsukimi.config import SIMULATOR_CONDUCTOR
from tsukimi.scheduler.conductor import Conductor, ScheduleRequest
from tsukimi.scheduler.cost_model import LinearCostModel
from tsukimi.scheduler.prefix_index import PrefixIndex, location

COST = LinearCostModel(prefill_coef=(0.0, 1e-3, 0.0), decode_coef=(0.01, 0.0, 1e-6), kv_bytes_per_token=1)
CHAIN = list(range(1, 11))  # 10 blocks of 100 tokens


class _Busy:
    """A SourceLoad with fixed transfers in flight per source."""

    def __init__(self, **active: int) -> None:
        self.load = {location(name, "dram"): n for name, n in active.items()}

    def active(self, source: str) -> int:
        return self.load.get(source, 0)


def _conductor(index: PrefixIndex, links: _Busy | None) -> Conductor:
    config = dataclasses.replace(
        SIMULATOR_CONDUCTOR, block_tokens=100, kv_bandwidth_bytes_s=1e6, prefill_chunk_tokens=10_000
    )
    return Conductor(config, COST, index, ["p0", "p1", "p2"], ["d0"], 100_000, links=links)


def _index(*holders: str) -> PrefixIndex:
    index = PrefixIndex()
    for name in holders:
        index.stored(location(name, "dram"), CHAIN[:9])
    return index


def _busy_holder(conductor: Conductor, request_id: int) -> str | None:
    """A request extending the held prefix by 2,000 tokens: a holder computes it for 2 s."""
    extra = list(range(100 * request_id, 100 * request_id + 20))
    return conductor.schedule(ScheduleRequest(request_id, 2900, CHAIN[:9] + extra), now=0.0).prefill


@pytest.mark.parametrize(("in_flight", "transfer_s"), [(0, 0.0009), (1, 0.0018), (3, 0.0036)])
def test_a_busy_source_slows_the_estimated_fetch(in_flight: int, transfer_s: float) -> None:
    index = _index("p1")
    conductor = _conductor(index, _Busy(p1=in_flight))
    assert _busy_holder(conductor, 9) == "p1"
    decision = conductor.schedule(ScheduleRequest(1, 1000, CHAIN), now=0.0)
    assert decision.prefill == "p0" and decision.fetch_from == location("p1", "dram")
    assert decision.transfer_s == pytest.approx(transfer_s)


def test_without_links_every_fetch_gets_the_whole_bandwidth() -> None:
    conductor = _conductor(_index("p1"), None)
    assert _busy_holder(conductor, 9) == "p1"
    assert conductor.schedule(ScheduleRequest(1, 1000, CHAIN), now=0.0).transfer_s == pytest.approx(0.0009)


def test_the_least_loaded_of_equal_holders_is_fetched_from() -> None:
    # p1 and p2 hold the same prefix; p1's link is busier, so p0 fetches from p2 (by name it
    # would be p1).
    index = _index("p1", "p2")
    conductor = _conductor(index, _Busy(p1=2, p2=1))
    assert [_busy_holder(conductor, 8), _busy_holder(conductor, 9)] == ["p1", "p2"]
    decision = conductor.schedule(ScheduleRequest(1, 1000, CHAIN), now=0.0)
    assert decision.prefill == "p0" and decision.fetch_from == location("p2", "dram")
    assert decision.transfer_s == pytest.approx(0.0018)
