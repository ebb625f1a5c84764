"""The router's front under a busy loop: /health and /metrics on the health port (a process
beside the router: tsukimi/serving/router/health_port.py, health_sidecar.py) answer while the
event loop is blocked, and say "stale" once the loop stops publishing; each completion's admission latency reaches its
decision record and the admission metric (tsukimi/serving/router/arrivals.py)."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.serving.fakes import FakeWorker, router_app
from tsukimi import httpd
from tsukimi.netio import free_port
from tsukimi.serving.router import health_port, health_sidecar
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
    """The loop blocks (as in a long step or a garbage collection under overload) until the
    health port has answered: it did so with the loop blocked, and /metrics too."""
    _, port = served
    answers: list[httpx.Response] = []
    answered = threading.Event()

    def ask() -> None:
        answers.extend(httpx.get(f"{port.url}/{path}", timeout=5.0) for path in ("health", "metrics"))
        answered.set()

    async def go() -> bool:
        async with health_port.serving(port):
            threading.Thread(target=ask, daemon=True).start()
            return answered.wait(timeout=10.0)  # NOTE: blocks the loop; returns as soon as answered

    assert asyncio.run(go()), "no answer while the loop was blocked"
    health, metrics = answers
    body = health.json()
    assert health.status_code == 200 and body["status"] == "ok" and "loop_lag_ms" in body
    assert [w["name"] for w in body["workers"]] == ["w"]
    assert metrics.status_code == 200 and 'tsukimi_router_worker_up{role="colocated",worker="w"} 1.0' in metrics.text


def test_the_sidecar_answers_from_the_published_files_and_says_stale_when_they_age(tmp_path: Path) -> None:
    """health_sidecar.answer, the sidecar's whole logic: nothing published yet or a snapshot
    older than stale_after_s is 503 "stale" (a wedged loop fails a liveness probe)."""
    assert health_sidecar.answer(tmp_path, "/health", 5.0)[0] == 503
    assert health_sidecar.answer(tmp_path, "/metrics", 5.0)[0] == 503
    snapshot = {"at_s": time.monotonic() - 10.0, "body": {"status": "ok", "workers": []}}
    (tmp_path / health_sidecar.HEALTH_FILE).write_text(json.dumps(snapshot))
    status, _, body = health_sidecar.answer(tmp_path, "/health", 5.0)
    assert (status, json.loads(body)["status"]) == (503, "stale") and json.loads(body)["age_ms"] >= 10_000
    assert health_sidecar.answer(tmp_path, "/health", 60.0)[0] == 200
    (tmp_path / health_sidecar.METRICS_FILE).write_bytes(b"m 1\n")
    assert health_sidecar.answer(tmp_path, "/metrics", 5.0) == (200, health_sidecar.METRICS_TYPE, b"m 1\n")
    assert health_sidecar.answer(tmp_path, "/v1/models", 5.0)[0] == 404  # NOTE: only /health and /metrics there


def test_the_apps_lifespan_serves_the_health_port_and_freezes_the_start_up_heap() -> None:
    """`health_port` set, the router's lifespan serves it; and as a full collection over the
    start-up heap held the GIL for 0.4-0.9 s under overload, the lifespan moves that heap out of
    the collector's way, and back when it stops."""
    fake = FakeWorker("w")
    app = router_app(fake.spec, health_port=free_port())

    async def go() -> tuple[int, int]:
        async with app.router.lifespan_context(app):
            health = await asyncio.to_thread(httpx.get, f"{app.state.health_port.url}/health")
            return health.status_code, gc.get_freeze_count()

    try:
        status, frozen = asyncio.run(go())
        assert status == 200 and frozen > 0 and gc.get_freeze_count() == 0
    finally:
        fake.close()
