"""How a backend's HTTP calls to a worker fail, the same for every backend
(tsukimi/serving/router/backend.py): one mapping of httpx's failures onto the router's errors,
and the connect retry.

    stream (POST, read as it comes)
        connect timed out   tried again, `CONNECT_TRIES` in all (`CONNECT`): nothing reached the
                            worker, and under overload it is mostly the router's own event loop
                            that was late; then WorkerUnavailable (the polls decide if it is down)
        connect refused     WorkerUnavailable, and the worker is marked down at once
        read timed out      WorkerError (it stalled)
        connection broken   WorkerError, and the worker is marked down (it died?) until a poll answers
        anything else       WorkerError
    probe (GET /health, /load, /metrics)
        timed out           RpcTimeout (late: tsukimi/serving/router/liveness.py counts misses)
        anything else       WorkerError

Pure functions but for the handle's `healthy` flag and the sends.
"""

from __future__ import annotations

import logging

import httpx

from tsukimi.clock import Clock
from tsukimi.errors import RpcTimeout, TsukimiError, WorkerError, WorkerUnavailable
from tsukimi.retry import Retry
from tsukimi.serving.router.workers import WorkerHandle

logger = logging.getLogger(__name__)

CONNECT_TRIES = 3  # connects that time out before a request gives up on a worker
CONNECT = Retry(attempts=CONNECT_TRIES, on=(httpx.ConnectTimeout,))


async def open_stream(
    http: httpx.AsyncClient, built: httpx.Request, worker: WorkerHandle, clock: Clock
) -> httpx.Response:
    """Sends `built` and returns its response, streaming; a connect that timed out is tried
    again (`CONNECT`). Raises httpx's errors (`stream_error` maps them)."""
    attempts = CONNECT.start(clock)
    while True:
        try:
            return await http.send(built, stream=True)
        except httpx.ConnectTimeout as exc:
            if not await attempts.wait_async(exc):
                raise
            logger.info(
                "worker %s did not accept in time; trying again (%d/%d)",
                worker.spec.name,
                attempts.failures,
                CONNECT_TRIES,
            )


def stream_error(worker: WorkerHandle, exc: httpx.HTTPError, read_timeout_s: float) -> TsukimiError:
    """The router's error for a stream to `worker` that failed with `exc` (see the module);
    marks the worker down when it refused or broke the connection."""
    name, url = worker.spec.name, worker.spec.url
    if isinstance(exc, httpx.ConnectTimeout):  # NOTE: maybe our own loop lagging: the polls decide
        return WorkerUnavailable(f"worker {name} at {url} did not accept in time ({CONNECT_TRIES} tries): {exc}")
    if isinstance(exc, httpx.ConnectError):
        worker.healthy = False
        return WorkerUnavailable(f"worker {name} at {url} is unreachable: {exc}")
    if isinstance(exc, httpx.TimeoutException):
        return WorkerError(f"worker {name} did not answer within {read_timeout_s} s")
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
        worker.healthy = False  # NOTE: it broke the connection (it died?): down until a poll answers
    return WorkerError(f"worker {name} failed: {exc!r}")


async def probe(http: httpx.AsyncClient, worker: WorkerHandle, path: str, timeout_s: float) -> httpx.Response:
    """GET `path` of `worker` within `timeout_s`: its 2xx response.

    Raises:
        RpcTimeout: it answered too late. WorkerError: anything else.
    """
    try:
        response = await http.get(f"{worker.spec.url}{path}", timeout=timeout_s)
        response.raise_for_status()
    except httpx.TimeoutException as exc:
        raise RpcTimeout(f"worker {worker.spec.name} did not answer {path} within {timeout_s} s") from exc
    except httpx.HTTPError as exc:
        raise WorkerError(f"worker {worker.spec.name} failed {path}: {exc!r}") from exc
    return response
