"""The dashboard's one data type, `Snapshot` (JSON via msgspec), and how it is read off state the
router already keeps: the workers' polled loads (`Router.workers`), the API's Prometheus
counters (`ApiMetrics.registry`), the decision log (`Router.decisions`), the store probe's
last view and the latency series. Pure functions: the sampler (app.py) calls them once
per interval; nothing here runs on the request path.
"""

from __future__ import annotations

import msgspec
from prometheus_client import CollectorRegistry

from tsukimi.serving.dashboard.series import Point
from tsukimi.serving.dashboard.store_probe import StoreView
from tsukimi.serving.router.decision_log import DecisionRecord
from tsukimi.serving.router.workers import WorkerStatus

_PREFIX = "tsukimi_router_"


class WorkerRow(msgspec.Struct, frozen=True):
    """One worker: its queue (`waiting`), `running` requests, this router's `in_flight` ones and
    the `requests` it has sent there; KV blocks as the worker last reported them."""

    name: str
    role: str
    healthy: bool
    waiting: int
    running: int
    in_flight: int
    requests: int
    used_blocks: int
    free_blocks: int
    total_blocks: int


class Totals(msgspec.Struct, frozen=True):
    """Running totals since the router started. `hit_ratio`: prompt tokens whose KV was reused
    over prompt tokens; `pool_ratio`: of those, the ones loaded from the KV pool, over prompt tokens."""

    requests_ok: int
    requests_failed: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    pool_tokens: int
    hit_ratio: float
    pool_ratio: float


class Latency(msgspec.Struct, frozen=True):
    """TTFT and TBT percentiles (p50, p90, p99; seconds, null with no sample) over the last
    `window_s` seconds, from `samples` requests."""

    window_s: float
    samples: int
    ttft_s: list[float | None]
    tbt_s: list[float | None]


class Snapshot(msgspec.Struct, frozen=True):
    """The cluster as the router sees it at `wall_s` (Unix seconds) = `clock_s` (the router's
    clock, which the decisions' `time_s` are on); `seq` counts snapshots. `series`: the chart
    points, oldest first (the events stream sends the newest only); `decisions`: newest first,
    `decisions_total` ever recorded."""

    seq: int
    wall_s: float
    clock_s: float
    interval_s: float
    mode: str
    model: str
    workers: list[WorkerRow]
    store: StoreView
    totals: Totals
    rejections: dict[str, int]
    latency: Latency
    series: list[Point]
    decisions: list[DecisionRecord]
    decisions_total: int


def worker_rows(workers: list[WorkerStatus]) -> list[WorkerRow]:
    """The workers' rows (pure)."""
    return [
        WorkerRow(
            w.name,
            w.role,
            w.healthy,
            w.waiting,
            w.running,
            w.in_flight,
            w.requests,
            max(0, w.total_blocks - w.free_blocks),
            w.free_blocks,
            w.total_blocks,
        )
        for w in workers
    ]


def read_counters(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the router's registry by (name without the prefix, sorted labels). Pure
    (reads the metrics under their own locks)."""
    out = {}
    for family in registry.collect():
        for s in family.samples:
            out[(s.name.removeprefix(_PREFIX), tuple(sorted(s.labels.items())))] = s.value
    return out


def totals(counters: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> tuple[Totals, dict[str, int]]:
    """The running totals and the rejections by reason, from `read_counters`' output (pure)."""

    def one(name: str) -> int:
        return int(counters.get((name, ()), 0))

    ok = failed = 0
    rejections: dict[str, int] = {}
    for (name, labels), value in counters.items():
        fields = dict(labels)
        if name == "requests_total":
            if fields.get("outcome") == "ok":
                ok += int(value)
            else:
                failed += int(value)
        elif name == "rejections_total":
            rejections[fields.get("reason", "")] = int(value)
    prompt = one("prompt_tokens_total")
    cached, pool = one("cached_prompt_tokens_total"), one("pool_prompt_tokens_total")
    summary = Totals(
        ok,
        failed,
        prompt,
        one("completion_tokens_total"),
        cached,
        pool,
        cached / prompt if prompt else 0.0,
        pool / prompt if prompt else 0.0,
    )
    return summary, rejections
