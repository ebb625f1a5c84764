"""`tsukimi bench serve`: drive the OpenAI API with a workload and measure what users see.

Workloads (token-id prompts through `/v1/completions`, streamed):
- chat: `conversations` multi-turn chats that all start with the same `prefix_tokens` system
  prompt; turn k sends the whole history (prefix, then each earlier user message and a reply
  of `max_tokens` tokens) plus a new user message, as soon as turn k-1 has finished; the first
  turns start at `rate` per second.
- skewed: one long system prompt shared by most requests, Poisson arrivals (tsukimi/bench/skewed.py);
  with compare_hot, run with the store master's hot-key replication off, then on.
- trace: a Mooncake trace; each `hash_id` becomes the same `block_tokens` token ids wherever it
  appears (so shared prefixes are real shared prefixes), lengths scaled from 512-token blocks to
  `block_tokens`, sent at the trace's timestamps sped up by `speed`.

Per request: TTFT (first streamed token), TBT (mean gap between later tokens), prompt tokens
served from cache (`usage.prompt_tokens_details.cached_tokens`), HTTP 429 rejections, and in PD
mode whether the router's prefix index expected exactly that reuse when it placed the request
(`expected_cached_tokens`): `index_exact_ratio`, and the misses by direction ("over": the index
held blocks the worker no longer had; "under": the worker had blocks the index had not heard of)
and by cause: "concurrent" when other prefills ran on that worker at placement (they stored or
evicted blocks before this one was admitted: the index could not know yet), "behind" when none
did, so the worker's cache stood still and the index had missed or not yet applied an event.
`index_up_to_date_ratio` counts only the "behind" misses.
"""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx
import numpy as np

from tsukimi.bench.skewed import SkewedWorkload, skewed_requests
from tsukimi.errors import PeerError
from tsukimi.netio import free_port
from tsukimi.sim.trace import TraceRequest

_TIMEOUT = httpx.Timeout(120.0, connect=5.0)


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    conversations: int = 8
    turns: int = 4
    prefix_tokens: int = 2000
    user_tokens: int = 64
    max_tokens: int = 16
    rate: float = 2.0  # first turns per second
    seed: int = 0


@dataclass(slots=True)
class Sample:
    ttft_s: float = float("nan")
    tbt_s: float = float("nan")
    prompt_tokens: int = 0
    cached_tokens: int = 0
    pool_tokens: int = 0
    completion_tokens: int = 0
    expected_cached_tokens: int | None = None  # the router's prefix index at placement (PD)
    expected_concurrent: bool = False  # other prefills ran on that worker at placement
    rejected: bool = False
    error: str = ""


@dataclass(slots=True)
class ServeReport:
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, object]:
        ok = [s for s in self.samples if not s.rejected and not s.error]
        prompt = sum(s.prompt_tokens for s in ok)
        return {
            "requests": len(self.samples),
            "completed": len(ok),
            "rejected": sum(s.rejected for s in self.samples),
            "errors": sum(bool(s.error) for s in self.samples),
            "ttft_s": _quantiles([s.ttft_s for s in ok]),
            "tbt_s": _quantiles([s.tbt_s for s in ok if s.tbt_s == s.tbt_s]),
            "throughput_rps": round(len(ok) / self.wall_s, 4) if self.wall_s else 0.0,
            "output_tokens_per_s": round(sum(s.completion_tokens for s in ok) / self.wall_s, 2) if self.wall_s else 0.0,
            "prompt_tokens": prompt,
            "cached_prompt_tokens": sum(s.cached_tokens for s in ok),
            "cached_ratio": round(sum(s.cached_tokens for s in ok) / prompt, 4) if prompt else 0.0,
            "pool_prompt_tokens": sum(s.pool_tokens for s in ok),
            **_index_accuracy(ok),
        }


