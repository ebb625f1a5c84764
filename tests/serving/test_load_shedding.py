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
    shed: list[int] = []

    @app.post("/v1/completions")
    async def complete() -> dict[str, str]:
        return {"ok": "yes"}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    lag = install(app, threshold_s=0.1, on_shed=lambda: shed.append(1))

    async def ask() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            return [await client.post("/v1/completions", json={}), await client.get("/health")]

    calm = asyncio.run(ask())
    assert [r.status_code for r in calm] == [200, 200] and not shed
    for _ in range(40):
        lag.observe(0.5)
    busy, ok = asyncio.run(ask())
    assert busy.status_code == 429 and busy.headers["retry-after"] == "1" and shed == [1]
    error = busy.json()["error"]
    assert error["code"] == "overloaded" and error["type"] == "rate_limit_error" and "behind" in error["message"]
    assert ok.status_code == 200
    off = FastAPI()
    off_lag = install(off, threshold_s=0.0)
    off_lag.observe(10.0)
    assert off.state.loop_lag is off_lag  # NOTE: measured even when shedding is off
