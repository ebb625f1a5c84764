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
- pool: the trace's conversations and documents, round by round, a working set four times each
  worker's KV cache (tsukimi/bench/pool_workload.py); run on a PD cluster with the KV pool,
  then on a colocated one of as many workers without it (tsukimi/bench/pool_serve.py), and
  the TTFT ratio reported with the prompt tokens each reused from its own cache and the pool.

Every request goes through the bench's one client (tsukimi/bench/client.py) with an
`X-Request-Id` of its own. Per request: TTFT (first streamed token), TBT (mean gap between
later tokens), prompt tokens served from cache (`usage.prompt_tokens_details.cached_tokens`),
rejections (429/503 with a reason). After a run the router's decision records of those ids
(tsukimi/bench/decisions.py) give, in PD mode, the tokens loaded from the pool and whether the
prefix index expected exactly the reuse it placed each request for: `index_exact_ratio`,
`index_up_to_date_ratio` and the misses by direction and cause.

`--quick` (any workload): chat 4 conversations x 2 turns on a 1,000-token prefix; skewed 20
requests on a 500-token prefix; trace the first 20 requests; pool 4 families x 2 turns of at
most 512 tokens; overload 10 s after a 6 s calibration (tsukimi/bench/overload.py).

Goals (docs/benchmarks.md), as the report's verdicts: median TTFT with reuse <= 0.5x without
(chat), with the pool <= 0.5x without (pool); the prefix index exact for >= 99 % of the
requests (PD mode).
"""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tsukimi.bench.client import CompletionRequest, CompletionResult, complete
from tsukimi.bench.decisions import fetch_decisions, index_accuracy
from tsukimi.bench.pool_serve import POOL_RUNS, pool_counters, pool_settings, reuse_counters, turn_figures
from tsukimi.bench.pool_workload import PoolRequest, PoolSizing, PoolWorkload, pool_requests, sizing
from tsukimi.bench.report import BenchReport, FigureViews, Verdict, begin, finish, goal
from tsukimi.bench.skewed import SkewedWorkload, skewed_requests
from tsukimi.bench.up_cluster import launch_up, serving_settings
from tsukimi.quantiles import summary
from tsukimi.serving.router.decision_log import DecisionRecord
from tsukimi.sim.trace import TraceRequest, load_trace

_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    conversations: int = 8
    turns: int = 4
    prefix_tokens: int = 2000
    user_tokens: int = 64
    max_tokens: int = 16
    rate: float = 2.0  # first turns per second
    seed: int = 0


QUICK_CHAT = ChatWorkload(conversations=4, turns=2, prefix_tokens=1000)
QUICK_SKEWED = SkewedWorkload(requests=20, prefix_tokens=500)
QUICK_TRACE_LIMIT = 20


@dataclass(slots=True)
class ServeRun:
    """What one run sent and how each request ended (in the order they ended), and its length."""

    label: str
    sent: list[tuple[CompletionRequest, CompletionResult]] = field(default_factory=list)
    wall_s: float = 0.0
    _serial: int = 0
    _token: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    def request(self, prompt: Sequence[int], max_tokens: int) -> CompletionRequest:
        """The next request of this run, with an id of its own (mutates the count)."""
        self._serial += 1
        return CompletionRequest(
            tuple(prompt), max_tokens, request_id=f"serve-{self.label}-{self._token}-{self._serial}"
        )

    async def send(self, url: str, model: str, request: CompletionRequest) -> None:
        """Send `request` and note how it ended (mutates)."""
        self.sent.append((request, await complete(url, model, request, _TIMEOUT_S)))

    def request_ids(self) -> list[str]:
        """The id of every request: the answer's X-Request-Id, else the one sent."""
        return [result.request_id or request.request_id for request, result in self.sent]

    def figures(self, records: Mapping[str, DecisionRecord]) -> dict[str, object]:
        """The run's figures; `records`: the router's decision records by request id ({}: none). Pure."""
        ok = [(q, r) for q, r in self.sent if r.kind == "served"]
        prompt = sum(r.prompt_tokens or len(q.prompt) for q, r in ok)
        cached = sum(r.cached_tokens for _, r in ok)
        mine = [records[rid] for rid in self.request_ids() if rid in records]
        pooled = [r.pool_tokens for r in mine if r.pool_tokens is not None]
        wall = self.wall_s
        return {
            "requests": len(self.sent),
            "completed": len(ok),
            "rejected": sum(r.kind == "rejected" for _, r in self.sent),
            "errors": sum(r.kind in ("error", "failed") for _, r in self.sent),
            "ttft_s": summary((r.ttft_s for _, r in ok), ndigits=4),
            "tbt_s": summary((r.tbt_s for _, r in ok), ndigits=4),
            "throughput_rps": round(len(ok) / wall, 4) if wall else 0.0,
            "output_tokens_per_s": round(sum(r.completion_tokens for _, r in ok) / wall, 2) if wall else 0.0,
            "prompt_tokens": prompt,
            "cached_prompt_tokens": cached,
            "cached_ratio": round(cached / prompt, 4) if prompt else 0.0,
            "pool_prompt_tokens": sum(pooled) if pooled else None,
            "decision_records": len(mine),
            **index_accuracy(mine),
        }