async def complete(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int) -> Sample:
    """One streamed completion; never raises for HTTP or network errors (they are recorded)."""
    sample = Sample(prompt_tokens=len(prompt))
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    stamps: list[float] = []
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=_TIMEOUT) as response:
            if response.status_code == 429:
                sample.rejected = True
                return sample
            if response.status_code != 200:
                sample.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return sample
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if any(choice.get("text") for choice in chunk.get("choices", [])):
                    stamps.append(time.perf_counter())
                usage = chunk.get("usage") or {}
                if usage:
                    sample.prompt_tokens = usage.get("prompt_tokens", sample.prompt_tokens)
                    sample.completion_tokens = usage.get("completion_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    sample.cached_tokens = details.get("cached_tokens", 0) or 0
                    sample.pool_tokens = details.get("pool_tokens", 0) or 0
                    sample.expected_cached_tokens = details.get("expected_cached_tokens")
                    sample.expected_concurrent = bool(details.get("expected_concurrent"))
    except httpx.HTTPError as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
        return sample
    if stamps:
        sample.ttft_s = stamps[0] - start
        if len(stamps) > 1:
            sample.tbt_s = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    sample.completion_tokens = sample.completion_tokens or len(stamps)
    return sample


async def run_chat(url: str, model: str, workload: ChatWorkload) -> ServeReport:
    """The chat workload against `url` (see the module)."""
    rng = np.random.default_rng(workload.seed)
    vocab = (3, 250)  # NOTE: ids every tokenizer here has; the content does not matter, only reuse
    prefix = rng.integers(*vocab, workload.prefix_tokens).tolist()
    report = ServeReport()
    start = time.perf_counter()

    async def conversation(index: int, client: httpx.AsyncClient) -> None:
        await asyncio.sleep(index / workload.rate)
        history = list(prefix)
        for _ in range(workload.turns):
            history += rng.integers(*vocab, workload.user_tokens).tolist()
            report.samples.append(await complete(client, url, model, list(history), workload.max_tokens))
            history += rng.integers(*vocab, workload.max_tokens).tolist()  # stands for the reply

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=256)) as client:
        await asyncio.gather(*(conversation(i, client) for i in range(workload.conversations)))
    report.wall_s = time.perf_counter() - start
    return report


async def run_skewed(url: str, model: str, workload: SkewedWorkload) -> ServeReport:
    """The skewed workload against `url`: open loop, each request at its arrival time."""
    report = ServeReport()
    start = time.perf_counter()

    async def one(at_s: float, prompt: list[int], client: httpx.AsyncClient) -> None:
        await asyncio.sleep(max(0.0, at_s - (time.perf_counter() - start)))
        report.samples.append(await complete(client, url, model, prompt, workload.max_tokens))

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=256)) as client:
        await asyncio.gather(*(one(r.at_s, r.prompt, client) for r in skewed_requests(workload)))
    report.wall_s = time.perf_counter() - start
    return report


def trace_prompts(trace: Sequence[TraceRequest], block_tokens: int, max_prompt: int) -> list[list[int]]:
    """Token prompts standing for the trace's requests: the same ids for the same hash id."""
    prompts = []
    for request in trace:
        tokens: list[int] = []
        for block in request.hash_ids:
            tokens += np.random.default_rng(block).integers(3, 250, block_tokens).tolist()
        scaled = max(1, round(request.input_length * block_tokens / 512))
        prompts.append(tokens[: min(scaled, max_prompt)] or [3])
    return prompts


async def run_trace(
    url: str,
    model: str,
    trace: Sequence[TraceRequest],
    block_tokens: int,
    speed: float,
    max_prompt: int,
    max_tokens: int,
) -> ServeReport:
    """The trace workload (see the module): open loop at the trace's pace times `speed`."""
    prompts = trace_prompts(trace, block_tokens, max_prompt)
    report = ServeReport()
    start = time.perf_counter()
    t0 = trace[0].timestamp_ms if trace else 0

    async def one(request: TraceRequest, prompt: list[int], client: httpx.AsyncClient) -> None:
        await asyncio.sleep((request.timestamp_ms - t0) / 1000 / speed)
        out = max(1, min(max_tokens, round(request.output_length * block_tokens / 512)))
        report.samples.append(await complete(client, url, model, prompt, out))

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=256)) as client:
        await asyncio.gather(*(one(r, p, client) for r, p in zip(trace, prompts, strict=True)))
    report.wall_s = time.perf_counter() - start
    return report


