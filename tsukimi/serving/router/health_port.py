"""/health and /metrics off the router's event loop: a small HTTP server on a port of its own
(`health_port`), served by threads, answering from a snapshot the loop publishes.

Everything else the router does runs on one asyncio loop, and under overload that loop runs
late (`tsukimi bench serve --workload overload`: its lag p99 about 0.3 s at 4x the sustainable
rate on a shared 2-CPU host, the loop busy half of that time relaying streams). A /health asked
on the API's port waits behind it. Here the loop publishes what /health and /metrics show every
`interval_s` (a `HealthSnapshot`, swapped in whole: readers never see half of one), and a
`ThreadingHTTPServer` answers from the latest snapshot without touching the loop; it waits for
the GIL at most a switch interval (5 ms) while the loop runs Python, but for the whole of a
garbage collection (the router app freezes its start-up heap so that those stay short:
tsukimi/serving/router/app.py).

    GET /health   200 {"status": "ok" | "degraded", "mode", "model", "workers", "loop_lag_ms",
                  "age_ms"} as the API's /health, plus the loop's lag (its `LoopLag` mean) and the
                  snapshot's age; 503 {"status": "stale", ...} once the loop has published
                  nothing for `stale_after_s` (a wedged loop must fail a liveness probe)
    GET /metrics  the router's Prometheus metrics (its registry is thread-safe), the workers'
                  gauges from the snapshot

A snapshot costs the loop one `OpenAIServer.health()` per `interval_s` (0.1 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST

from tsukimi.serving.openai.app import OpenAIServer
from tsukimi.serving.router.load_shedding import LoopLag
from tsukimi.serving.router.workers import WorkerStatus

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.1
DEFAULT_STALE_AFTER_S = 5.0
_SHUTDOWN_POLL_S = 0.05  # NOTE: how soon serve_forever notices shutdown()


@dataclass(frozen=True, slots=True)
class HealthSnapshot:
    """What the loop last published: the API's /health body, the workers it was made of, the
    loop's mean lag, and when (`time.monotonic()`)."""

    health: dict[str, object]
    workers: tuple[WorkerStatus, ...]
    loop_lag_s: float
    at_s: float


class HealthPort:
    """The thread-served /health and /metrics of `server` (see the module). `publish` runs on
    the loop; `start` / `close` from anywhere.

    Args:
        server: the OpenAI front whose health and metrics are served. lag: the loop's lag.
        host, port: where to listen (port 0: a free one; `url` says which).
        interval_s: how often the loop publishes. stale_after_s: the snapshot age from which
            /health answers 503.
    """

    def __init__(
        self,
        server: OpenAIServer,
        lag: LoopLag,
        host: str,
        port: int,
        interval_s: float = DEFAULT_INTERVAL_S,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
    ) -> None:
        self.server, self.lag, self.interval_s, self.stale_after_s = server, lag, interval_s, stale_after_s
        self.address = (host, port)
        self.snapshot = self._take()
        self._http: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Where it serves (once started: a port 0 is the one the OS gave)."""
        host, port = self._http.server_address[:2] if self._http is not None else self.address
        return f"http://{host!s}:{port}"

    def publish(self) -> None:
        """Takes a new snapshot (on the loop: it reads the router; mutates)."""
        self.snapshot = self._take()

    async def publish_forever(self) -> None:
        """Publishes every `interval_s` until cancelled (a task on the router's loop)."""
        while True:
            self.publish()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        """Binds and serves in a daemon thread (mutates). Raises OSError (the port is taken)."""
        http = self._http = ThreadingHTTPServer(self.address, _handler(self._answer))
        http.daemon_threads = True
        self._thread = threading.Thread(
            target=http.serve_forever, args=(_SHUTDOWN_POLL_S,), name="router-health-port", daemon=True
        )
        self._thread.start()
        logger.info("/health and /metrics off the loop on %s", self.url)

    def close(self) -> None:
        """Stops serving and closes the socket (idempotent)."""
        if self._http is None:
            return
        self._http.shutdown()
        if self._thread is not None:
            self._thread.join()
        self._http.server_close()
        self._http = self._thread = None

    def _take(self) -> HealthSnapshot:
        workers = tuple(self.server.router.workers())
        return HealthSnapshot(self.server.health(), workers, self.lag.mean_s, time.monotonic())

    def _answer(self, path: str) -> tuple[int, str, bytes]:
        """(status, content type, body) for GET `path` (on a server thread; reads the snapshot)."""
        snapshot = self.snapshot  # NOTE: one read: the loop swaps the reference whole
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, self.server.metrics.render(snapshot.workers)
        if path != "/health":
            return 404, "application/json", b'{"error": "not found: this port serves /health and /metrics"}'
        age_s = time.monotonic() - snapshot.at_s
        body = {**snapshot.health, "loop_lag_ms": round(snapshot.loop_lag_s * 1e3, 1), "age_ms": round(age_s * 1e3)}
        if age_s > self.stale_after_s:
            return 503, "application/json", msgspec.json.encode({**body, "status": "stale"})
        return 200, "application/json", msgspec.json.encode(body)


def _handler(answer: Callable[[str], tuple[int, str, bytes]]) -> type[BaseHTTPRequestHandler]:
    """A request handler class answering GET through `answer` (HTTP/1.1, keep-alive)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            status, content_type, body = answer(self.path.split("?", 1)[0])
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            """Silent: a probe every 0.2 s is no news."""

    return Handler


@contextlib.asynccontextmanager
async def serving(port: HealthPort) -> AsyncIterator[None]:
    """Serves `port` and publishes its snapshots on the running loop while inside (the router
    app's lifespan: tsukimi/serving/router/app.py)."""
    port.publish()  # NOTE: fresh before the first probe, even if the loop is busy at once
    task = asyncio.create_task(port.publish_forever(), name="router-health-publish")
    port.start()
    try:
        yield
    finally:
        port.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
