"""The CPP cost model: the pipeline recurrence against the fill formula, one stage against
the chunked prefill, and the Conductor sending long prompts (only) to a prefill group."""

from __future__ import annotations

import dataclasses

import pytest

from tsukimi.config import SIMULATOR_CONDUCTOR
from tsukimi.scheduler.conductor import Conductor, ScheduleRequest
from tsukimi.scheduler.cost_model import LinearCostModel, RooflineCostModel, chunked_prefill_s
from tsukimi.scheduler.cpp import (
    CppGroup,
    cpp_prefill_s,
    hop_s_per_token,
    min_group_tokens,
    pipeline_fill_s,
    worth_a_group,
)
from tsukimi.scheduler.prefix_index import PrefixIndex

FLAT = LinearCostModel((0.0, 1e-3, 0.0), (0.01, 0.0, 0.0), 1)  # 1 ms per token, no attention term


@pytest.mark.parametrize(("stages", "hop_s"), [(1, 0.0), (2, 0.0), (2, 0.05), (4, 0.01)])
def test_equal_chunks_follow_the_fill_formula(stages: int, hop_s: float) -> None:
    group = CppGroup(stages, hop_latency_s=hop_s)
    # 8 chunks of 512 tokens, each 0.512 s on the whole model
    expected = pipeline_fill_s(8, 0.512, stages, hop_s)
    assert cpp_prefill_s(FLAT, 4096, 0, 512, group) == pytest.approx(expected)
    assert expected == pytest.approx((8 + stages - 1) * 0.512 / stages + (stages - 1) * hop_s)


def test_one_stage_is_the_chunked_prefill() -> None:
    cost = RooflineCostModel()
    for tokens, cached in ((100, 0), (20000, 3000), (70000, 0)):
        assert cpp_prefill_s(cost, tokens, cached, 8192, CppGroup(1)) == pytest.approx(
            chunked_prefill_s(cost, tokens, cached, 8192)
        )


def test_attention_makes_later_chunks_dearer_and_the_recurrence_follows() -> None:
    cost = LinearCostModel((0.0, 0.0, 1e-6), (0.01, 0.0, 0.0), 1)  # attention only
    chunks = [cost.prefill_s(512, 512 * j) for j in range(4)]
    # 2 stages: stage 0's next chunk always costs more than stage 1's current one, so stage 1
    # waits for stage 0 each time and the pipeline's tail is the last (dearest) chunk's half
    assert cpp_prefill_s(cost, 2048, 0, 512, CppGroup(2)) == pytest.approx(sum(chunks) / 2 + chunks[-1] / 2)


def test_hop_time_per_token() -> None:
    assert hop_s_per_token(8192, 2, 100e9) == pytest.approx(16384 / 100e9)


def test_a_group_pays_off_above_a_length_only() -> None:
    cost = RooflineCostModel()
    group = CppGroup(4, hop_s_per_token=hop_s_per_token(8192, 2, 25e9), hop_latency_s=1e-3)
    threshold = min_group_tokens(cost, 8192, group)
    assert threshold is not None and 1000 < threshold < 100_000
    assert worth_a_group(cost, threshold, 0, 8192, group)
    assert not worth_a_group(cost, threshold - 1, 0, 8192, group)


def test_the_conductor_sends_long_prompts_to_the_group() -> None:
    cost = RooflineCostModel()
    groups = {"cpp": CppGroup(4, hop_latency_s=1e-3)}
    config = dataclasses.replace(SIMULATOR_CONDUCTOR, rejection="none")
    conductor = Conductor(config, cost, PrefixIndex(), ["p0", "cpp"], ["d0"], 1 << 20, groups=groups)
    short = conductor.schedule(ScheduleRequest(1, 600, []), 0.0)
    long = conductor.schedule(ScheduleRequest(2, 64_000, []), 0.0)
    assert (short.prefill, long.prefill) == ("p0", "cpp")
    assert long.prefill_s == pytest.approx(cpp_prefill_s(cost, 64_000, 0, 8192, groups["cpp"]))
    # the group is busy now: waiting for it (4 stages) still beats one instance
    after = conductor.schedule(ScheduleRequest(3, 64_000, []), 0.0)
    single_s = short.prefill_s + chunked_prefill_s(cost, 64_000, 0, 8192)
    assert after.prefill == "cpp" and after.queue_s == pytest.approx(long.prefill_s) and after.ttft_s < single_s