def _index_accuracy(samples: list[Sample]) -> dict[str, object]:
    """index_exact_ratio and index_up_to_date_ratio over the requests with an expectation (None
    without: colocated), and the misses by direction and cause (see the module)."""
    known = [(s.expected_cached_tokens, s) for s in samples if s.expected_cached_tokens is not None]
    misses = {f"{d}_{c}": 0 for d in ("over", "under") for c in ("concurrent", "behind")}
    for expected, s in known:
        if expected != s.cached_tokens:
            direction = "over" if expected > s.cached_tokens else "under"
            misses[f"{direction}_{'concurrent' if s.expected_concurrent else 'behind'}"] += 1
    if not known:
        return {"index_exact_ratio": None, "index_up_to_date_ratio": None, "index_mismatches": misses}
    behind = misses["over_behind"] + misses["under_behind"]
    return {
        "index_exact_ratio": round(1 - sum(misses.values()) / len(known), 4),
        "index_up_to_date_ratio": round(1 - behind / len(known), 4),
        "index_mismatches": misses,
    }


def _quantiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)

    return {"p50": round(statistics.median(values), 4), "p90": pick(0.9), "p99": pick(0.99)}


@dataclass(frozen=True, slots=True)
class ServeBenchConfig:
    """`url` of a running API, or "" to start `tsukimi up` (model, mode, `prefill` prefill
    workers) for each run; compare_reuse: run twice, with and without KV reuse, and report the
    TTFT ratio; compare_hot (instead): run with the master's hot_threshold 0 (off), then
    `hot_threshold`, and report the p90 TTFT ratio and the master's hot-key counters."""

    url: str = ""
    model: str = "tiny"
    mode: str = "pd"
    workload: str = "chat"
    chat: ChatWorkload = ChatWorkload()
    trace: str = ""
    speed: float = 1.0
    trace_limit: int = 200
    compare_reuse: bool = True
    num_blocks: int = 4096  # each worker's KV cache (fewer: evictions, which the index must follow)
    skewed: SkewedWorkload = field(default_factory=SkewedWorkload)
    prefill: int = 1
    compare_hot: bool = False
    hot_threshold: float = 0.0


class LocalCluster:
    """`tsukimi up` in a subprocess, for one benchmark run; `api` once it is up."""

    def __init__(
        self,
        model: str,
        mode: str,
        prefix_caching: bool,
        workdir: str,
        num_blocks: int = 4096,
        extra: Sequence[str] = (),
    ) -> None:
        """extra: more `--set` settings of the cluster (`workers.prefill=2`, `master.hot_threshold=5`)."""
        from pathlib import Path

        self._state = Path(workdir) / "state.json"
        log = (Path(workdir) / "up.log").open("wb")
        settings = [
            f"workers.prefix_caching={'true' if prefix_caching else 'false'}",
            f"workers.num_blocks={num_blocks}",
            f"workers.segment_bytes={512 << 20}",
            f'log_dir="{workdir}/logs"',
            *extra,
        ]
        cmd = [
            sys.executable,
            "-m",
            "tsukimi.cli",
            "up",
            "--model",
            model,
            "--mode",
            mode,
            "--port",
            str(free_port()),
            "--state-file",
            str(self._state),
            *(f"--set={s}" for s in settings),
        ]
        self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 300
        while not self._state.exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise PeerError(f"tsukimi up did not start: see {workdir}/up.log")
            time.sleep(0.2)
        state = json.loads(self._state.read_text())
        self.api = str(state["api"])
        self.master = next((str(p["url"]) for p in state["processes"] if p["role"] == "master"), "")

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def planned_runs(cfg: ServeBenchConfig) -> list[tuple[str, bool, float]]:
    """(label, KV reuse, hot_threshold) of each run."""
    if cfg.url:
        return [("reuse", True, cfg.hot_threshold)]
    if cfg.compare_hot:
        return [("hot_off", True, 0.0), ("hot_on", True, cfg.hot_threshold)]
    runs = [("reuse", True, cfg.hot_threshold), ("no_reuse", False, cfg.hot_threshold)]
    return runs if cfg.compare_reuse else runs[:1]


