"""The CPP TTFT curve of the simulator: deterministic, and long prompts gain from groups."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tsukimi.errors import ConfigError
from tsukimi.sim.cpp import CppSimConfig, markdown, ttft_curve
from tsukimi.sim.trace import TraceRequest, load_trace

TRACE = Path(__file__).resolve().parents[2] / "data" / "traces" / "conversation_sample.jsonl"


def test_same_trace_same_curve_byte_for_byte() -> None:
    trace = load_trace(TRACE, limit=300)
    cfg = CppSimConfig(stages=(1, 2))
    assert json.dumps(ttft_curve(trace, cfg)) == json.dumps(ttft_curve(trace, cfg))


def test_a_lone_long_prompt_is_faster_on_a_group_and_a_short_one_stays_single() -> None:
    long = [TraceRequest(0, 100_000, 1, ())]
    curve = ttft_curve(long, CppSimConfig(num_prefill=4, stages=(1, 2, 4)))
    means = [row["ttft_mean_s"] for row in curve["rows"]]  # type: ignore[attr-defined, index]
    assert means[0] > means[1] > means[2]
    short = [TraceRequest(0, 2000, 1, ())]
    rows = ttft_curve(short, CppSimConfig(num_prefill=4, stages=(1, 4)))["rows"]
    assert rows[0]["ttft_mean_s"] == rows[1]["ttft_mean_s"]  # type: ignore[index]
    assert "k = 4" in markdown(curve)


def test_group_sizes_must_divide_the_pool() -> None:
    with pytest.raises(ConfigError):
        CppSimConfig(num_prefill=6, stages=(4,))
