"""A store master failover while a PD cluster serves: `tsukimi up` with `[master] ha = 2` (etcd
and two masters electing a leader; the workers join through etcd://), the leader SIGKILLed while
requests keep coming. Every request succeeds with the tokens it had before the failover (at
most its KV is recomputed), and a new leader is elected (the standby, or the killed master,
which the supervisor restarts, should it win the race for the vacant lease)."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.serving.test_cluster import running, tiny_cluster
from tests.serving.test_update_weights import reference
from tsukimi.engine.tokenizer import load_tokenizer
from tsukimi.testing.processes import wait_until

logger = logging.getLogger(__name__)

MAX_TOKENS = 8
PROMPTS = [list(range(1000 + 50 * i, 1040 + 50 * i)) for i in range(6)]  # two full KV blocks and a part
FRESH = [list(range(5000 + 50 * i, 5040 + 50 * i)) for i in range(8)]  # first sent during the failover


def expected(prompts: list[list[int]]) -> dict[tuple[int, ...], str]:
    """The text a fresh engine of the tiny model generates for each prompt (greedy)."""
    tokenizer = load_tokenizer("tiny")
    return {tuple(p): tokenizer.decode(reference(0, p, MAX_TOKENS)) for p in prompts}


def ha_cluster(tmp_path: Path) -> str:
    return tiny_cluster(tmp_path) + "[master]\nha = 2\n"


def complete(api: str, prompt: list[int]) -> tuple[str, int]:
    """The greedy text for `prompt`, and how many of its prompt tokens had cached KV."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    response = httpx.post(api + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    reply = response.json()
    return reply["choices"][0]["text"], reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def roles(processes: dict[str, dict[str, object]]) -> dict[str, tuple[str, int]]:
    """Each master's role as its /health says ("leader", "standby"; "down") and its term."""
    found = {}
    for name, process in processes.items():
        if process["role"] == "master":
            try:
                health = httpx.get(f"{process['url']}/health", timeout=2).json()
                found[name] = (health["role"], health["term"])
            except httpx.HTTPError:
                found[name] = ("down", 0)
    return found


def leader_term(processes: dict[str, dict[str, object]]) -> int:
    """The term of the master that leads now (0: none does)."""
    return max((term for role, term in roles(processes).values() if role == "leader"), default=0)


@pytest.mark.timeout(180)
def test_a_master_failover_fails_no_request(tmp_path: Path) -> None:
    with running(tmp_path, ha_cluster(tmp_path), timeout_s=90) as state:
        api = str(state["api"])
        processes = {p["name"]: p for p in json.loads((tmp_path / "state").read_text())["processes"]}
        assert sorted(processes) == ["decode-0", "etcd", "master-0", "master-1", "metadata", "prefill-0", "router"]
        wait_until(lambda: sorted(r for r, _ in roles(processes).values()) == ["leader", "standby"], 30)
        texts = expected(PROMPTS + FRESH)
        assert [complete(api, prompt)[0] for prompt in PROMPTS] == [texts[tuple(p)] for p in PROMPTS]
        cached_before = [complete(api, prompt)[1] for prompt in PROMPTS]
        [(leader, (_, term))] = [(n, r) for n, r in roles(processes).items() if r[0] == "leader"]
        os.kill(int(processes[leader]["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
        killed, results, elected = time.monotonic(), list[tuple[list[int], int, float]](), 0.0
        order = [p for pair in zip(FRESH, PROMPTS + PROMPTS, strict=False) for p in pair]
        while time.monotonic() - killed < 8 or len(results) < len(order) or not elected:
            prompt = order[len(results)] if len(results) < len(order) else PROMPTS[len(results) % len(PROMPTS)]
            sent = time.monotonic()
            text, cached = complete(api, prompt)
            assert text == texts[tuple(prompt)]
            results.append((prompt, cached, time.monotonic() - sent))
            if not elected and leader_term(processes) > term:
                elected = time.monotonic() - killed
            assert time.monotonic() - killed < 60, "no new leader"
        recomputed = sum(p in PROMPTS and cached < cached_before[PROMPTS.index(p)] for p, cached, _ in results)
        logger.warning(
            "failover: a new leader within %.2f s; %d requests, all served; slowest %.2f s; %d with "
            "less cached KV than before",
            elected,
            len(results),
            max(r[2] for r in results),
            recomputed,
        )
