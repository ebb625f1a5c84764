"""The disaggregated hand-off across real processes: a prefill worker process computes the
prompt and writes its KV blocks to the store, a decode worker in another process loads them
and generates; the tokens equal a colocated greedy run, for several prompts, including ones
whose prefix the pool already holds."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import IO

import httpx
import pytest
import torch

from tsukimi.engine.model import generate_greedy_reference
from tsukimi.engine.weights import random_tiny
from tsukimi.errors import PeerError
from tsukimi.netio import free_port
from tsukimi.testing.deployments import TsukimiCluster
from tsukimi.testing.processes import stop_processes, wait_until

SHARED = list(range(300, 340))  # 40 tokens: 2 full 16-token blocks
PROMPTS = [[1, *SHARED, 5, 6, 7], [1, *SHARED, 8, 9], [1, 2, 3], [1, *SHARED, *range(500, 540)]]
NEW = 8


@pytest.fixture(scope="module")
def workers() -> Iterator[dict[str, str]]:
    store = TsukimiCluster(16 << 20, num_holders=0)
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[IO[bytes]] = []
    urls = {}
    try:
        for role in ("prefill", "decode"):
            port = free_port()
            cmd = [
                sys.executable,
                "-m",
                "tsukimi.cli",
                "worker",
                "--name",
                role,
                "--role",
                role,
                "--model",
                "tiny",
                "--port",
                str(port),
                "--master",
                store.master_addr,
                "--segment-bytes",
                "16M",
                "--num-blocks",
                "256",
            ]
            logs.append(tempfile.TemporaryFile())  # noqa: SIM115 - closed below
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=logs[-1]))
            urls[role] = f"http://127.0.0.1:{port}"
        for (role, url), log in zip(urls.items(), logs, strict=True):
            try:
                wait_until(lambda u=url: _healthy(u), 60)
            except PeerError as exc:
                log.seek(0)
                tail = log.read()[-3000:].decode(errors="replace")
                raise PeerError(f"the {role} worker did not come up; its stderr ends:\n{tail}") from exc
        yield urls
    finally:
        stop_processes(procs)
        store.close()
        for log in logs:
            log.close()


def _healthy(url: str) -> bool:
    return httpx.get(url + "/health", timeout=1).status_code == 200


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
