"""One bad request fails only itself: a real `tsukimi worker` process (colocated, the tiny
model) whose engine fails every step that schedules a prompt holding POISON (the test setting
TSUKIMI_TEST_FAULT_TOKEN), with three greedy requests streaming when the bad one arrives. The
bad one ends with an error line; the others go on and produce exactly the tokens of a plain
engine; the worker serves on."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.serving.test_worker import PROMPT, reference
from tsukimi.engine.weights import LoadedModel, load_model
from tsukimi.netio import free_port
from tsukimi.serving.worker.engine_thread import FAULT_TOKEN_ENV
from tsukimi.testing.processes import wait_until

POISON = 31999
MAX_TOKENS = 64
GOOD = [PROMPT, list(range(200, 230)), list(range(5000, 5021))]


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A colocated worker process with the fault injection on; its base URL and log."""
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "tsukimi.cli",
        "worker",
        "--name",
        "colo",
        "--role",
        "colocated",
        "--model",
        "tiny",
        "--port",
        str(port),
        "--num-blocks",
        "256",
        "--block-tokens",
        "16",
    ]
    env = {**os.environ, FAULT_TOKEN_ENV: str(POISON)}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: proc.poll() is not None or httpx.get(url + "/health", timeout=2).status_code == 200, 60)
        assert proc.poll() is None, log.read_text()
        yield url, log
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


async def stream(
    client: httpx.AsyncClient, rid: str, prompt: list[int], started: asyncio.Event
) -> list[dict[str, object]]:
    payload = {"request_id": rid, "prompt_ids": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    lines: list[dict[str, object]] = []
    async with client.stream("POST", "/generate", json=payload) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line:
                lines.append(json.loads(line))
                started.set()
    return lines


def tokens(lines: list[dict[str, object]]) -> list[int]:
    return [t for line in lines for t in line["token_ids"]]  # type: ignore[attr-defined]


@pytest.mark.timeout(120)
def test_a_request_failing_the_engine_step_fails_alone(worker: tuple[str, Path], tiny: LoadedModel) -> None:
    url, log = worker

    async def run() -> tuple[list[list[dict[str, object]]], list[dict[str, object]]]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            started = [asyncio.Event() for _ in GOOD]
            good = [
                asyncio.create_task(stream(client, f"good-{i}", p, e))
                for i, (p, e) in enumerate(zip(GOOD, started, strict=True))
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
            bad = await stream(client, "bad", [1, 2, POISON, 3], asyncio.Event())
            return list(await asyncio.gather(*good)), bad

    good, bad = asyncio.run(run())
    assert bad[-1]["finish_reason"] is None
    error = bad[-1]["error"]
    assert isinstance(error, dict) and error["code"] == "worker_error"
    assert error["message"].startswith("the engine failed on this request: InjectedFault")
    assert [tokens(lines) for lines in good] == [reference(tiny, p, MAX_TOKENS) for p in GOOD]
    assert all(lines[-1]["finish_reason"] == "length" for lines in good)
    again = asyncio.run(_one(url))
    assert tokens(again) == reference(tiny, PROMPT, MAX_TOKENS)
    assert "1 requests failed the engine, 3 go on" in log.read_text()  # they were running meanwhile


async def _one(url: str) -> list[dict[str, object]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await stream(client, "after", PROMPT, asyncio.Event())