async def run_chat(url: str, model: str, workload: ChatWorkload, run: ServeRun) -> None:
    """The chat workload against `url` (see the module); fills `run`."""
    rng = np.random.default_rng(workload.seed)
    vocab = (3, 250)  # NOTE: ids every tokenizer here has; the content does not matter, only reuse
    prefix = rng.integers(*vocab, workload.prefix_tokens).tolist()
    start = time.perf_counter()

    async def conversation(index: int) -> None:
        await asyncio.sleep(index / workload.rate)
        history = list(prefix)
        for _ in range(workload.turns):
            history += rng.integers(*vocab, workload.user_tokens).tolist()
            await run.send(url, model, run.request(history, workload.max_tokens))
            history += rng.integers(*vocab, workload.max_tokens).tolist()  # stands for the reply

    await asyncio.gather(*(conversation(i) for i in range(workload.conversations)))
    run.wall_s = time.perf_counter() - start


async def run_skewed(url: str, model: str, workload: SkewedWorkload, run: ServeRun) -> None:
    """The skewed workload against `url`: open loop, each request at its arrival time; fills `run`."""
    start = time.perf_counter()

    async def one(at_s: float, prompt: list[int]) -> None:
        await asyncio.sleep(max(0.0, at_s - (time.perf_counter() - start)))
        await run.send(url, model, run.request(prompt, workload.max_tokens))

    await asyncio.gather(*(one(r.at_s, r.prompt) for r in skewed_requests(workload)))
    run.wall_s = time.perf_counter() - start


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
    run: ServeRun,
) -> None:
    """The trace workload (see the module): open loop at the trace's pace times `speed`; fills `run`."""
    prompts = trace_prompts(trace, block_tokens, max_prompt)
    start = time.perf_counter()
    t0 = trace[0].timestamp_ms if trace else 0

    async def one(request: TraceRequest, prompt: list[int]) -> None:
        await asyncio.sleep((request.timestamp_ms - t0) / 1000 / speed)
        out = max(1, min(max_tokens, round(request.output_length * block_tokens / 512)))
        await run.send(url, model, run.request(prompt, out))

    await asyncio.gather(*(one(r, p) for r, p in zip(trace, prompts, strict=True)))
    run.wall_s = time.perf_counter() - start


async def run_pool(url: str, model: str, requests: Sequence[PoolRequest], run: ServeRun) -> None:
    """The pool workload (tsukimi/bench/pool_workload.py): each request at its time, or once its
    family's previous turn has ended if later; fills `run`."""
    start = time.perf_counter()
    by_family: dict[int, list[PoolRequest]] = {}
    for request in requests:
        by_family.setdefault(request.family, []).append(request)

    async def family(turns: list[PoolRequest]) -> None:
        for turn in turns:
            await asyncio.sleep(max(0.0, turn.at_s - (time.perf_counter() - start)))
            await run.send(url, model, run.request(turn.prompt, turn.max_tokens))

    await asyncio.gather(*(family(turns) for turns in by_family.values()))
    run.wall_s = time.perf_counter() - start


