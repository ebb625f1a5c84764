"""The `skewed` workload of `tsukimi bench serve` (issue 16 part 2, hot-spot replication live).

`requests` requests arrive as a Poisson process of `rate` per second; a fraction `shared` of
them start with the same `prefix_tokens`-token system prompt followed by `suffix_tokens` tokens
of their own, the others are `prefix_tokens + suffix_tokens` tokens of their own. One seed gives
the same prompts and arrival times; `run_skewed` (tsukimi/bench/serve.py) sends them. The
master's hot-key counters (`hot_counters`) say whether hot-key replication acted during a run.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import numpy as np

_VOCAB = (3, 250)  # NOTE: ids every tokenizer here has (as in the chat workload)


@dataclass(frozen=True, slots=True)
class SkewedWorkload:
    requests: int = 60
    shared: float = 0.9
    prefix_tokens: int = 1500
    suffix_tokens: int = 32
    max_tokens: int = 8
    rate: float = 4.0  # requests per second
    seed: int = 0


@dataclass(frozen=True, slots=True)
class SkewedRequest:
    at_s: float  # arrival, from the start of the run
    prompt: list[int]
    shared: bool  # starts with the shared system prompt


def skewed_requests(workload: SkewedWorkload) -> list[SkewedRequest]:
    """The workload's requests in arrival order (pure: the same for the same workload)."""
    rng = np.random.default_rng(workload.seed)
    prefix = rng.integers(*_VOCAB, workload.prefix_tokens).tolist()
    gaps = rng.exponential(1 / workload.rate, workload.requests)
    arrivals = np.cumsum(gaps) - gaps[0]  # the first request at 0
    shared = rng.random(workload.requests) < workload.shared
    requests = []
    for at, is_shared in zip(arrivals.tolist(), shared.tolist(), strict=True):
        own = rng.integers(*_VOCAB, workload.suffix_tokens + (0 if is_shared else workload.prefix_tokens)).tolist()
        requests.append(SkewedRequest(at, (prefix + own) if is_shared else own, bool(is_shared)))
    return requests


def hot_counters(master_url: str) -> dict[str, float]:
    """The master's hot-key counters from its /metrics (hot_replications, hot_drops, hot_sheds)."""
    text = httpx.get(f"{master_url}/metrics", timeout=10.0).text
    counters: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        for key in ("hot_replications", "hot_drops", "hot_sheds"):
            if name in (f"tsukimi_master_{key}", f"tsukimi_master_{key}_total"):
                counters[key] = float(value)
    return counters
