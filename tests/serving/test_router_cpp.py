"""The router over a CPP prefill group (FAKE workers, tests/serving/test_router.py): it learns
from /health which prefill worker is a group and builds its Conductor with it, so a long
greedy prompt goes to the group and a short one to the ordinary worker; a sampling request
never goes to a group, and with groups only it is refused with a clear error."""

from __future__ import annotations

import dataclasses

import pytest

from tests.serving.fakes import FAST, FakeWorker, collect, run_with
from tsukimi.config import ROUTER_CONDUCTOR
from tsukimi.errors import InvalidArgument
from tsukimi.scheduler.cpp import CppGroup
from tsukimi.serving.protocol import GenerateRequest
from tsukimi.serving.router.router import Router

GROUP = {"stages": 2, "chunk_tokens": 32, "hop_s_per_token": 1e-6, "hop_latency_s": 1e-3}
LONG, SHORT = list(range(3, 1003)), [5, 6, 7]


def ask(prompt: list[int], rid: str = "r", temperature: float = 0.0) -> GenerateRequest:
    return GenerateRequest(rid, tuple(prompt), 2, temperature)


def cpp_router(workers: list[FakeWorker], ordinary: bool = True) -> Router:
    workers += [FakeWorker("g0", "prefill", cpp=GROUP), FakeWorker("d0", "decode")]
    if ordinary:
        workers.append(FakeWorker("p0", "prefill"))
    return Router([w.spec for w in workers], FAST, dataclasses.replace(ROUTER_CONDUCTOR, rejection="none"))


def test_the_router_builds_its_groups_from_health(workers: list[FakeWorker]) -> None:
    router = cpp_router(workers)

    async def body(router: Router) -> None:
        await router.start()

    run_with(router, body)
    assert router.conductor is not None
    assert router.conductor.groups == {"g0": CppGroup(2, 1e-6, 1e-3, chunk_tokens=32)}
    assert {w.name: w.cpp_stages for w in router.workers()} == {"g0": 2, "d0": 0, "p0": 0}


def test_long_greedy_prompts_go_to_the_group_short_and_sampled_ones_do_not(
    workers: list[FakeWorker],
) -> None:
    router = cpp_router(workers)

    async def body(router: Router) -> list[str]:
        placed = []
        for prompt, temperature in ((LONG, 0.0), (SHORT, 0.0), (LONG, 0.7)):
            events = await collect(router, ask(prompt, f"r{len(placed)}", temperature))
            placed.append(events[0].worker)
        return placed

    assert run_with(router, body) == ["g0", "p0", "p0"]
    group, _, ordinary = workers
    assert [len(c["prompt_ids"]) for c in group.calls] == [len(LONG)]  # type: ignore[arg-type]
    assert [c["temperature"] for c in ordinary.calls] == [0.0, 0.7]
    assert {w.name: w.requests for w in router.workers()} == {"g0": 1, "p0": 2, "d0": 3}


def test_sampling_with_groups_only_is_a_clear_error(workers: list[FakeWorker]) -> None:
    router = cpp_router(workers, ordinary=False)

    async def body(router: Router) -> None:
        with pytest.raises(InvalidArgument, match="CPP groups, which serve greedy requests only"):
            await collect(router, ask(LONG, temperature=0.7))
        assert len(await collect(router, ask(LONG, "greedy"))) == 2

    run_with(router, body)
    assert workers[0].calls[0]["request_id"] == "greedy" and len(workers[0].calls) == 1
    assert router.conductor is not None and router.conductor.counters["accepted"] == 1
