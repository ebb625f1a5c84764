"""/health and /metrics off the router's event loop and out of its process: a port of their own
(`health_port`), served by a small process beside the router (health_sidecar.py) from the
files the router publishes.

Everything else the router does runs on one asyncio loop, and under overload that loop runs
late (`tsukimi bench serve --workload overload`: its lag p99 about 0.3 s at 4x the sustainable
rate on a shared 2-CPU host, the loop busy half of that time relaying streams). A /health asked
on the API's port waits behind it. Threads in the router's process do not escape it either:
a full garbage collection holds the GIL throughout (0.1-0.3 s over the objects of a few hundred
requests in flight). So the loop publishes what /health shows every `interval_s` (a file
replaced whole: readers never see half of one), a thread renders /metrics every
`metrics_interval_s`, and the sidecar answers from those files:

    GET /health   200 {"status": "ok" | "degraded", "mode", "model", "workers", "loop_lag_ms",
                  "age_ms"}: the API's /health, plus the loop's lag (its `LoopLag` mean) and the
                  snapshot's age; 503 {"status": "stale", ...} once the loop has published
                  nothing for `stale_after_s` (a wedged loop must fail a liveness probe)
    GET /metrics  the router's Prometheus metrics as last rendered

A snapshot costs the loop one `OpenAIServer.health()` and a small file write per `interval_s`
(0.1 s). The files live in a directory of their own (under /dev/shm where there is one), removed
on close; the sidecar stops when the router closes its stdin, or dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec

from tsukimi.serving.openai.app import OpenAIServer
from tsukimi.serving.router import health_sidecar, lifespan
from tsukimi.serving.router.load_shedding import LoopLag
from tsukimi.serving.router.workers import WorkerStatus

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.1
DEFAULT_STALE_AFTER_S = 5.0
DEFAULT_METRICS_INTERVAL_S = 1.0
_STOP_TIMEOUT_S = 5.0
_SHM = Path("/dev/shm")


class HealthPort:
    """The sidecar-served /health and /metrics of `server` (see the module). `publish` runs on
    the loop; `start` / `close` from anywhere.

    Args:
        server: the OpenAI front whose health and metrics are served. lag: the loop's lag.
        host, port: where the sidecar listens (port 0: a free one; `url` says which, once started).
        interval_s: how often the loop publishes. stale_after_s: the snapshot age from which
            /health answers 503. metrics_interval_s: how often /metrics is rendered.
    """

    def __init__(
        self,
        server: OpenAIServer,
        lag: LoopLag,
        host: str,
        port: int,
        interval_s: float = DEFAULT_INTERVAL_S,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        metrics_interval_s: float = DEFAULT_METRICS_INTERVAL_S,
    ) -> None:
        self.server, self.lag, self.host, self.port = server, lag, host, port
        self.interval_s, self.stale_after_s, self.metrics_interval_s = interval_s, stale_after_s, metrics_interval_s
        self.workers: tuple[WorkerStatus, ...] = ()  # as last published: /metrics' gauges
        self.directory: Path | None = None
        self._sidecar: subprocess.Popen[bytes] | None = None
        self._done = threading.Event()
        self._renderer: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Where the sidecar serves (the port it reported, once started)."""
        return f"http://{self.host}:{self.port}"

    def publish(self) -> None:
        """Writes a new /health snapshot (on the loop: it reads the router; a no-op until started)."""
        if self.directory is None:
            return
        health = self.server.health()
        self.workers = tuple(self.server.router.workers())
        body = {**health, "loop_lag_ms": round(self.lag.mean_s * 1e3, 1)}
        _replace(
            self.directory / health_sidecar.HEALTH_FILE, msgspec.json.encode({"at_s": time.monotonic(), "body": body})
        )

    async def publish_forever(self) -> None:
        """Publishes every `interval_s` until cancelled (a task on the router's loop)."""
        while True:
            self.publish()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        """Publishes a first snapshot, starts rendering /metrics and the sidecar, and returns
        once the sidecar listens (mutates; blocks for its start, ~0.1 s).

        Raises:
            OSError: the sidecar could not start (the port is taken: its error is in the message).
        """
        self.directory = Path(tempfile.mkdtemp(prefix="tsukimi-health-", dir=_SHM if _SHM.is_dir() else None))
        self.publish()
        self._render()
        self._done.clear()
        self._renderer = threading.Thread(target=self._render_forever, name="router-metrics-render", daemon=True)
        self._renderer.start()
        args = [str(self.directory), self.host, str(self.port), str(self.stale_after_s)]
        cmd = [sys.executable, "-m", "tsukimi.serving.router.health_sidecar", *args]
        # NOTE: its stderr is ours (the router's log): a pipe nobody reads could fill and block it
        sidecar = self._sidecar = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert sidecar.stdout is not None
        line = sidecar.stdout.readline()  # NOTE: its port once it listens; b"" if it died
        if not line.strip().isdigit():
            self.close()
            raise OSError(f"the health port's process did not start on {self.url} (its error is in this log)")
        self.port = int(line)
        logger.info("/health and /metrics off the router's loop and process on %s", self.url)

    def close(self) -> None:
        """Stops the sidecar and the rendering, and removes the files (idempotent)."""
        self._done.set()
        if self._renderer is not None:
            self._renderer.join()
            self._renderer = None
        sidecar, self._sidecar = self._sidecar, None
        if sidecar is not None:
            assert sidecar.stdin is not None
            sidecar.stdin.close()  # NOTE: its signal to stop
            try:
                sidecar.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                sidecar.kill()
                sidecar.wait()
            if sidecar.stdout is not None:
                sidecar.stdout.close()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def _render(self) -> None:
        if self.directory is not None:
            _replace(self.directory / health_sidecar.METRICS_FILE, self.server.metrics.render(self.workers))

    def _render_forever(self) -> None:
        """Renders /metrics every `metrics_interval_s` (a thread: the registry is thread-safe)."""
        while not self._done.wait(self.metrics_interval_s):
            self._render()


def _replace(path: Path, data: bytes) -> None:
    """Writes `data` to `path` whole: a temporary file renamed over it (readers see the old or the new)."""
    tmp = path.with_name(f".{path.name}.{threading.get_ident()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@contextlib.asynccontextmanager
async def serving(port: HealthPort) -> AsyncIterator[None]:
    """Serves `port` and publishes its snapshots on the running loop while inside (the router
    app's lifespan: tsukimi/serving/router/app.py). Raises OSError as `HealthPort.start`."""
    await asyncio.to_thread(port.start)
    try:
        async with lifespan.running(port.publish_forever(), "router-health-publish"):
            yield
    finally:
        port.close()
