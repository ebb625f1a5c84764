"""One bad request fails only itself: a real `tsukimi worker` process (colocated, the tiny
model) whose engine fails every step that schedules a prompt holding POISON (its engine factory
is tests/serving/faulty_engine.py), with three greedy requests streaming when the bad one
arrives. The bad one ends with an error line; the others go on and produce exactly the tokens of
a plain engine; the worker serves on. And a factory that cannot be loaded stops the worker at
start-up, naming the problem."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.serving.faulty_engine import POISON, FaultyEngine
from tests.serving.test_worker import PROMPT, reference
from tsukimi.config import WorkerConfig
from tsukimi.engine.engine import LLMEngine
from tsukimi.engine.weights import LoadedModel
from tsukimi.errors import ConfigError
from tsukimi.netio import free_port
from tsukimi.serving.worker.commands import add_parser, worker_args, worker_config
from tsukimi.serving.worker.engine_factory import load_engine_factory
from tsukimi.testing.workers import launched_workers

CHECKOUT = Path(__file__).resolve().parents[2]  # NOTE: on the worker's path: it imports the factory from tests/
FAULTY = "tests.serving.faulty_engine:FaultyEngine"
MAX_TOKENS = 64
GOOD = [PROMPT, list(range(200, 230)), list(range(5000, 5021))]


PYTHONPATH = {"PYTHONPATH": os.pathsep.join(filter(None, [str(CHECKOUT), os.environ.get("PYTHONPATH")]))}


def colocated(port: int, engine_factory: str) -> WorkerConfig:
    """A colocated tiny worker on `port` whose engines `engine_factory` builds."""
    return WorkerConfig(
        name="colo", role="colocated", model="tiny", port=port, num_blocks=256, engine_factory=engine_factory
    )


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A colocated worker process whose engine is FaultyEngine; its base URL and log."""
    logs = tmp_path_factory.mktemp("worker")
    with launched_workers([colocated(free_port(), FAULTY)], logs, PYTHONPATH) as urls:
        yield urls["colo"], logs / "colo.log"


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


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("factory", "problem"),
    [
        ("tests.serving.nothing_here:Engine", "module tests.serving.nothing_here does not import"),
        ("tests.serving.faulty_engine:Missing", "tests.serving.faulty_engine has no Missing"),
        ("tests.serving.faulty_engine:InjectedFault", "InjectedFault is a class but not an LLMEngine"),
    ],
)
def test_an_engine_factory_that_does_not_load_stops_the_worker(tmp_path: Path, factory: str, problem: str) -> None:
    cmd = [sys.executable, "-m", "tsukimi.cli", *worker_args(colocated(free_port(), factory))]
    done = subprocess.run(cmd, env={**os.environ, **PYTHONPATH}, capture_output=True, text=True, timeout=50)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"worker engine_factory {factory!r}: {problem}" in " ".join(done.stdout.split())


@pytest.mark.parametrize("spec", ["faulty_engine", "tests.serving.faulty_engine:", ":FaultyEngine", "a-b:C", "a:b c"])
def test_an_engine_factory_not_shaped_module_callable_is_a_config_error(spec: str) -> None:
    with pytest.raises(ConfigError, match=r"worker engine_factory must be MODULE:CALLABLE .*, got "):
        WorkerConfig(engine_factory=spec)


def test_the_engine_factory_goes_from_config_to_flags_and_back() -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    config = WorkerConfig(model="tiny", engine_factory=FAULTY)
    assert "--engine-factory" not in worker_args(WorkerConfig())
    assert worker_config(parser.parse_args(list(worker_args(config)))) == config
    assert load_engine_factory("") is LLMEngine
    assert load_engine_factory(FAULTY) is FaultyEngine
