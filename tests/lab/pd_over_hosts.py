"""PD serving spread over five emulated hosts, for the network-fault tests: `tsukimi up`'s plan
for the tiny model placed as master + metadata on m, prefill on p, decode on d, router on r,
the requests from host "client"; prompts whose KV goes through the pool (4 full blocks each)
with their greedy tokens from the model run in this process."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tsukimi.config import ClusterConfig, load
from tsukimi.lab import Lab, Topology
from tsukimi.lab.cluster import launch, place
from tsukimi.serving.cluster.launcher import LaunchConfig, LaunchedCluster
from tsukimi.serving.cluster.up import plan

PLACEMENT = {"master": "m", "metadata": "m", "prefill": "p", "decode": "d", "router": "r"}
NEW_TOKENS = 8


@dataclass(frozen=True, slots=True)
class PdOverHosts:
    lab: Lab
    cluster: LaunchedCluster
    prompts: list[list[int]]
    expected: list[list[int]]  # each prompt's greedy tokens, one process

    def serve(self, bound_s: float) -> tuple[list[str], list[float]]:
        """Each prompt once, from host "client": (per prompt "ok" or the status, its latency s).
        Asserts that an answer is the expected tokens or a 5xx with an error body."""
        outcomes: list[str] = []
        latencies_s: list[float] = []
        with self.lab.entered("client"):
            for prompt, tokens in zip(self.prompts, self.expected, strict=True):
                body = {"model": "tiny", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
                body |= {"ignore_eos": True, "return_token_ids": True}
                start = time.monotonic()
                answer = httpx.post(self.cluster.api + "/v1/completions", json=body, timeout=bound_s)
                latencies_s.append(time.monotonic() - start)
                if answer.status_code == 200:
                    assert answer.json()["choices"][0]["token_ids"] == tokens
                    outcomes.append("ok")
                else:
                    assert answer.status_code >= 500 and "error" in answer.json(), answer.text
                    outcomes.append(str(answer.status_code))
        return outcomes, latencies_s


@contextmanager
def pd_over_hosts(log_dir: Path, requests: int = 4) -> Iterator[PdOverHosts]:
    """The cluster up on its five hosts (and a sixth, "client"); stopped and torn down after."""
    from tsukimi.engine.model import generate_greedy_reference
    from tsukimi.engine.weights import random_tiny

    model = random_tiny(0).model
    prompts = [list(range(5 + i, 5 + i + 70)) for i in range(requests)]  # 4 full blocks of 16 each
    expected = [list(generate_greedy_reference(model, prompt, NEW_TOKENS)) for prompt in prompts]
    ports = itertools.count(20000)
    groups = plan(load(ClusterConfig, None, ['model="tiny"']), port=lambda: next(ports))
    with Lab(Topology.of("m", "p", "d", "r", "client")) as lab:
        placed = place(lab, groups, PLACEMENT)
        cluster = launch(lab, placed, LaunchConfig(log_dir, startup_timeout_s=120), control="client")
        try:
            yield PdOverHosts(lab, cluster, prompts, expected)
        finally:
            cluster.stop()
