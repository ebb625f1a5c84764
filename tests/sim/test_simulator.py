"""The discrete-event simulator on hand-built traces with a linear cost model (times by hand),
and its determinism on the shipped sample."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tsukimi.config import SIMULATOR_CONDUCTOR, SimConfig
from tsukimi.quantiles import quantile
from tsukimi.scheduler.cost_model import LinearCostModel
from tsukimi.sim.report import Slo, decode_load, summarize
from tsukimi.sim.simulator import simulate
from tsukimi.sim.trace import TraceRequest

# prefill 1 ms per token; decode step 10 ms + 1 us per context token; KV: 1 byte per token
COST = LinearCostModel(prefill_coef=(0.0, 1e-3, 0.0), decode_coef=(0.01, 0.0, 1e-6), kv_bytes_per_token=1)
CONDUCTOR = dataclasses.replace(
    SIMULATOR_CONDUCTOR, rejection="none", kv_bandwidth_bytes_s=1e6, prefill_chunk_tokens=100_000
)
SAMPLE = Path(__file__).parents[2] / "data" / "traces" / "conversation_sample.jsonl"


def _req(ms: int, tokens: int, out: int, blocks: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(ms, tokens, out, blocks)


def test_one_request_through_prefill_transfer_and_decode() -> None:
    result = simulate([_req(0, 1024, 3, (1, 2))], SimConfig(num_prefill=1, num_decode=1), CONDUCTOR, COST)
    (job,) = result.jobs
    assert job.first_token_s == pytest.approx(1.024)  # 1024 tokens at 1 ms
    assert job.decode_join_s == pytest.approx(1.024 + 1024e-6)  # KV at 1e6 B/s
    # two decode steps (the first token came from prefill): 10 ms + 1024 us, then 10 ms + 1025 us
    assert job.finish_s == pytest.approx(job.decode_join_s + 0.011024 + 0.011025)
    report = summarize(result, Slo(2.0, 0.1))
    assert report["completed"] == 1 and report["slo_attainment"] == 1.0
    assert report["tbt_s"]["p50"] == pytest.approx((job.finish_s - 1.024) / 2, abs=1e-6)  # type: ignore[index]


def test_a_shared_prefix_is_reused_on_the_instance_that_holds_it() -> None:
    trace = [_req(0, 1024, 1, (1, 2)), _req(5000, 1536, 1, (1, 2, 3)), _req(5000, 1536, 1, (9, 8, 7))]
    result = simulate(trace, SimConfig(num_prefill=2, num_decode=1), CONDUCTOR, COST)
    first, second, third = result.jobs
    assert second.instances[0] == first.instances[0] and second.cached_tokens == 1024
    assert second.first_token_s - second.arrival_s == pytest.approx(0.512)
    assert third.instances[0] != first.instances[0] and third.cached_tokens == 0  # the other one was idle
    assert summarize(result, Slo(10, 1))["token_hit_ratio"] == pytest.approx(1024 / 4096)


def test_global_reuse_fetches_a_prefix_held_by_a_busy_instance() -> None:
    trace = [
        _req(0, 2048, 1, (1, 2, 3, 4)),
        _req(2100, 4096, 1, (5, 6, 7, 8, 9, 10, 11, 12)),
        _req(2100, 2560, 1, (1, 2, 3, 4, 13)),
    ]
    for reuse, cached, fetched in (("global", 2048, 2048), ("local", 0, 0)):
        config = dataclasses.replace(
            SIMULATOR_CONDUCTOR, rejection="none", kv_bandwidth_bytes_s=1e6, prefill_chunk_tokens=100_000, reuse=reuse
        )
        third = simulate(trace, SimConfig(num_prefill=2, num_decode=1), config, COST).jobs[2]
        # the second request holds prefill-0 (which cached blocks 1-4): the third goes to prefill-1
        assert third.instances[0] == "prefill-1"
        assert (third.cached_tokens, third.fetch_tokens) == (cached, fetched)


def test_bounded_caches_evict_and_the_index_follows() -> None:
    trace = [_req(i * 1000, 1024, 1, (10 * i + 1, 10 * i + 2)) for i in range(5)] + [_req(9000, 1024, 1, (1, 2))]
    result = simulate(trace, SimConfig(num_prefill=1, num_decode=1, cache_blocks=4), CONDUCTOR, COST)
    assert result.jobs[-1].cached_tokens == 0  # blocks 1 and 2 were evicted long ago


def test_colocated_chunked_prefill_interleaves_with_decode() -> None:
    trace = [_req(0, 1000, 4, (1, 2)), _req(1, 600, 2, (3, 4))]
    sim = SimConfig(shape="colocated", num_colocated=1, colocated_chunk_tokens=400)
    first, second = simulate(trace, sim, CONDUCTOR, COST).jobs
    assert first.first_token_s == pytest.approx(1.0)  # chunks of 400, 400, 200 tokens
    # second: its first chunk (400) runs with first's first decode step, then 200 with the next
    # (a mixed step pays the larger fixed cost once: prefill has none here, decode 10 ms)
    assert second.first_token_s == pytest.approx(1.0 + (0.4 + 0.01 + 1000e-6) + (0.2 + 0.01 + 1001e-6))
    assert first.finish_s > second.first_token_s


def test_percentiles_and_decode_load() -> None:
    assert quantile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0 and quantile([1.0], 0.99) == 1.0
    result = simulate(
        [_req(0, 100, 50, (1,))], SimConfig(num_prefill=1, num_decode=1, sample_every_s=0.1), CONDUCTOR, COST
    )
    load = decode_load(result, 0.1)
    assert max(n for _, n in load) == 1 and load[-1][1] in (0, 1)


def test_same_trace_and_config_give_byte_identical_reports() -> None:
    command = [sys.executable, "-m", "tsukimi.cli", "sim", "run", "--trace", str(SAMPLE), "--speed", "4", "--json"]
    runs = [subprocess.run(command, capture_output=True, timeout=120, check=True).stdout for _ in range(2)]
    assert runs[0] == runs[1]
    report = json.loads(runs[0])["report"]
    assert report["requests"] == 1000 and report["completed"] + report["rejected"] == 1000


def test_cli_run_prints_a_table_and_plots_decode_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tsukimi.cli import main

    plot = tmp_path / "load.png"
    args = ["sim", "run", "--trace", str(SAMPLE), "--shape", "colocated", "--speed", "8", "--plot", str(plot)]
    assert main(args) == 0
    assert "colocated" in capsys.readouterr().out and plot.stat().st_size > 1000
    assert main(["sim", "run", "--trace", str(SAMPLE), "--cache-blocks", "0"]) == 2  # a clear ConfigError


def test_regression_idle_decode_instances_sample_zero() -> None:
    trace = [_req(0, 100, 5, (1,)), _req(100_000, 100, 5, (2,))]
    result = simulate(trace, SimConfig(num_prefill=1, num_decode=1, sample_every_s=10.0), CONDUCTOR, COST)
    load = dict(decode_load(result, 10.0))
    assert all(load[t] == 0 for t in (10.0, 50.0, 90.0))


def test_one_token_outputs_end_at_prefill() -> None:
    result = simulate([_req(0, 1000, 1, (1, 2))], SimConfig(num_prefill=1, num_decode=1), CONDUCTOR, COST)
    (job,) = result.jobs
    assert job.finish_s == job.first_token_s == pytest.approx(1.0) and job.decode_join_s < 0


def test_a_prefix_evicted_from_dram_is_read_back_from_the_ssd_tier() -> None:
    trace = [_req(0, 1024, 1, (1, 2)), _req(5000, 1024, 1, (3, 4)), _req(10000, 1536, 1, (1, 2, 5))]
    config = dataclasses.replace(
        SIMULATOR_CONDUCTOR,
        rejection="none",
        kv_bandwidth_bytes_s=1e6,
        prefill_chunk_tokens=100_000,
        ssd_read_bytes_s=1e5,
    )
    sim = SimConfig(num_prefill=1, num_decode=1, cache_blocks=2, ssd_blocks=10)
    result = simulate(trace, sim, config, COST)
    third = result.jobs[2]  # blocks 1 and 2 left DRAM for the second request; the SSD kept them
    assert (third.cached_tokens, third.fetch_tokens, third.ssd_tokens) == (1024, 1024, 1024)
    assert third.first_token_s - third.arrival_s == pytest.approx(1024 / 1e5 + 0.512)  # SSD read + 512 computed
    assert summarize(result, Slo(10, 1))["ssd_token_ratio"] == pytest.approx(1024 / 3584)
    no_ssd = simulate(trace, SimConfig(num_prefill=1, num_decode=1, cache_blocks=2), config, COST).jobs[2]
    assert (no_ssd.cached_tokens, no_ssd.ssd_tokens) == (0, 0)


def test_the_report_has_vram_occupation() -> None:
    result = simulate([_req(0, 1024, 3, (1, 2))], SimConfig(num_prefill=1, num_decode=1), CONDUCTOR, COST)
    job = result.jobs[0]
    vram = summarize(result, Slo(2.0, 0.1))["vram_gb_s"]
    # prefill: 1024 tokens for 1.024 s; decode: 1024 + 3 reserved (p90 prior: the 2048 cap) tokens
    prefill = 1024 * 1.024 / 1e9
    decode = (1024 + 2048) * (job.finish_s - job.decode_join_s) / 1e9
    assert vram == {
        "prefill": pytest.approx(prefill, abs=1e-6),
        "decode": pytest.approx(decode, abs=1e-6),
        "per_request": pytest.approx(prefill + decode, abs=1e-6),
    }
