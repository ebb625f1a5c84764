"""How the router decides a tsukimi worker is down (WorkerClient's probes under `Liveness`): a
refused connection at once, polls that time out only after DOWN_AFTER_MISSES in a row (an
overloaded router's own event loop lags, and one late answer must not mark every worker down),
and an answer marks it up again; a stream's connect that timed out is tried again (`Retry`)."""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import pytest

from tsukimi.clock import WallClock
from tsukimi.errors import WorkerUnavailable
from tsukimi.serving.protocol import GenerateRequest, Health, Load, TokenChunk
from tsukimi.serving.router.liveness import DOWN_AFTER_MISSES, Liveness
from tsukimi.serving.router.worker_client import WorkerClient
from tsukimi.serving.router.worker_http import CONNECT_TRIES
from tsukimi.serving.router.workers import WorkerHandle, WorkerSpec


def _client(outcomes: list[str]) -> WorkerClient:
    """A client whose /load answers follow `outcomes` ("ok", "timeout", "refused")."""

    def handler(request: httpx.Request) -> httpx.Response:
        outcome = outcomes.pop(0)
        if outcome == "timeout":
            raise httpx.ReadTimeout("late", request=request)
        if outcome == "refused":
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200, content=msgspec.json.encode(Health("ok", "decode-0", "decode", block_tokens=16)))
        return httpx.Response(200, content=msgspec.json.encode(Load(1, 2)))

    return WorkerClient(WallClock(), 1.0, 5.0, 0.5, httpx.MockTransport(handler))  # NOTE: no sockets


async def _refreshes(client: WorkerClient, worker: WorkerHandle, n: int) -> list[bool]:
    liveness, healthy = Liveness(client, WallClock(), 0.5), []
    for _ in range(n):
        await liveness.refresh(worker)
        healthy.append(worker.healthy)
    await client.aclose()
    return healthy


def test_late_polls_mark_a_worker_down_only_after_several_in_a_row() -> None:
    worker = WorkerHandle(WorkerSpec("decode-0", "decode", "http://127.0.0.1:1"))
    outcomes = ["timeout"] * (DOWN_AFTER_MISSES - 1) + ["ok"] + ["timeout"] * DOWN_AFTER_MISSES
    healthy = asyncio.run(_refreshes(_client(outcomes), worker, len(outcomes)))
    assert healthy == [True] * DOWN_AFTER_MISSES + [True] * (DOWN_AFTER_MISSES - 1) + [False]
    assert worker.misses == DOWN_AFTER_MISSES


def test_a_refused_connection_marks_a_worker_down_at_once_and_an_answer_up_again() -> None:
    worker = WorkerHandle(WorkerSpec("decode-0", "decode", "http://127.0.0.1:1"))
    assert asyncio.run(_refreshes(_client(["refused"]), worker, 1)) == [False]
    # NOTE: a worker marked down is asked /health (it may have restarted) before /load
    assert asyncio.run(_refreshes(_client(["ok", "ok"]), worker, 1)) == [True]
    assert worker.load == Load(1, 2) and worker.misses == 0 and worker.block_tokens == 16


def _stream_after(late_connects: int) -> tuple[list[TokenChunk], int]:
    """The chunks of a stream whose first `late_connects` connects time out, and the tries made."""
    tries: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        tries.append(1)
        if len(tries) <= late_connects:
            raise httpx.ConnectTimeout("late", request=request)
        chunk = TokenChunk(token_ids=[7], finish_reason="length")
        return httpx.Response(200, content=msgspec.json.encode(chunk) + b"\n")

    async def run() -> list[TokenChunk]:
        client = WorkerClient(WallClock(), 1.0, 5.0, 0.5, httpx.MockTransport(handler))
        worker = WorkerHandle(WorkerSpec("decode-0", "decode", "http://127.0.0.1:1"))
        try:
            return [c.chunk async for c in client.stream(worker, GenerateRequest("r", (1, 2), 1), "decode")]
        finally:
            await client.aclose()
            assert worker.healthy  # NOTE: a late connect leaves the verdict to the polls

    return asyncio.run(run()), len(tries)


def test_a_connect_that_timed_out_is_tried_again_before_the_request_gives_up() -> None:
    chunks, tries = _stream_after(CONNECT_TRIES - 1)
    assert [c.token_ids for c in chunks] == [[7]] and tries == CONNECT_TRIES
    with pytest.raises(WorkerUnavailable, match="did not accept in time"):
        _stream_after(CONNECT_TRIES)
