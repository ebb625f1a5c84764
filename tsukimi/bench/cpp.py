"""`tsukimi bench cpp`: time to first token of one long prompt, on one worker and on a chunked
pipeline parallel (CPP) prefill group of k stage processes (tsukimi/serving/prefill_group/stage.py).

Each shape runs in fresh processes with one torch thread each (on a 2-CPU machine, two stage
processes truly run in parallel), launched as `tsukimi up` launches its own
(tsukimi/serving/cluster/launcher.py): a plain colocated worker (prefill chunked at
`chunk_tokens`, prefix caching off), then CPP groups of k = 1, 2, ... stages on the same
chunks. Warm up with one prompt, then time `repeats` distinct prompts (client-side wall time
of POST /generate with max_tokens = 1; tsukimi/bench/measure.py); the median is reported, with
each shape's ratio to k = 1. No KV pool: TTFT here is compute plus the hidden-state hops
between stages.

Goal (issue 16), as the report's verdict: k = 2 at most 0.65x the TTFT of k = 1.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

from tsukimi.bench.measure import Spread, repeat
from tsukimi.bench.report import BenchReport, FigureViews, Verdict, begin, finish, goal
from tsukimi.clock import WallClock
from tsukimi.config.pipeline import PrefillStageConfig
from tsukimi.netio import free_port
from tsukimi.serving.cluster.cpp_plan import STAGE_ROLE
from tsukimi.serving.cluster.launcher import LaunchConfig, LaunchedCluster
from tsukimi.serving.cluster.process_spec import ProcessSpec
from tsukimi.serving.prefill_group.commands import stage_args


@dataclass(frozen=True, slots=True)
class CppBenchConfig:
    prompt_tokens: int = 4095
    chunk_tokens: int = 512
    stages: tuple[int, ...] = (1, 2)
    repeats: int = 3
    model: str = "tiny"


def _prompt(n: int, tokens: int) -> list[int]:
    return [1, *((7919 * (i + 1) + 104729 * n) % 31000 + 3 for i in range(tokens - 1))]


def _ttft_s(url: str, prompt: list[int]) -> float:
    clock = WallClock()
    start = clock.now()
    body = {"request_id": f"bench-{start}", "prompt_ids": prompt, "max_tokens": 1, "ignore_eos": True}
    response = httpx.post(url + "/generate", json=body, timeout=600)
    response.raise_for_status()
    return clock.now() - start


def shape_processes(cfg: CppBenchConfig, stages: int) -> list[ProcessSpec]:
    """The processes of one shape (stages 0: a colocated worker), the one that answers
    prefills first (pure but for the free ports it picks)."""
    ports = [free_port() for _ in range(max(1, stages))]
    if stages == 0:
        args = (
            "worker",
            "--model",
            cfg.model,
            "--port",
            str(ports[0]),
            "--threads",
            "1",
            "--num-blocks",
            "512",
            "--max-batched-tokens",
            str(cfg.chunk_tokens),
            "--no-prefix-caching",
        )
        return [ProcessSpec("worker", "colocated", args, f"http://127.0.0.1:{ports[0]}")]
    specs = []
    for stage in range(stages):
        downstream = f"127.0.0.1:{ports[stage + 1]}" if stage + 1 < stages else ""
        stage_cfg = PrefillStageConfig(
            name=f"cpp-{stage}",
            stage=stage,
            num_stages=stages,
            model=cfg.model,
            port=ports[stage],
            downstream=downstream,
            chunk_tokens=cfg.chunk_tokens,
        )
        # NOTE: the head answers /health once the whole group is linked; later stages have no HTTP
        if stage == 0:
            specs.append(ProcessSpec(stage_cfg.name, "prefill", stage_args(stage_cfg), f"http://127.0.0.1:{ports[0]}"))
        else:
            address = f"127.0.0.1:{ports[stage]}"
            specs.append(ProcessSpec(stage_cfg.name, STAGE_ROLE, stage_args(stage_cfg), address, health="none"))
    return specs


def measure(cfg: CppBenchConfig, stages: int) -> list[float]:
    """TTFTs (seconds) of `repeats` prompts on a fresh shape of `stages` (0: one worker),
    after one warm-up prompt."""
    specs = shape_processes(cfg, stages)
    url = specs[0].url
    with (
        tempfile.TemporaryDirectory(prefix="tsukimi-bench-cpp-") as logs,
        # NOTE: the later stages first: each links to its downstream as it starts
        LaunchedCluster([specs[::-1]], LaunchConfig(Path(logs), startup_timeout_s=120)),
    ):
        return repeat(lambda n: _ttft_s(url, _prompt(n, cfg.prompt_tokens)), warmup_runs=1, repeats=cfg.repeats)


def run(cfg: CppBenchConfig) -> dict[str, object]:
    """Every shape, one after the other; the figures."""
    rows: dict[str, list[float]] = {"worker": measure(cfg, 0)}
    for k in cfg.stages:
        rows[f"cpp_k{k}"] = measure(cfg, k)
    medians = {name: Spread.of(times).median for name, times in rows.items()}
    base = medians.get("cpp_k1", medians["worker"])
    return {
        "prompt_tokens": cfg.prompt_tokens,
        "chunk_tokens": cfg.chunk_tokens,
        "repeats": cfg.repeats,
        "ttft_s": rows,
        "median_s": medians,
        "ratio_to_k1": {name: m / base for name, m in medians.items()},
    }


def verdicts(figures: Mapping[str, object]) -> list[Verdict]:
    """The goal (see the module): n/a unless both k = 1 and k = 2 ran. Pure."""
    medians = figures["median_s"]
    assert isinstance(medians, dict)
    k1, k2 = medians.get("cpp_k1"), medians.get("cpp_k2")
    return [goal("cpp_k2_vs_k1", "TTFT of CPP k = 2 / k = 1", k2 / k1 if k1 and k2 else None, "<=", 0.65)]


def run_report(cfg: CppBenchConfig) -> BenchReport:
    """`tsukimi bench cpp`: run (see `run`) and report, with the goal as a verdict."""
    start = begin("bench cpp", cfg)
    figures = run(cfg)
    return finish(start, figures, verdicts(figures))


def markdown(figures: Mapping[str, object]) -> str:
    """The medians as the table docs/benchmarks.md holds (pure)."""
    medians, ratios = figures["median_s"], figures["ratio_to_k1"]
    assert isinstance(medians, dict) and isinstance(ratios, dict)
    lines = [
        f"TTFT of a {figures['prompt_tokens']}-token prompt, chunks of {figures['chunk_tokens']} tokens, "
        f"median of {figures['repeats']}.",
        "",
        "| shape | TTFT | vs CPP k = 1 |",
        "|---|---|---|",
    ]
    for name, median in medians.items():
        lines.append(f"| {name} | {median * 1000:.0f} ms | {ratios[name]:.2f}x |")
    return "\n".join(lines)


VIEWS = FigureViews(markdown)
