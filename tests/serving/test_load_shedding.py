"""Load shedding on the router's event-loop lag (tsukimi/serving/router/load_shedding.py): while the
loop lags, new completions get 429 `overloaded` at once; /health and the rest still answer."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI

from tsukimi.serving.router.load_shedding import LoopLag, install


def test_the_lag_mean_halves_its_distance_to_a_new_level_in_one_half_life() -> None:
    lag = LoopLag(interval_s=0.05, halflife_s=0.5)
    for _ in range(10):  # NOTE: 10 samples of 50 ms = one half-life
        lag.observe(1.0)
    assert abs(lag.mean_s - 0.5) < 1e-9 and lag.max_s == 1.0


def test_a_lagging_loop_sheds_new_completions_only() -> None:
    app = FastAPI()
    shed: list[tuple[str, str]] = []

    @app.post("/v1/completions")
    async def complete() -> dict[str, str]:
        return {"ok": "yes"}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    lag = install(app, threshold_s=0.1, on_shed=lambda rid, rejection: shed.append((rid, rejection.reason)))

    async def ask() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            mine = {"X-Request-Id": "mine"}
            return [await client.post("/v1/completions", json={}, headers=mine), await client.get("/health")]

    calm = asyncio.run(ask())
    assert [r.status_code for r in calm] == [200, 200] and not shed
    for _ in range(40):
        lag.observe(0.5)
    busy, ok = asyncio.run(ask())
    assert busy.status_code == 429 and busy.headers["retry-after"] == "1" and shed == [("mine", "overloaded")]
    assert busy.headers["x-request-id"] == "mine"  # NOTE: every answer to a completion carries its id
    error = busy.json()["error"]
    assert error["code"] == "overloaded" and error["type"] == "rate_limit_error" and "behind" in error["message"]
    assert ok.status_code == 200
    off = FastAPI()
    off_lag = install(off, threshold_s=0.0)
    off_lag.observe(10.0)
    assert off.state.loop_lag is off_lag  # NOTE: measured even when shedding is off


def test_the_routers_app_logs_a_shed_request_as_rejected() -> None:
    """`build_router_app` installs the shedder from `shed_lag_ms`: a shed request is counted
    and logged as rejected "overloaded" under its id (its body unread: 0 prompt tokens)."""
    from tests.serving.fakes import FakeWorker, router_app
    from tsukimi import httpd

    fake = FakeWorker("w")
    app = router_app(fake.spec, shed_lag_ms=100.0)
    handle: httpd.AppHandle = httpd.start_in_thread(app)
    try:
        for _ in range(40):
            app.state.loop_lag.observe(0.5)
        shed = httpx.post(f"{handle.base_url}/v1/completions", json={"prompt": "a"}, headers={"X-Request-Id": "s1"})
        assert (shed.status_code, shed.headers["x-request-id"]) == (429, "s1")
        [record] = httpx.get(f"{handle.base_url}/decisions?request_id=s1").json()["decisions"]
        assert (record["accepted"], record["reason"], record["prompt_tokens"]) == (False, "overloaded", 0)
        assert (
            'tsukimi_router_rejections_total{reason="overloaded"} 1.0' in httpx.get(f"{handle.base_url}/metrics").text
        )
    finally:
        handle.stop(2.0)
        fake.close()
