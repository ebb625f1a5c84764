"""The disaggregated hand-off across real processes: a prefill worker process computes the
prompt and writes its KV blocks to the store, a decode worker in another process loads them
and generates; the tokens equal a colocated greedy run, for several prompts, including ones
whose prefix the pool already holds."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
import torch

from tsukimi.engine.model import generate_greedy_reference
from tsukimi.engine.weights import random_tiny
from tsukimi.testing.deployments import TsukimiCluster
from tsukimi.testing.workers import launched_workers, pd_configs

SHARED = list(range(300, 340))  # 40 tokens: 2 full 16-token blocks
PROMPTS = [[1, *SHARED, 5, 6, 7], [1, *SHARED, 8, 9], [1, 2, 3], [1, *SHARED, *range(500, 540)]]
NEW = 8


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    with TsukimiCluster(16 << 20, num_holders=0) as store:
        configs = pd_configs(store.master_addr, 16 << 20)
        with launched_workers(configs, tmp_path_factory.mktemp("workers")) as urls:
            yield urls


def _generate(url: str, request_id: str, prompt: list[int], max_tokens: int) -> list[dict[str, object]]:
    body = {
        "request_id": request_id,
        "prompt_ids": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": None,
        "stop_token_ids": [],
        "ignore_eos": True,
    }
    with httpx.stream("POST", url + "/generate", json=body, timeout=60) as response:
        assert response.status_code == 200
        return [json.loads(line) for line in response.iter_lines() if line]


@pytest.mark.timeout(120)
def test_prefill_process_to_pool_to_decode_process_equals_colocated(workers: dict[str, str]) -> None:
    torch.set_num_threads(1)
    model = random_tiny(0).model
    for n, prompt in enumerate(PROMPTS):
        expected = list(generate_greedy_reference(model, prompt, NEW))
        first = _generate(workers["prefill"], f"p{n}", prompt, NEW)  # a prefill worker gives one token
        assert [t for line in first for t in line["token_ids"]] == expected[:1]  # type: ignore[attr-defined]
        rest = _generate(workers["decode"], f"d{n}", prompt + expected[:1], NEW - 1)
        assert [t for line in rest for t in line["token_ids"]] == expected[1:]  # type: ignore[attr-defined]
        reuse = (rest[0]["cached_tokens"], rest[0]["pool_tokens"])
        # prompt 0: its 2 full blocks come from the pool; prompt 1: the decode worker has them
        # itself now; prompt 3: 2 blocks its own, 3 more that the prefill worker just published
        assert reuse == [(32, 32), (32, 0), (0, 0), (80, 48)][n]
