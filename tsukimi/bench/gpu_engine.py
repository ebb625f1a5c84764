"""tsukimi's engine rows of `tsukimi bench gpu`: prefill and prefix reuse in one process, then
TTFT through real processes (`tsukimi up`: colocated, and PD with the KV through the pool).

    in process  tsukimi/engine/prefill_timing.py on the bench's model shape (random weights):
                `tsukimi.engine_prefill_s.16k` (the whole prompt), `tsukimi.engine_reuse_s.16k`
                (the prefix's KV from pinned host rows + the rest computed), and the same for the
                SmolLM2 shape on a GPU (`tsukimi.smollm2_prefill_s.16k`, ...)
    processes   one cluster per mode, one GPU host: a fresh prompt's TTFT on a colocated worker
                and on a PD pair (prefill worker -> pool -> decode worker), and in PD a second
                prompt sharing all but `new_tokens` of the first: the prefill worker finds that
                prefix in its own cache (HBM), so this is a local prefix hit, not a pool load
                (the pool's path is the in-process reuse row):
                `tsukimi.colocated_ttft_s.16k`, `tsukimi.pd_ttft_s.16k`,
                `tsukimi.pd_ttft_vs_colocated.16k`, `tsukimi.pd_local_prefix_ttft_s.16k`

Each TTFT is the median of `repeats` requests after a warm-up request of the same length. Without
CUDA the same code runs on the CPU with the tiny model (CI keeps it working); no figure of it
is a GPU's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import random
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from tsukimi.bench.client import CompletionRequest, complete
from tsukimi.bench.up_cluster import launch_up, serving_settings
from tsukimi.engine.model import ModelConfig
from tsukimi.engine.prefill_timing import time_prefill
from tsukimi.engine.presets import PRESETS
from tsukimi.engine.weights import TINY_CONFIG

Figure = float | str
MODEL_SPECS = {"llama3-8b": "random:llama3-8b", "smollm2-135m": "random:smollm2-135m", "tiny": "tiny"}
_TIMEOUT_S = 600.0


def engine_rows(
    shape: str, device: str, prompts: Sequence[int], new_tokens: int, label: Callable[[int], str]
) -> dict[str, Figure]:
    """Prefill and reuse in one process for each prompt length (see the module); on a GPU the
    SmolLM2 shape too, at the longest prompt."""
    figures: dict[str, Figure] = {}
    runs = [(shape, "engine", n) for n in prompts]
    if device == "cuda" and shape != "smollm2-135m":
        runs.append(("smollm2-135m", "smollm2", prompts[-1]))
    for which, name, n in runs:
        timing = time_prefill(MODEL_SPECS[which], n, device, "auto", prefix_tokens=n - new_tokens)
        figures[f"tsukimi.{name}_prefill_s.{label(n)}"] = round(timing.prefill_s, 4)
        if timing.reuse_s is not None:
            figures[f"tsukimi.{name}_reuse_s.{label(n)}"] = round(timing.reuse_s, 4)
            figures[f"tsukimi.{name}_reuse_vs_prefill.{label(n)}"] = round(timing.reuse_s / timing.prefill_s, 4)
        _release(device)
    return figures


def process_rows(
    shape: str, device: str, prompt_tokens: int, new_tokens: int, repeats: int, label: str, say: Callable[[str], None]
) -> dict[str, Figure]:
    """TTFT through real processes, colocated then PD (see the module)."""
    spec = MODEL_SPECS[shape]
    rng = random.Random(prompt_tokens)
    blocks = 2 * (prompt_tokens + new_tokens) // 16 * (repeats + 2) + 64
    kv_bytes = shape_config(shape, device).kv_bytes_per_token  # NOTE: sizes the pool's share
    extra = [
        f'workers.device="{device}"',
        f"workers.max_batched_tokens={prompt_tokens}",
        f"workers.segment_bytes={max(512 << 20, 2 * prompt_tokens * kv_bytes)}",
    ]
    figures: dict[str, Figure] = {}
    for mode in ("colocated", "pd"):
        say(f"{mode}: {spec} on {device}, prompts of {prompt_tokens} tokens")
        settings = serving_settings(spec, mode, num_blocks=blocks, extra=extra)
        with (
            tempfile.TemporaryDirectory(prefix=f"tsukimi-bench-gpu-{mode}-") as workdir,
            launch_up(settings, Path(workdir)) as cluster,
        ):
            fresh = [_prompt(rng, shape, prompt_tokens) for _ in range(repeats + 1)]
            times = asyncio.run(_ttfts(cluster.api, spec, fresh))
            figures[f"tsukimi.{mode}_ttft_s.{label}"] = round(statistics.median(times[1:]), 4)
            if mode == "pd":
                shared = [p[: prompt_tokens - new_tokens] + _prompt(rng, shape, new_tokens) for p in fresh[1:]]
                again = asyncio.run(_ttfts(cluster.api, spec, shared))
                figures[f"tsukimi.pd_local_prefix_ttft_s.{label}"] = round(statistics.median(again), 4)
        _release(device)
    colocated, pd = figures[f"tsukimi.colocated_ttft_s.{label}"], figures[f"tsukimi.pd_ttft_s.{label}"]
    assert isinstance(colocated, float) and isinstance(pd, float)
    figures[f"tsukimi.pd_ttft_vs_colocated.{label}"] = round(pd / colocated, 4) if colocated else "n/a"
    return figures


def shape_config(shape: str, device: str) -> ModelConfig:
    """The model config of the bench's `shape` in the dtype `--dtype auto` picks on `device`
    (bfloat16 on cuda, float32 on cpu), without building weights (pure)."""
    base = TINY_CONFIG if shape == "tiny" else PRESETS[shape]
    return dataclasses.replace(base, dtype="bfloat16" if device.startswith("cuda") else "float32")


def _prompt(rng: random.Random, shape: str, n: int) -> list[int]:
    return [rng.randrange(3, shape_config(shape, "cpu").vocab_size) for _ in range(n)]


async def _ttfts(url: str, model: str, prompts: Sequence[Sequence[int]]) -> list[float]:
    """Each prompt's TTFT, one request at a time (two tokens each, greedy, EOS ignored).

    Raises:
        RuntimeError: a request was not served (the bench reports nothing false).
    """
    out = []
    for prompt in prompts:
        result = await complete(url, model, CompletionRequest(tuple(prompt), 2, ignore_eos=True), _TIMEOUT_S)
        if result.kind != "served":
            raise RuntimeError(f"a {len(prompt)}-token request was {result.kind}: {result.reason} {result.message}")
        out.append(result.ttft_s)
    return out


def _release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
