"""The two clusters `tsukimi bench serve --workload pool` compares, and what their workers and
the store master counted of the workload's reuse (tsukimi/bench/pool_workload.py builds the
workload, tsukimi/bench/serve.py sends it).

    pool      `tsukimi up --mode pd`: `prefill` prefill workers and one decode worker over the
              KV pool (each worker's share `SEGMENT_BYTES`), placed by the Conductor, whose
              prefix index knows each prefill worker's cache and the pool
    no_pool   `tsukimi up --mode colocated` with as many workers (prefill + 1) and no pool:
              each worker reuses only its own cache; placed least-loaded (tsukimi's colocated
              workers feed no prefix index)

Every worker's KV cache is the workload's `num_blocks` in both. A worker counts the prompt
tokens it reused from its own cache and from the pool (`tsukimi_worker_local_prompt_tokens`,
`tsukimi_worker_pool_prompt_tokens` on its /metrics): summed by role here, so the pool run
tells the prefill workers' pool loads (what TTFT gains) from the decode worker's (the PD
hand-over). The master's objects, evictions and bytes say whether the pool held the whole
working set.
"""

from __future__ import annotations

from collections.abc import Sequence

import httpx

from tsukimi.bench.client import CompletionRequest, CompletionResult
from tsukimi.bench.pool_workload import PoolRequest
from tsukimi.bench.up_cluster import serving_settings
from tsukimi.quantiles import summary
from tsukimi.serving.cluster.launcher import LaunchedProcess
from tsukimi.serving.router.decision_log import DecisionRecord

POOL_RUNS = ("pool", "no_pool")
_WORKER_COUNTERS = {"local": "tsukimi_worker_local_prompt_tokens", "pool": "tsukimi_worker_pool_prompt_tokens"}
_MASTER_GAUGES = {
    "objects": "tsukimi_master_objects",
    "evictions": "tsukimi_master_evictions",
    "used_bytes": "tsukimi_master_segment_used_bytes",
    "capacity_bytes": "tsukimi_master_segment_capacity_bytes",
}


def pool_settings(label: str, model: str, num_blocks: int, prefill: int, extra: Sequence[str] = ()) -> list[str]:
    """The `--set` settings of the cluster of run `label` ("pool" or "no_pool", see the module). Pure."""
    if label == "pool":
        return serving_settings(model, "pd", num_blocks=num_blocks, extra=(f"workers.prefill={prefill}", *extra))
    assert label == "no_pool", label
    return serving_settings(
        model, "colocated", num_blocks=num_blocks, extra=(f"workers.colocated={prefill + 1}", *extra)
    )


def turn_figures(
    sent: Sequence[tuple[CompletionRequest, CompletionResult]],
    records: Sequence[DecisionRecord | None],
    requests: Sequence[PoolRequest],
) -> dict[str, object]:
    """Where TTFT goes: the served requests' TTFT split into first turns (nothing to reuse yet)
    and later turns (their family's prefix to reuse), matched by prompt; and how many requests
    the router's Conductor queued before prefill (`records`: the run's decision records, in
    the order sent, None where the router kept none), and how many waited, prefilled, for a
    place in the decode batch and how long: in PD the router holds the first token until the
    decode stage is admitted, so that wait is TTFT too. Pure."""
    turn = {r.prompt: r.turn for r in requests}
    served = [(turn.get(q.prompt), r.ttft_s) for q, r in sent if r.kind == "served"]
    waits = [r.decode_wait_s for r in records if r is not None and r.decode_wait_s is not None]
    return {
        "ttft_first_turns_s": summary((t for k, t in served if k == 0), ndigits=4),
        "ttft_later_turns_s": summary((t for k, t in served if k is not None and k > 0), ndigits=4),
        "queued_before_prefill": sum(1 for r in records if r is not None and r.queued),
        "waited_at_decode": len(waits),
        "decode_wait_s": summary(waits, ndigits=4),
    }


def parse_sums(text: str, names: dict[str, str]) -> dict[str, float]:
    """Prometheus text: each key of `names` -> the sum of its metric's samples (every label;
    a counter's `_total` too); 0 when absent. Pure."""
    sums = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        sample, _, value = line.rpartition(" ")
        metric = sample.partition("{")[0]
        for key, name in names.items():
            if metric in (name, f"{name}_total"):
                sums[key] += float(value)
    return sums


def reuse_counters(processes: Sequence[LaunchedProcess], timeout_s: float = 10.0) -> dict[str, int]:
    """The prompt tokens every worker reused, by role and source: "prefill_local_tokens",
    "prefill_pool_tokens", "decode_pool_tokens", "colocated_local_tokens", ... (only the
    roles present), from each worker's /metrics.

    Raises:
        httpx.HTTPError: a worker did not answer.
    """
    totals: dict[str, int] = {}
    for process in processes:
        if process.role not in ("prefill", "decode", "colocated"):
            continue
        text = httpx.get(f"{process.url}/metrics", timeout=timeout_s).text
        for source, value in parse_sums(text, _WORKER_COUNTERS).items():
            key = f"{process.role}_{source}_tokens"
            totals[key] = totals.get(key, 0) + int(value)
    return totals


def pool_counters(master_url: str, timeout_s: float = 10.0) -> dict[str, int]:
    """The store master's objects, evictions and segment bytes used / capacity (all segments).

    Raises:
        httpx.HTTPError: the master did not answer.
    """
    text = httpx.get(f"{master_url}/metrics", timeout=timeout_s).text
    return {key: int(value) for key, value in parse_sums(text, _MASTER_GAUGES).items()}