@dataclass(frozen=True, slots=True)
class ServeBenchConfig:
    """`url` of a running API, or "" to start `tsukimi up` (model, mode, `prefill` prefill
    workers) for each run; compare_reuse: run twice, with and without KV reuse, and report the
    TTFT ratio; compare_hot (instead): run with the master's hot_threshold 0 (off), then
    `hot_threshold`, and report the p90 TTFT ratio and the master's hot-key counters.
    Workload "pool" ignores `mode` and `num_blocks`: its runs are a PD cluster with the pool
    and a colocated one without, each worker's cache sized by `pool` (tsukimi/bench/pool_serve.py)."""

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
    pool: PoolWorkload = field(default_factory=PoolWorkload)


def planned_runs(cfg: ServeBenchConfig) -> list[tuple[str, bool, float]]:
    """(label, KV reuse, hot_threshold) of each run."""
    if cfg.url:
        return [("reuse", True, cfg.hot_threshold)]
    if cfg.compare_hot:
        return [("hot_off", True, 0.0), ("hot_on", True, cfg.hot_threshold)]
    runs = [("reuse", True, cfg.hot_threshold), ("no_reuse", False, cfg.hot_threshold)]
    if cfg.workload == "pool":
        runs = [(label, True, cfg.hot_threshold) for label in POOL_RUNS]
    return runs if cfg.compare_reuse else runs[:1]


def run_bench(cfg: ServeBenchConfig, progress: Callable[[str], None]) -> dict[str, object]:
    """Run the workload (twice with compare_reuse or compare_hot, each on a cluster of its
    own unless cfg.url is set); the figures."""
    runs: dict[str, dict[str, object]] = {}
    sized = pool_sizing(cfg) if cfg.workload == "pool" else None
    if sized is not None:
        progress(f"pool workload: {sized}")
    for label, reuse, hot in planned_runs(cfg):
        if cfg.url:
            runs[label] = _one_run(cfg, label, cfg.url, progress)
            continue
        extra = (f"workers.prefill={cfg.prefill}", f"master.hot_threshold={hot}")
        if sized is not None:  # NOTE: no_pool runs colocated, without a master
            settings = pool_settings(
                label, cfg.model, sized.num_blocks, cfg.prefill, extra[1:] if label == "pool" else ()
            )
        else:
            settings = serving_settings(
                cfg.model, cfg.mode, prefix_caching=reuse, num_blocks=cfg.num_blocks, extra=extra
            )
        with (
            tempfile.TemporaryDirectory(prefix="tsukimi-bench-serve-") as workdir,
            launch_up(settings, Path(workdir)) as cluster,
            cluster.tending(),
        ):
            runs[label] = _one_run(cfg, label, cluster.api, progress)
            if sized is not None:
                runs[label]["reuse_by_role"] = reuse_counters(cluster.processes)
                runs[label]["pool"] = pool_counters(cluster.master) if cluster.master else None
            elif cluster.master:
                from tsukimi.bench.skewed import hot_counters

                runs[label]["master"] = hot_counters(cluster.master)
    figures: dict[str, object] = {"runs": runs}
    if sized is not None:
        figures["pool_sizing"] = dataclasses.asdict(sized)
    for key, (a, b, q) in {
        "ttft_p50_ratio": ("reuse", "no_reuse", "p50"),
        "ttft_p90_ratio": ("hot_on", "hot_off", "p90"),
        "pool_ttft_p50_ratio": ("pool", "no_pool", "p50"),
        "pool_ttft_p90_ratio": ("pool", "no_pool", "p90"),
    }.items():
        if a in runs and b in runs:
            first, second = runs[a]["ttft_s"], runs[b]["ttft_s"]
            assert isinstance(first, dict) and isinstance(second, dict)
            if first[q] and second[q]:
                figures[key] = round(first[q] / second[q], 4)
    return figures


