"""`tsukimi bench vllm` without vLLM: the workload is the same for every system, rows and
ratios are computed as documented, and a system that cannot start reports why."""

from __future__ import annotations

from pathlib import Path

import pytest

from tsukimi.bench.client import CompletionResult
from tsukimi.bench.vllm import VllmBenchConfig, conversations, markdown, ratios, run_bench, summarize
from tsukimi.errors import ConfigError


def _turn(  # the old row type's fields, made the bench client's result
    ttft_s: float = float("nan"),
    tbt_s: float = float("nan"),
    prompt_tokens: int = 0,
    cached_tokens: int = 0,
    tokens: list[int] | None = None,
    error: str = "",
) -> CompletionResult:
    times = (ttft_s,) if tbt_s != tbt_s else (ttft_s, ttft_s + tbt_s)
    if error:
        return CompletionResult("error", 500, error, True, 1.0)
    ids = tuple(tokens or ())
    return CompletionResult(
        "served",
        200,
        "",
        True,
        1.0,
        token_times_s=times,
        token_ids=ids,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        completion_tokens=len(ids),
    )


def test_conversations_are_deterministic_and_share_the_prefix() -> None:
    cfg = VllmBenchConfig(conversations=3, turns=2, prefix_tokens=40, user_tokens=5, max_tokens=3)
    a, b = conversations(cfg), conversations(cfg)
    assert a == b
    assert len({tuple(prefix) for prefix, _, _ in a}) == 1 and len(a[0][0]) == 40
    assert a[0][1] != a[1][1] and [len(u) for u in a[2][1]] == [5, 5] and [len(r) for r in a[2][2]] == [3, 3]


def test_summarize_compares_tokens_with_the_reference() -> None:
    ref = {(0, 0): _turn(1.0, 0.01, 100, 50, [1, 2]), (0, 1): _turn(3.0, 0.03, 100, 0, [3])}
    same = {(0, 0): _turn(0.5, 0.02, 100, 100, [1, 2]), (0, 1): _turn(0.7, float("nan"), 100, 100, [3])}
    row = summarize("tsukimi", same, ref)
    assert row == {
        "system": "tsukimi",
        "requests": 2,
        "errors": 0,
        "ttft_p50_s": 0.5,  # NOTE: nearest rank: of two values, p50 is the lower
        "ttft_p90_s": 0.7,
        "tbt_p50_ms": 20.0,
        "cached_ratio": 1.0,
        "tokens_equal": True,
    }
    differ = {**same, (0, 1): _turn(0.7, 0.0, 100, 0, [4])}
    assert summarize("x", differ, ref)["tokens_equal"] is False
    failed = {**same, (0, 1): _turn(error="HTTP 500")}
    assert summarize("x", failed, ref)["tokens_equal"] is False
    assert summarize("x", failed, ref)["error"] == "error: 500 HTTP 500"
    assert summarize("vllm_rr", ref, None)["tokens_equal"] is True


def test_ratios_and_markdown() -> None:
    runs: list[dict[str, object]] = [
        {"system": "vllm_rr", "ttft_p50_s": 0.4},
        {"system": "tsukimi", "ttft_p50_s": 0.1},
        {"system": "mooncake_store", "error": "no wheel"},
    ]
    assert ratios(runs) == {"tsukimi_over_vllm_rr": 0.25}
    table = markdown({"runs": runs, "ratios": ratios(runs)})
    assert "| mooncake_store | - | - | - | - | - | no wheel |" in table


def test_a_system_that_cannot_start_reports_why(tmp_path: Path) -> None:
    cfg = VllmBenchConfig(systems=("vllm_rr", "mooncake_store"), venv=str(tmp_path / "none"))
    result = run_bench(cfg, lambda _: None)  # the figures
    runs = result["runs"]
    assert isinstance(runs, list) and [r["system"] for r in runs] == ["vllm_rr", "mooncake_store"]
    assert "make vllm" in str(runs[0]["error"]) and "mooncake-transfer-engine-non-cuda" in str(runs[1]["error"])
    assert not any("ttft_p50_s" in r for r in runs)
    with pytest.raises(ConfigError, match="unknown systems"):
        VllmBenchConfig(systems=("sglang",))
