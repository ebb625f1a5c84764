"""`tsukimi bench serve --workload skewed`: the requests' shape, shared fraction, Poisson
arrivals and determinism by seed; the runs `--compare-hot` plans (no cluster is started)."""

from __future__ import annotations

import numpy as np

from tsukimi.bench.serve import ServeBenchConfig, planned_runs
from tsukimi.bench.skewed import SkewedWorkload, hot_counters, skewed_requests


def test_skewed_requests_share_one_prompt_at_poisson_arrivals() -> None:
    workload = SkewedWorkload(requests=2000, shared=0.9, prefix_tokens=100, suffix_tokens=8, rate=20.0, seed=3)
    requests = skewed_requests(workload)
    assert len(requests) == 2000 and all(len(r.prompt) == 108 for r in requests)
    shared = [r for r in requests if r.shared]
    assert 0.87 < len(shared) / len(requests) < 0.93
    prefix = shared[0].prompt[:100]
    assert all(r.prompt[:100] == prefix for r in shared)
    assert len({tuple(r.prompt[100:]) for r in shared}) == len(shared)  # each its own suffix
    assert not any(r.prompt[:100] == prefix for r in requests if not r.shared)
    arrivals = np.array([r.at_s for r in requests])
    assert arrivals[0] == 0.0 and (np.diff(arrivals) >= 0).all()
    assert abs(np.diff(arrivals).mean() - 1 / 20.0) < 0.005  # Poisson: mean gap 1 / rate


def test_skewed_requests_are_the_same_for_the_same_seed() -> None:
    workload = SkewedWorkload(requests=50, prefix_tokens=64)
    assert skewed_requests(workload) == skewed_requests(SkewedWorkload(requests=50, prefix_tokens=64))
    assert skewed_requests(workload) != skewed_requests(SkewedWorkload(requests=50, prefix_tokens=64, seed=1))


def test_compare_hot_runs_off_then_on_with_reuse() -> None:
    cfg = ServeBenchConfig(workload="skewed", compare_hot=True, hot_threshold=2.0)
    assert planned_runs(cfg) == [("hot_off", True, 0.0), ("hot_on", True, 2.0)]
    assert planned_runs(ServeBenchConfig()) == [("reuse", True, 0.0), ("no_reuse", False, 0.0)]


def test_hot_counters_read_the_masters_metrics() -> None:
    from tsukimi.config import MasterConfig
    from tsukimi.store.master.server import MasterServer

    with MasterServer(MasterConfig(rpc_port=0, http_port=0, hot_threshold=1.0)) as server:
        assert hot_counters(server.http.base_url) == {"hot_replications": 0.0, "hot_drops": 0.0, "hot_sheds": 0.0}