def _one_run(cfg: ServeBenchConfig, label: str, url: str, progress: Callable[[str], None]) -> dict[str, object]:
    """One run of the workload against `url`: its figures, with the router's decision records."""
    progress(f"{label}: {cfg.workload} workload against {url}")
    run = ServeRun(label)
    asyncio.run(_workload(cfg, url, run))
    records = fetch_decisions(url, run.request_ids())
    figures = run.figures(records)
    if cfg.workload == "pool":
        figures |= turn_figures(run.sent, [records.get(rid) for rid in run.request_ids()], _pool_requests(cfg))
    return figures


def pool_sizing(cfg: ServeBenchConfig) -> PoolSizing:
    """The pool workload's working set and each worker's cache, from `cfg.trace` (reads it).

    Raises:
        InvalidArgument: the trace cannot be read. ConfigError: too few families in it.
    """
    return sizing(_pool_requests(cfg), cfg.pool)


def _pool_requests(cfg: ServeBenchConfig) -> list[PoolRequest]:
    return pool_requests(load_trace(cfg.trace), cfg.pool)


def verdicts(figures: Mapping[str, object]) -> list[Verdict]:
    """The goals (see the module); n/a where a run did not happen or no record told. Pure."""
    runs = figures["runs"]
    assert isinstance(runs, dict)
    pooled = "pool_sizing" in figures
    ratio = figures.get("pool_ttft_p50_ratio" if pooled else "ttft_p50_ratio")
    # NOTE: not the no_reuse run: its workers cache nothing on purpose, so no index can match them
    exact = [
        float(r["index_exact_ratio"])
        for label, r in runs.items()
        if label != "no_reuse" and r.get("index_exact_ratio") is not None
    ]
    name, what = ("pool", "the pool") if pooled else ("reuse", "reuse")
    return [
        goal(f"{name}_ttft_p50", f"median TTFT with {what} / without", float(str(ratio)) if ratio else None, "<=", 0.5),
        goal(
            "index_exact",
            "share of requests whose reuse the prefix index expected exactly",
            min(exact) if exact else None,
            ">=",
            0.99,
        ),
    ]


def run_report(cfg: ServeBenchConfig, progress: Callable[[str], None]) -> BenchReport:
    """`tsukimi bench serve`: run (see `run_bench`) and report, with the goals as verdicts."""
    start = begin("bench serve", cfg)
    figures = run_bench(cfg, progress)
    return finish(start, figures, verdicts(figures))


async def _workload(cfg: ServeBenchConfig, url: str, run: ServeRun) -> None:
    if cfg.workload == "chat":
        return await run_chat(url, cfg.model, cfg.chat, run)
    if cfg.workload == "skewed":
        return await run_skewed(url, cfg.model, cfg.skewed, run)
    if cfg.workload == "pool":
        return await run_pool(url, cfg.model, _pool_requests(cfg), run)
    trace = load_trace(cfg.trace, limit=cfg.trace_limit)
    return await run_trace(url, cfg.model, trace, 16, cfg.speed, 4096, 32, run)


def markdown(figures: Mapping[str, object]) -> str:
    """The runs as the table docs/benchmarks.md holds (pure)."""
    runs = figures["runs"]
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
    if "ttft_p50_ratio" in figures:
        lines.append(f"\nmedian TTFT with reuse / without: {figures['ttft_p50_ratio']}")
    if "ttft_p90_ratio" in figures:
        lines.append(f"\np90 TTFT with hot-key replication on / off: {figures['ttft_p90_ratio']}")
    if "pool_sizing" in figures:
        lines.append(f"\nworking set and each worker's cache: {figures['pool_sizing']}")
        ratios = (figures.get("pool_ttft_p50_ratio"), figures.get("pool_ttft_p90_ratio"))
        lines.append(f"\nTTFT with the pool / without: p50 {ratios[0]}, p90 {ratios[1]}")
        lines += [f"\nprompt tokens reused, {label}: {run.get('reuse_by_role')}" for label, run in runs.items()]
        lines += [f"\nthe store, {label}: {run['pool']}" for label, run in runs.items() if run.get("pool")]
    lines += ["", *(f"master counters, {label}: {run['master']}" for label, run in runs.items() if "master" in run)]
    return "\n".join(lines)


def _ms(value: object) -> str:
    return f"{float(str(value)) * 1e3:.0f}" if value is not None else "-"


VIEWS = FigureViews(markdown)
