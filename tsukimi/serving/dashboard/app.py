"""The router's live dashboard: a page at /dashboard, fed by a JSON snapshot and an event stream.

    GET /dashboard                 the page (tsukimi/serving/dashboard/static/dashboard.html; uPlot charts,
                                   shipped in the package: no network needed)
    GET /dashboard/static/NAME     its scripts and styles
    GET /dashboard/api/snapshot    the newest `Snapshot` (JSON), with the whole latency series
    GET /dashboard/api/events      server-sent events: one `snapshot` event per interval (the
                                   series holds its newest EVENT_POINTS only: a viewer that
                                   reconnected between two events misses no chart point)

One sampler task per router builds the snapshot once per `interval_s` from state the router
already keeps (snapshot.py) and encodes it once; every viewer gets the same bytes.
The store probe runs in a task of its own (a slow master never delays a tick). Nothing runs on
the request path but the histograms' deque appends (series.py).

NOTE: uvicorn waits for open responses before it stops, and an event stream never ends by
itself: each stream ends after `stream_s` and the browser's EventSource reconnects (`retry`),
so a router with a dashboard open still stops within `stream_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import msgspec
from fastapi import FastAPI, Response
from fastapi.responses import FileResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from tsukimi.serving.dashboard.series import Series
from tsukimi.serving.dashboard.snapshot import Latency, Snapshot, read_counters, totals, worker_rows
from tsukimi.serving.dashboard.store_probe import StoreProbe, StoreView
from tsukimi.serving.openai.app import OpenAIServer

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).with_name("static")
EVENT_POINTS = 5  # the chart points each event carries
RETRY_MS = 250  # how soon a browser reconnects after a stream ends


@dataclass(frozen=True, slots=True)
class DashboardConfig:
    """interval_s: one snapshot per interval; store_interval_s: how often the master is asked;
    stream_s: how long one event stream lasts (see the module); decisions: how many are shown."""

    interval_s: float = 1.0
    store_interval_s: float = 2.0
    stream_s: float = 3.0
    decisions: int = 20


class Dashboard:
    """The sampler and its latest snapshot, shared by every viewer (see the module).

    Args:
        server: the router's API (its router, metrics and model name).
        probe: asks the store master (None: the store view stays empty).
        config: intervals.
    """

    def __init__(
        self, server: OpenAIServer, probe: StoreProbe | None = None, config: DashboardConfig | None = None
    ) -> None:
        self.config = config or DashboardConfig()
        self._server, self._probe = server, probe
        self._series = Series(window=max(1, round(10 / self.config.interval_s)))
        self._store = StoreView(probe.address if probe is not None else "")
        self._seq = 0
        self._latest: Snapshot | None = None
        self._event = b""
        self._full: tuple[int, bytes] = (-1, b"")
        self._tick: asyncio.Event | None = None
        self._sampler: asyncio.Task[None] | None = None
        self._prober: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Starts the sampler and the store probe unless running (again, should one have died);
        idempotent (mutates)."""
        if self._sampler is None or self._sampler.done():
            self._tick = asyncio.Event()
            self._sample()
            self._sampler = asyncio.create_task(self._every(self.config.interval_s, self._sample), name="dashboard")
        if self._probe is not None and (self._prober is None or self._prober.done()):
            self._prober = asyncio.create_task(self._probe_loop(self._probe), name="dashboard-store")

    async def aclose(self) -> None:
        """Stops the tasks and closes the probe (idempotent; mutates)."""
        for task in (self._sampler, self._prober):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._sampler = self._prober = None
        if self._probe is not None:
            await self._probe.aclose()

    def snapshot(self) -> bytes:
        """The newest snapshot as JSON, with the whole series (encoded at most once per tick)."""
        self.start()
        if self._full[0] != self._seq:
            assert self._latest is not None
            self._full = (self._seq, msgspec.json.encode(self._latest))
        return self._full[1]

    async def events(self) -> AsyncIterator[bytes]:
        """A server-sent event per snapshot for `stream_s`, then the end (see the module)."""
        self.start()
        yield f"retry: {RETRY_MS}\n\n".encode()
        loop = asyncio.get_running_loop()
        deadline, sent = loop.time() + self.config.stream_s, -1
        while True:
            if sent != self._seq:
                sent = self._seq
                yield self._event
            tick = self._tick
            remaining = deadline - loop.time()
            if tick is None or remaining <= 0:
                return
            try:
                await asyncio.wait_for(tick.wait(), remaining)
            except TimeoutError:
                return

    def _sample(self) -> None:
        """Builds, encodes and publishes one snapshot (mutates; the event loop, ~1 ms)."""
        server, router = self._server, self._server.router
        metrics = server.metrics
        counters = read_counters(metrics.registry)
        summary, rejections = totals(counters)
        ttft, tbt = metrics.ttft.take(), metrics.tbt.take()
        wall_s = time.time()  # NOTE: calendar seconds for the charts' time axis; the Clock is monotonic
        self._series.add(wall_s, ttft, tbt, summary.requests_ok + summary.requests_failed, summary.completion_tokens)
        ttft_window, tbt_window, samples = self._series.window()
        cfg = self.config
        latency = Latency(self._series.window_intervals * cfg.interval_s, samples, ttft_window, tbt_window)
        self._seq, points = self._seq + 1, list(self._series.points)
        snapshot = Snapshot(
            self._seq,
            wall_s,
            router.clock.now(),
            cfg.interval_s,
            router.mode,
            server.model_name,
            worker_rows(router.workers()),
            self._store,
            summary,
            rejections,
            latency,
            points,
            router.decisions.recent(cfg.decisions),
            router.decisions.total,
        )
        self._latest = snapshot
        event = msgspec.structs.replace(snapshot, series=points[-EVENT_POINTS:])
        self._event = b"event: snapshot\ndata: " + msgspec.json.encode(event) + b"\n\n"
        tick, self._tick = self._tick, asyncio.Event()
        if tick is not None:
            tick.set()

    async def _every(self, interval_s: float, step: Callable[[], None]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            step()

    async def _probe_loop(self, probe: StoreProbe) -> None:
        while True:
            self._store = await probe.sample()
            await asyncio.sleep(self.config.store_interval_s)


def mount(app: FastAPI, probe: StoreProbe | None = None, config: DashboardConfig | None = None) -> Dashboard:
    """Adds the dashboard's routes to the router's app (`app.state.server`, from create_app) and
    runs its sampler with the app's lifespan. Mutates `app`; returns the dashboard."""
    server: OpenAIServer = app.state.server
    dashboard = app.state.dashboard = Dashboard(server, probe, config)
    no_cache = {"Cache-Control": "no-store"}

    @app.get("/dashboard")
    async def page() -> FileResponse:
        return FileResponse(STATIC_DIR / "dashboard.html", headers=no_cache)

    @app.get("/dashboard/api/snapshot")
    async def snapshot() -> Response:
        return Response(dashboard.snapshot(), media_type="application/json", headers=no_cache)

    @app.get("/dashboard/api/events")
    async def events() -> StreamingResponse:
        headers = {**no_cache, "X-Accel-Buffering": "no"}
        return StreamingResponse(dashboard.events(), media_type="text/event-stream", headers=headers)

    app.mount("/dashboard/static", StaticFiles(directory=STATIC_DIR), name="dashboard-static")
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[None]:
        context: AbstractAsyncContextManager[None] = inner(a)  # type: ignore[assignment]
        async with context:
            dashboard.start()
            try:
                yield
            finally:
                await dashboard.aclose()

    app.router.lifespan_context = lifespan
    return dashboard
