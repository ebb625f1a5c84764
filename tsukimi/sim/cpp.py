"""`tsukimi sim cpp`: the long-prompt TTFT curve of a prefill pool with and without chunked
pipeline parallelism (CPP), on a trace.

The pool has `num_prefill` nodes, each with the time it is next free. Without CPP (k = 1) a
request runs on one node; with CPP it may also run on a group of k consecutive nodes (fixed
groups 0..k-1, k..2k-1, ...), a pipeline of k stages (tsukimi/scheduler/cpp.py): chunk c
enters node s once node s is free and node s - 1 passed it on, so groups pipeline across
requests too. Each request, in arrival order, takes the option (one node or a group) that
finishes its prefill first: the Conductor's TTFT rule, so short prompts stay on single nodes
and long ones use a group when the group's fill and queue still beat one node. TTFT here is
prefill queue + compute (+ hidden-state hops), no decode.
A greedy choice lets a long prompt take a group that short prompts arriving next
would have used, so groups are offered only to prompts of at least `min_tokens`. Prefix
reuse: one unbounded global pool (blocks seen earlier are cached), the same for every k.

Deterministic: the same trace and settings give the same figures. NOTE: kept out of
simulator.py on purpose (a separate, small model of the prefill pool only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tsukimi.errors import ConfigError
from tsukimi.quantiles import quantile
from tsukimi.scheduler.cost_model import CostModel, RooflineCostModel
from tsukimi.scheduler.cpp import hop_s_per_token
from tsukimi.sim.trace import BLOCK_SIZE_TOKENS, TraceRequest

LENGTH_BINS = (0, 4096, 8192, 16384, 32768, 65536, 131072)


@dataclass(frozen=True, slots=True)
class CppSimConfig:
    """num_prefill: nodes in the prefill pool; stages: the group sizes to compare (1 = no
    CPP; each must divide num_prefill); chunk_tokens: tokens per chunk (and per step without
    CPP); speed: replay this many times faster; hidden_bytes / link_bytes_s / hop_latency_s:
    one token's hidden state, the inter-node bandwidth and the per-hop latency; min_tokens:
    the shortest prompt offered a group."""

    num_prefill: int = 8
    stages: tuple[int, ...] = (1, 2, 4)
    chunk_tokens: int = 8192
    speed: float = 1.0
    hidden_bytes: int = 8192 * 2
    link_bytes_s: float = 25e9
    hop_latency_s: float = 1e-3
    min_tokens: int = 32768

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.chunk_tokens < 1 or self.speed <= 0:
            raise ConfigError("num_prefill and chunk_tokens must be >= 1, speed > 0")
        if not self.stages or any(k < 1 or self.num_prefill % k for k in self.stages):
            raise ConfigError(f"each group size must divide num_prefill ({self.num_prefill}): {self.stages}")


def _pipeline(cost: CostModel, free: list[float], arrival: float, new: int, cached: int, cfg: CppSimConfig) -> float:
    """Run a prompt through the nodes whose free times are `free` (one stage each, in order;
    mutates `free`); when its first token is ready."""
    k = len(free)
    hop = hop_s_per_token(cfg.hidden_bytes, 1, cfg.link_bytes_s)
    done = 0
    while done < new:
        size = min(cfg.chunk_tokens, new - done)
        stage_s = cost.prefill_s(size, cached + done) / k
        ready = arrival
        for s in range(k):
            free[s] = max(ready, free[s]) + stage_s
            ready = free[s] + cfg.hop_latency_s + size * hop
        done += size
    return free[-1]


def simulate_ttft(trace: Sequence[TraceRequest], cfg: CppSimConfig, stages: int, cost: CostModel) -> list[float]:
    """Each request's TTFT (s) when the pool may run it on one node or on a group of `stages`
    consecutive nodes (whichever finishes first; `stages` 1: one node only). Pure."""
    free_at = [0.0] * cfg.num_prefill
    singles = [[n] for n in range(cfg.num_prefill)]
    grouped = (
        singles + [list(range(g, g + stages)) for g in range(0, cfg.num_prefill, stages)] if stages > 1 else singles
    )
    seen: set[int] = set()
    out = []
    for request in trace:
        arrival = request.timestamp_ms / 1000 / cfg.speed
        hits = next((n for n, h in enumerate(request.hash_ids) if h not in seen), len(request.hash_ids))
        cached = max(0, min(hits * BLOCK_SIZE_TOKENS, request.input_length - 1))
        new = request.input_length - cached
        best: tuple[float, list[float], list[int]] | None = None
        for nodes in grouped if request.input_length >= cfg.min_tokens else singles:
            free = [free_at[n] for n in nodes]
            end = _pipeline(cost, free, arrival, new, cached, cfg)
            if best is None or end < best[0]:
                best = (end, free, nodes)
        assert best is not None
        for node, free_s in zip(best[2], best[1], strict=True):
            free_at[node] = free_s
        seen.update(request.hash_ids)
        out.append(best[0] - arrival)
    return out


def ttft_curve(trace: Sequence[TraceRequest], cfg: CppSimConfig, cost: CostModel | None = None) -> dict[str, object]:
    """Mean and p90 TTFT per prompt-length bin, for each group size (a JSON-able dict; pure)."""
    cost = cost or RooflineCostModel()
    lengths = [r.input_length for r in trace]
    rows = []
    for stages in cfg.stages:
        ttfts = simulate_ttft(trace, cfg, stages, cost)
        for low, high in zip(LENGTH_BINS, (*LENGTH_BINS[1:], math.inf), strict=True):
            mine = [t for t, n in zip(ttfts, lengths, strict=True) if low <= n < high]
            if mine:
                rows.append(
                    {
                        "stages": stages,
                        "min_tokens": low,
                        "requests": len(mine),
                        "ttft_mean_s": round(sum(mine) / len(mine), 4),
                        "ttft_p90_s": round(quantile(mine, 0.9), 4),
                    }
                )
    return {"config": asdict(cfg), "rows": rows}


def markdown(curve: dict[str, object]) -> str:
    """The curve as a table: one row per length bin, mean / p90 TTFT per group size."""
    rows, cfg = curve["rows"], curve["config"]
    assert isinstance(rows, list) and isinstance(cfg, dict)
    stages = cfg["stages"]
    head = " | ".join(f"k = {k} mean / p90" for k in stages)
    lines = [f"| prompt tokens | requests | {head} |", "|---|---|" + "---|" * len(stages)]
    for low in dict.fromkeys(r["min_tokens"] for r in rows):
        mine = {r["stages"]: r for r in rows if r["min_tokens"] == low}
        cells = " | ".join(f"{mine[k]['ttft_mean_s']:.2f} / {mine[k]['ttft_p90_s']:.2f} s" for k in stages)
        lines.append(f"| >= {low:,} | {mine[stages[0]]['requests']} | {cells} |")
    return "\n".join(lines)


def plot(curve: dict[str, object], path: Path, trace_name: str) -> str:
    """Mean TTFT against prompt length, one line per group size; writes a PNG, returns its path."""
    from tsukimi.sim.plots import pyplot  # NOTE: matplotlib (the plots extra) only when a plot is drawn

    plt = pyplot()
    rows = curve["rows"]
    assert isinstance(rows, list)
    fig, ax = plt.subplots(figsize=(6, 4))
    for k in dict.fromkeys(r["stages"] for r in rows):
        mine = [r for r in rows if r["stages"] == k]
        label = "no CPP" if k == 1 else f"CPP, groups of {k}"
        ax.plot([max(1024, r["min_tokens"]) for r in mine], [r["ttft_mean_s"] for r in mine], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens (bin lower edge)")
    ax.set_ylabel("mean TTFT (s)")
    ax.set_title(f"Long-prompt TTFT with and without CPP ({trace_name})")
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return str(path)
