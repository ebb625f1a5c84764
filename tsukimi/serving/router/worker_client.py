"""The router's side of the workers' internal HTTP API (tsukimi/serving/protocol.py): what a
worker is (`WorkerSpec`) and how the router sees it (`WorkerHandle`), and `WorkerClient`,
which makes every call to the workers over one `httpx.AsyncClient`:

    stream    POST /generate (GenerateRequest) -> TokenChunk, ...  (the last has a finish_reason)
    refresh   GET /health (role, block_tokens, cost profile; when discovering) + GET /load -> handle up or down
    discover  refresh every worker until all answer or startup_timeout_s passes (a Retry)
    poll      refresh every worker every poll_interval_s, for ever

An error a worker reports arrives as (code, message) and is raised here as the same class
(`protocol.raise_error`). Every call has connect and read timeouts: a worker that cannot be
reached raises `WorkerUnavailable` (HTTP 503), one that fails, stalls or answers garbage
`WorkerError` (502), so a request never hangs on a dead worker. A worker is marked down at once
when it refuses the connection or breaks it mid-stream (killed), but only after
`DOWN_AFTER_MISSES` polls in a row that timed out: under overload the router's own event loop
lags, and one late answer marked every worker down at the same moment (503 bursts, found by
`tsukimi bench serve --workload overload`). A worker marked down is marked up again as soon as
it answers a poll (a restarted one: tsukimi/serving/cluster/supervisor.py).

Runs on one asyncio event loop (the handles are plain mutable records).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass

import httpx
import msgspec

from tsukimi import httpd
from tsukimi.clock import Clock
from tsukimi.errors import ConfigError, WorkerError, WorkerUnavailable
from tsukimi.retry import Retry
from tsukimi.serving.protocol import (
    ROLES,
    CostProfile,
    CppHealth,
    GenerateRequest,
    Health,
    Load,
    Role,
    TokenChunk,
    UpdateWeightsReply,
    UpdateWeightsRequest,
    from_reply,
    raise_error,
)

logger = logging.getLogger(__name__)

POOL = "pool"  # the KV pool's instance name in the router's prefix index: no worker may take it
_DISCOVER_BACKOFF_S = 0.05
DOWN_AFTER_MISSES = 3  # polls in a row that timed out before a worker is marked down
CONNECT_TRIES = 3  # connects to /generate that time out before a request gives up on a worker


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """A worker as declared: its name, role and base URL (http://host:port)."""

    name: str
    role: Role
    url: str

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or self.name == POOL:
            raise ConfigError(f"a worker name must be non-empty, without '/', and not {POOL!r}: {self.name!r}")
        if self.role not in ROLES:
            raise ConfigError(f"worker {self.name}: role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"worker {self.name}: the URL must start with http:// or https://, got {self.url!r}")


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """A snapshot of one worker for /health and /metrics. requests: how many this router has
    sent there (streams opened); cpp_stages: a CPP prefill group's stages (0: one worker);
    free_blocks / total_blocks: its KV cache blocks as last polled (0: not reported)."""

    name: str
    role: Role
    healthy: bool
    waiting: int
    running: int
    in_flight: int
    requests: int = 0
    cpp_stages: int = 0
    free_blocks: int = 0
    total_blocks: int = 0


@dataclass(slots=True)
class WorkerHandle:
    """The router's view of one worker: health, load and block_tokens as last seen, and the
    requests this router has in flight there and has sent there in all (mutated by
    `WorkerClient` and the router); `cpp`: what a CPP prefill group's head reported (None: an
    ordinary worker, or not heard from at discovery)."""

    spec: WorkerSpec
    healthy: bool = True
    load: Load = dataclasses.field(default_factory=lambda: Load(0, 0))
    block_tokens: int = 0
    in_flight: int = 0
    kv_events_ports: tuple[int, int] = (0, 0)  # its KV events' PUB and snapshot ports (0: none)
    requests: int = 0
    cpp: CppHealth | None = None
    misses: int = 0  # polls in a row that timed out
    cost: CostProfile | None = None  # its start-up profile (None: none reported)

    def status(self) -> WorkerStatus:
        """The snapshot (pure)."""
        s, stages = self.spec, self.cpp.stages if self.cpp is not None else 0
        load = self.load
        return WorkerStatus(
            s.name,
            s.role,
            self.healthy,
            load.waiting,
            load.running,
            self.in_flight,
            self.requests,
            stages,
            load.free_blocks,
            load.total_blocks,
        )


class WorkerClient:
    """Every HTTP call to the workers, over one connection pool (see the module).

    Args:
        clock: bounds discovery.
        connect_timeout_s / read_timeout_s: per call; /health and /load also wait at most
            twice `poll_interval_s`.
        poll_interval_s: how often `poll_forever` refreshes the workers.
    """

    def __init__(self, clock: Clock, connect_timeout_s: float, read_timeout_s: float, poll_interval_s: float) -> None:
        self._clock, self._read_timeout_s, self._poll_interval_s = clock, read_timeout_s, poll_interval_s
        # NOTE: at least 0.5 s: a busy worker answered /load in over 0.1 s (2 polls of 50 ms) and
        # was marked down mid-request, failing it (test_real_workers_pd_matches_colocated in CI)
        self._probe_timeout_s = min(connect_timeout_s, max(0.5, 2 * poll_interval_s))
        timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self._http = httpx.AsyncClient(timeout=timeout, limits=limits)

    async def aclose(self) -> None:
        """Closes the connections (idempotent)."""
        await self._http.aclose()

    async def stream(self, worker: WorkerHandle, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        """POST /generate and parse its NDJSON lines until one has a finish reason.

        Raises (from the iterator): the error the worker reported, as its class (e.g.
            InvalidArgument 400, DuplicateRequest 409); WorkerUnavailable: it cannot be
            reached (and is marked down) or answered 503; WorkerError: anything else.
        """
        name = worker.spec.name
        try:
            response = await self._send(worker, request)
            try:
                if response.status_code != 200:
                    raise raise_error(response.status_code, await response.aread(), name)
                async for text in response.aiter_lines():
                    if not text.strip():
                        continue
                    try:
                        chunk = msgspec.json.decode(text, type=TokenChunk)
                    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
                        raise WorkerError(f"worker {name} sent a malformed line: {exc}") from exc
                    if chunk.error is not None:
                        raise from_reply(chunk.error, name)
                    yield chunk
                    if chunk.finish_reason is not None:
                        return
                raise WorkerError(f"worker {name} ended the stream before the request finished")
            finally:
                await response.aclose()
        except httpx.ConnectTimeout as exc:  # NOTE: maybe our own loop lagging: the polls decide
            raise WorkerUnavailable(
                f"worker {name} at {worker.spec.url} did not accept in time ({CONNECT_TRIES} tries): {exc}"
            ) from exc
        except httpx.ConnectError as exc:
            worker.healthy = False
            raise WorkerUnavailable(f"worker {name} at {worker.spec.url} is unreachable: {exc}") from exc
        except httpx.TimeoutException as exc:
            raise WorkerError(f"worker {name} did not answer within {self._read_timeout_s} s") from exc
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            worker.healthy = False  # NOTE: it broke the connection (it died?): down until a poll answers
            raise WorkerError(f"worker {name} failed: {exc!r}") from exc
        except httpx.HTTPError as exc:
            raise WorkerError(f"worker {name} failed: {exc!r}") from exc

    async def _send(self, worker: WorkerHandle, request: GenerateRequest) -> httpx.Response:
        """POST /generate; its response, streaming. A connect that timed out is tried again,
        `CONNECT_TRIES` times in all: nothing reached the worker, so a retry is safe, and under
        overload it is mostly this router's own event loop that was late."""
        built = self._http.build_request("POST", f"{worker.spec.url}/generate", content=msgspec.json.encode(request))
        for attempt in range(1, CONNECT_TRIES + 1):
            try:
                return await self._http.send(built, stream=True)
            except httpx.ConnectTimeout:
                if attempt == CONNECT_TRIES:
                    raise
                logger.info(
                    "worker %s did not accept in time; trying again (%d/%d)", worker.spec.name, attempt, CONNECT_TRIES
                )
        raise AssertionError("unreachable")

    async def update_weights(
        self, worker: WorkerHandle, request: UpdateWeightsRequest, secret: bytes | None
    ) -> UpdateWeightsReply:
        """POST /admin/update_weights (signed with `secret`), waiting for the drain too.

        Raises:
            the error the worker reported, as its class; WorkerUnavailable: unreachable;
            WorkerError: anything else.
        """
        name = worker.spec.name
        timeout = httpx.Timeout(self._read_timeout_s + request.drain_timeout_s, connect=self._probe_timeout_s)
        built = self._http.build_request(
            "POST", f"{worker.spec.url}/admin/update_weights", content=msgspec.json.encode(request), timeout=timeout
        )
        try:
            response = await self._http.send(httpd.sign_request(built, secret))
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise WorkerUnavailable(f"worker {name} at {worker.spec.url} is unreachable: {exc}") from exc
        except httpx.HTTPError as exc:
            raise WorkerError(f"worker {name} failed to update its weights: {exc!r}") from exc
        if response.status_code != 200:
            raise raise_error(response.status_code, response.content, name)
        try:
            return msgspec.json.decode(response.content, type=UpdateWeightsReply)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise WorkerError(f"worker {name} answered the weight update with garbage: {exc}") from exc

    async def discover(self, workers: Sequence[WorkerHandle], timeout_s: float) -> None:
        """Refreshes with /health until every worker answered or `timeout_s` passed; those still
        silent stay marked down (mutates). Raises ConfigError on a role mismatch."""
        attempts = Retry(attempts=None, deadline_s=timeout_s, backoff_s=_DISCOVER_BACKOFF_S).start(self._clock)
        pending = list(workers)
        while True:
            answered = await asyncio.gather(*(self.refresh(w, health=True) for w in pending))
            pending = [w for w, ok in zip(pending, answered, strict=True) if not ok]
            if not pending or not await attempts.wait_async():
                break
        if pending:
            for worker in pending:
                worker.healthy = False
            names = ", ".join(w.spec.name for w in pending)
            logger.warning("workers %s did not answer within %s s; marked down", names, timeout_s)

    async def refresh(self, worker: WorkerHandle, health: bool = False) -> bool:
        """GET /load (after /health, whose role must match, when `health` or the worker was
        down); marks the worker up
        or down (mutates). Returns whether it answered. Raises ConfigError on a role mismatch."""
        health = health or not worker.healthy  # NOTE: one back up may have restarted (new KV event ports)
        try:
            info = msgspec.json.decode(await self._get(worker, "/health"), type=Health) if health else None
            load = msgspec.json.decode(await self._get(worker, "/load"), type=Load)
        except (httpx.HTTPError, msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
            worker.misses += 1
            late = isinstance(exc, httpx.TimeoutException) and worker.misses < DOWN_AFTER_MISSES
            if worker.healthy and not late:
                logger.warning("worker %s is down: %r", worker.spec.name, exc)
                worker.healthy = False
            return False
        if info is not None and info.role != worker.spec.role:
            raise ConfigError(f"worker {worker.spec.name} is declared {worker.spec.role} but reports {info.role}")
        if not worker.healthy:
            logger.info("worker %s is up", worker.spec.name)
        if info is not None:
            worker.block_tokens = info.block_tokens
            worker.kv_events_ports = (info.kv_events_port, info.kv_snapshot_port)
            worker.cpp, worker.cost = info.cpp, info.cost
        worker.load, worker.healthy, worker.misses = load, True, 0
        return True

    async def poll_forever(self, workers: Sequence[WorkerHandle], on_poll: Callable[[], None] | None = None) -> None:
        """Refreshes every worker every `poll_interval_s` until cancelled, calling `on_poll`
        after each round (mutates)."""
        while True:
            await asyncio.sleep(self._poll_interval_s)
            await asyncio.gather(*(self.refresh(w) for w in workers))
            if on_poll is not None:
                on_poll()

    async def _get(self, worker: WorkerHandle, path: str) -> bytes:
        response = await self._http.get(f"{worker.spec.url}{path}", timeout=self._probe_timeout_s)
        response.raise_for_status()
        return response.content
