"""The router's front under a busy loop: /health and /metrics on the thread-served health port
(tsukimi/serving/router/health_port.py) answer while the event loop is blocked, and say
"stale" once the loop stops publishing; each completion's admission latency reaches its
decision record and the admission metric (tsukimi/serving/router/arrivals.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.serving.fakes import FakeWorker, router_app
from tsukimi import httpd
from tsukimi.serving.router import health_port
from tsukimi.serving.router.health_port import HealthPort


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[httpd.AppHandle, HealthPort]]:
    """The router app over one fake worker, and its health port (port 0: a free one), not yet serving."""
    fake = FakeWorker("w")
    app = router_app(fake.spec)
    handle = httpd.start_in_thread(app)
    try:
        yield handle, HealthPort(app.state.server, app.state.loop_lag, "127.0.0.1", 0)
    finally:
        handle.stop(2.0)
        fake.close()


def test_each_completion_records_its_admission_latency(served: tuple[httpd.AppHandle, HealthPort]) -> None:
    """The router starts here (its first request): the tests below see its worker up."""
    handle, _ = served
    given = httpx.post(
        f"{handle.base_url}/v1/completions", json={"prompt": [5], "max_tokens": 2}, headers={"X-Request-Id": "a1"}
    )
    anonymous = httpx.post(f"{handle.base_url}/v1/completions", json={"prompt": [5], "max_tokens": 2})
    assert given.status_code == anonymous.status_code == 200
    ids = ["a1", anonymous.headers["x-request-id"]]
    records = httpx.get(f"{handle.base_url}/decisions", params={"request_id": ids}).json()["decisions"]
    assert [r["request_id"] for r in records] == ids
    assert all(0 <= r["time_s"] - r["arrived_s"] < 5 for r in records)
    metrics = httpx.get(f"{handle.base_url}/metrics").text
    assert "tsukimi_router_admission_seconds_count 2.0" in metrics


def test_health_answers_while_the_event_loop_is_blocked(served: tuple[httpd.AppHandle, HealthPort]) -> None:
    _, port = served

    async def go() -> tuple[httpx.Response, float, httpx.Response]:
        async with health_port.serving(port):
            asked = asyncio.create_task(asyncio.to_thread(_timed_get, f"{port.url}/health"))
            await asyncio.sleep(0)  # NOTE: let the thread start asking
            time.sleep(0.5)  # NOTE: the loop blocked, as by a long step under overload
            health, seconds = await asked
            metrics = await asyncio.to_thread(httpx.get, f"{port.url}/metrics")
        return health, seconds, metrics

    health, seconds, metrics = asyncio.run(go())
    body = health.json()
    assert health.status_code == 200 and seconds < 0.25, seconds
    assert body["status"] == "ok" and [w["name"] for w in body["workers"]] == ["w"] and "loop_lag_ms" in body
    assert metrics.status_code == 200 and 'tsukimi_router_worker_up{role="colocated",worker="w"} 1.0' in metrics.text


def test_a_snapshot_the_loop_stopped_publishing_is_stale(served: tuple[httpd.AppHandle, HealthPort]) -> None:
    _, port = served
    port.start()
    try:
        port.snapshot = dataclasses.replace(port.snapshot, at_s=port.snapshot.at_s - 2 * port.stale_after_s)
        stale = httpx.get(f"{port.url}/health")
        assert (stale.status_code, stale.json()["status"]) == (503, "stale")
        port.publish()
        assert httpx.get(f"{port.url}/health").status_code == 200
        assert httpx.get(f"{port.url}/v1/models").status_code == 404  # NOTE: only /health and /metrics here
    finally:
        port.close()


def _timed_get(url: str) -> tuple[httpx.Response, float]:
    start = time.perf_counter()
    response = httpx.get(url, timeout=5.0)
    return response, time.perf_counter() - start
