"""A slow network under PD serving (issue 24, item 3): 50 ms of delay each way on the decode
worker's link (a delay line, tsukimi/lab/delay_line.py; this kernel has no netem), added at run
time under the cluster's open connections. Every request ends within REQUEST_BOUND_S with one
host's greedy tokens or a clear 5xx, never wrong tokens or a hang; the latencies, with a
baseline of the same requests before the delay, print with `-s` (docs/reliability.md).
"""

from __future__ import annotations

import itertools
import statistics
import time
from pathlib import Path

import httpx
import pytest

from tsukimi.config import ClusterConfig, load
from tsukimi.lab import Lab, Topology
from tsukimi.lab.cluster import launch, place
from tsukimi.serving.cluster.launcher import LaunchConfig, LaunchedCluster
from tsukimi.serving.cluster.up import plan

from .conftest import needs_namespaces

pytestmark = [needs_namespaces, pytest.mark.timeout(240)]

PD_PLACEMENT = {"master": "m", "metadata": "m", "prefill": "p", "decode": "d", "router": "r"}
REQUEST_BOUND_S = 30.0
NEW_TOKENS = 8


def _serve(
    lab: Lab, cluster: LaunchedCluster, prompts: list[list[int]], expected: list[list[int]]
) -> tuple[list[str], list[float]]:
    """Each prompt once, from host "client": (outcome of each: "ok" or the status, latency s of each)."""
    outcomes: list[str] = []
    latencies_s: list[float] = []
    with lab.entered("client"):
        for prompt, tokens in zip(prompts, expected, strict=True):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
            body |= {"ignore_eos": True, "return_token_ids": True}
            start = time.monotonic()
            answer = httpx.post(cluster.api + "/v1/completions", json=body, timeout=REQUEST_BOUND_S)
            latencies_s.append(time.monotonic() - start)
            if answer.status_code == 200:
                assert answer.json()["choices"][0]["token_ids"] == tokens
                outcomes.append("ok")
            else:
                assert answer.status_code >= 500 and "error" in answer.json(), answer.text
                outcomes.append(str(answer.status_code))
    return outcomes, latencies_s


def test_50ms_delay_on_a_workers_link_keeps_greedy_tokens(tmp_path: Path) -> None:
    """PD serving spread over five hosts (as test_cluster.py); after a baseline round, the
    decode worker's link gets 50 ms each way: every request still ends with the right tokens
    or a clear error within REQUEST_BOUND_S, at least one succeeds, and each pays the delay."""
    from tsukimi.engine.model import generate_greedy_reference
    from tsukimi.engine.weights import random_tiny

    model = random_tiny(0).model
    prompts = [list(range(5 + i, 5 + i + 70)) for i in range(4)]  # 4 full blocks of 16 each through the pool
    expected = [list(generate_greedy_reference(model, prompt, NEW_TOKENS)) for prompt in prompts]
    ports = itertools.count(20000)
    groups = plan(load(ClusterConfig, None, ['model="tiny"']), port=lambda: next(ports))
    with Lab(Topology.of("m", "p", "d", "r", "client")) as lab:
        placed = place(lab, groups, PD_PLACEMENT)
        cluster = launch(lab, placed, LaunchConfig(tmp_path, startup_timeout_s=120), control="client")
        try:
            base_outcomes, base_s = _serve(lab, cluster, prompts, expected)
            lab.set_link("d", 0, delay="50ms")
            outcomes, latencies_s = _serve(lab, cluster, prompts, expected)
        finally:
            cluster.stop()
    print(
        f"\n50 ms delay on the decode link: {outcomes}, median {statistics.median(latencies_s):.2f} s,"
        f" slowest {max(latencies_s):.2f} s; before the delay: {base_outcomes},"
        f" median {statistics.median(base_s):.2f} s, slowest {max(base_s):.2f} s"
    )
    assert "ok" in outcomes, outcomes
    assert min(latencies_s) >= 0.1, "a request crossed the decode link without its 2 x 50 ms round trip"
