"""`tsukimi bench cpp`: time to first token of one long prompt, on one worker and on a chunked
pipeline parallel (CPP) prefill group of k stage processes (tsukimi/serving/prefill_group/stage.py).

Each shape runs in fresh processes with one torch thread each (on a 2-CPU machine, two stage
processes truly run in parallel): a plain colocated worker (prefill chunked at
`chunk_tokens`, prefix caching off), then CPP groups of k = 1, 2, ... stages on the same
chunks. Warm up with one prompt, then time `repeats` distinct prompts (client-side wall time
of POST /generate with max_tokens = 1); the median is reported, with each shape's ratio to
k = 1. No KV pool: TTFT here is compute plus the hidden-state hops between stages.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass

import httpx

from tsukimi.bench.scheduler import _git_rev
from tsukimi.clock import WallClock
from tsukimi.config.pipeline import PrefillStageConfig
from tsukimi.netio import free_port
from tsukimi.serving.prefill_group.commands import stage_args
from tsukimi.testing.processes import stop_processes, wait_until


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


def _start(cfg: CppBenchConfig, stages: int) -> tuple[str, list[subprocess.Popen[bytes]]]:
    """Processes of one shape (stages 0: a colocated worker); the URL that answers prefills."""
    cli = [sys.executable, "-m", "tsukimi.cli"]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    ports = [free_port() for _ in range(max(1, stages))]
    if stages == 0:
        args = [
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
        ]
        return f"http://127.0.0.1:{ports[0]}", [subprocess.Popen([*cli, *args], **quiet)]  # type: ignore[call-overload]
    procs = []
    for stage in reversed(range(stages)):  # NOTE: the last stage first: each connects downstream
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
        procs.append(subprocess.Popen([*cli, *stage_args(stage_cfg)], **quiet))  # type: ignore[call-overload]
    return f"http://127.0.0.1:{ports[0]}", procs


def measure(cfg: CppBenchConfig, stages: int) -> list[float]:
    """TTFTs (seconds) of `repeats` prompts on a fresh shape of `stages` (0: one worker)."""
    url, procs = _start(cfg, stages)
    try:
        wait_until(lambda: httpx.get(url + "/health", timeout=1).status_code == 200, 120)
        _ttft_s(url, _prompt(-1, cfg.prompt_tokens))  # warm-up
        return [_ttft_s(url, _prompt(n, cfg.prompt_tokens)) for n in range(cfg.repeats)]
    finally:
        stop_processes(procs)


def run(cfg: CppBenchConfig) -> dict[str, object]:
    """Every shape, one after the other; the figures as one JSON-able object."""
    rows: dict[str, list[float]] = {"worker": measure(cfg, 0)}
    for k in cfg.stages:
        rows[f"cpp_k{k}"] = measure(cfg, k)
    medians = {name: statistics.median(times) for name, times in rows.items()}
    base = medians.get("cpp_k1", medians["worker"])
    return {
        "config": asdict(cfg),
        "git_rev": _git_rev(),
        "ttft_s": rows,
        "median_s": medians,
        "ratio_to_k1": {name: m / base for name, m in medians.items()},
    }


def dumps(result: dict[str, object]) -> str:
    return json.dumps(result, sort_keys=True)


def markdown(result: dict[str, object]) -> str:
    cfg, medians, ratios = result["config"], result["median_s"], result["ratio_to_k1"]
    assert isinstance(cfg, dict) and isinstance(medians, dict) and isinstance(ratios, dict)
    lines = [
        f"TTFT of a {cfg['prompt_tokens']}-token prompt, chunks of {cfg['chunk_tokens']} tokens, "
        f"median of {cfg['repeats']}, git {result['git_rev']}.",
        "",
        "| shape | TTFT | vs CPP k = 1 |",
        "|---|---|---|",
    ]
    for name, median in medians.items():
        lines.append(f"| {name} | {median * 1000:.0f} ms | {ratios[name]:.2f}x |")
    return "\n".join(lines)