def run_bench(cfg: ServeBenchConfig, progress: Callable[[str], None]) -> dict[str, object]:
    """Run the workload (twice with compare_reuse or compare_hot); the JSON-ready result."""
    runs: dict[str, dict[str, object]] = {}
    for label, reuse, hot in planned_runs(cfg):
        with tempfile.TemporaryDirectory(prefix="tsukimi-bench-serve-") as workdir:
            extra = (f"workers.prefill={cfg.prefill}", f"master.hot_threshold={hot}")
            cluster = None if cfg.url else LocalCluster(cfg.model, cfg.mode, reuse, workdir, cfg.num_blocks, extra)
            try:
                url = cfg.url or (cluster.api if cluster else "")
                progress(f"{label}: {cfg.workload} workload against {url}")
                runs[label] = asyncio.run(_workload(cfg, url)).as_dict()
                if cluster is not None and cluster.master:
                    from tsukimi.bench.skewed import hot_counters

                    runs[label]["master"] = hot_counters(cluster.master)
            finally:
                if cluster is not None:
                    cluster.close()
    result: dict[str, object] = {"config": _plain(cfg), "runs": runs}
    for key, (a, b, q) in {
        "ttft_p50_ratio": ("reuse", "no_reuse", "p50"),
        "ttft_p90_ratio": ("hot_on", "hot_off", "p90"),
    }.items():
        if a in runs and b in runs:
            first, second = runs[a]["ttft_s"], runs[b]["ttft_s"]
            assert isinstance(first, dict) and isinstance(second, dict)
            if first[q] and second[q]:
                result[key] = round(first[q] / second[q], 4)
    return result


async def _workload(cfg: ServeBenchConfig, url: str) -> ServeReport:
    if cfg.workload == "chat":
        return await run_chat(url, cfg.model, cfg.chat)
    if cfg.workload == "skewed":
        return await run_skewed(url, cfg.model, cfg.skewed)
    from tsukimi.sim.trace import load_trace

    trace = load_trace(cfg.trace, limit=cfg.trace_limit)
    return await run_trace(url, cfg.model, trace, 16, cfg.speed, 4096, 32)


def markdown(result: dict[str, object]) -> str:
    runs = result["runs"]
    assert isinstance(runs, dict)
    header = (
        "| run | requests | done | rejected | TTFT p50 / p90 / p99 s | TBT p50 / p90 ms | cached | from pool "
        "| index exact |"
    )
    lines = [header, "|---|---|---|---|---|---|---|---|---|"]
    for label, run in runs.items():
        ttft, tbt = run["ttft_s"], run["tbt_s"]
        lines.append(
            f"| {label} | {run['requests']} | {run['completed']} | {run['rejected']} | "
            f"{ttft['p50']} / {ttft['p90']} / {ttft['p99']} | {_ms(tbt['p50'])} / {_ms(tbt['p90'])} | "
            f"{run['cached_ratio']} | {run['pool_prompt_tokens']} | {run['index_exact_ratio']} |"
        )
    if "ttft_p50_ratio" in result:
        lines.append(f"\nmedian TTFT with reuse / without: {result['ttft_p50_ratio']}")
    if "ttft_p90_ratio" in result:
        lines.append(f"\np90 TTFT with hot-key replication on / off: {result['ttft_p90_ratio']}")
    lines += ["", *(f"master counters, {label}: {run['master']}" for label, run in runs.items() if "master" in run)]
    return "\n".join(lines)


def _ms(value: object) -> str:
    return f"{float(str(value)) * 1e3:.0f}" if value is not None else "-"


def _plain(cfg: ServeBenchConfig) -> dict[str, object]:
    from dataclasses import asdict

    return asdict(cfg)
