"""The router's side of the workers' internal HTTP API (tsukimi/serving/worker.py): what a
worker is (`WorkerSpec`) and how the router sees it (`WorkerHandle`), what it is asked
(`GenerateRequest`) and what it streams back (`TokenEvent`), and `WorkerClient`, which makes
every call to the workers over one `httpx.AsyncClient`:

    stream    POST /generate -> NDJSON lines -> TokenEvent, ...  (the last has a finish_reason)
    refresh   GET /health (role, block_tokens; when discovering) + GET /load -> handle up or down
    discover  refresh every worker until all answer or startup_timeout_s passes
    poll      refresh every worker every poll_interval_s, for ever

Every call has connect and read timeouts: a worker that cannot be reached raises
`WorkerUnavailable` (HTTP 503) and is marked down, one that fails, stalls or answers garbage
`WorkerError` (502), so a request never hangs on a dead worker. A worker marked down is marked
up again as soon as it answers a poll.

Runs on one asyncio event loop (the handles are plain mutable records).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Literal

import httpx
import msgspec

from tsukimi.clock import Clock
from tsukimi.config import ROLES, Role
from tsukimi.errors import ConfigError, InvalidArgument, TsukimiError, WorkerError, WorkerUnavailable

logger = logging.getLogger(__name__)

FinishReason = Literal["stop", "length"]
POOL = "pool"  # the KV pool's instance name in the router's prefix index: no worker may take it


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
class GenerateRequest:
    """One generation, as the workers' POST /generate takes it."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise InvalidArgument("the prompt must hold at least one token")
        if self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1, got {self.max_tokens}")

    def body(self, prompt_ids: Sequence[int] | None = None, max_tokens: int | None = None) -> dict[str, object]:
        """The JSON body, optionally with another prompt or max_tokens (the PD stages). Pure."""
        return {
            "request_id": self.request_id, "prompt_ids": list(self.prompt_ids if prompt_ids is None else prompt_ids),
            "max_tokens": self.max_tokens if max_tokens is None else max_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "seed": self.seed, "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """Tokens one worker streamed. `finish_reason` is set on the last event only;
    cached/pool tokens are the producing worker's (prompt tokens reused, of those from the
    pool); `time_s` is the router's clock when the event arrived."""

    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    cached_tokens: int
    pool_tokens: int
    time_s: float
    worker: str
    stage: Role


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """A snapshot of one worker for /health and /metrics."""

    name: str
    role: Role
    healthy: bool
    waiting: int
    running: int
    in_flight: int


class _Line(msgspec.Struct, frozen=True):
    token_ids: list[int]
    finish_reason: Literal["stop", "length", "abort"] | None = None
    cached_tokens: int = 0
    pool_tokens: int = 0
    error: str | None = None


class _Load(msgspec.Struct, frozen=True):
    waiting: int
    running: int
    free_blocks: int = 0
    total_blocks: int = 0


class _Health(msgspec.Struct, frozen=True):
    role: str
    block_tokens: int = 0


@dataclass(slots=True)
class WorkerHandle:
    """The router's view of one worker: health, load and block_tokens as last seen, and the
    requests this router has in flight there (mutated by `WorkerClient` and the router)."""

    spec: WorkerSpec
    healthy: bool = True
    load: _Load = dataclasses.field(default_factory=lambda: _Load(0, 0))
    block_tokens: int = 0
    in_flight: int = 0

    def status(self) -> WorkerStatus:
        """The snapshot (pure)."""
        s = self.spec
        return WorkerStatus(s.name, s.role, self.healthy, self.load.waiting, self.load.running, self.in_flight)


class WorkerClient:
    """Every HTTP call to the workers, over one connection pool (see the module).

    Args:
        clock: stamps `TokenEvent.time_s` and bounds discovery.
        connect_timeout_s / read_timeout_s: per call; /health and /load also wait at most
            twice `poll_interval_s`.
        poll_interval_s: how often `poll_forever` refreshes the workers.
    """

    def __init__(self, clock: Clock, connect_timeout_s: float, read_timeout_s: float, poll_interval_s: float) -> None:
        self._clock, self._read_timeout_s, self._poll_interval_s = clock, read_timeout_s, poll_interval_s
        self._probe_timeout_s = min(connect_timeout_s, 2 * poll_interval_s)
        timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self._http = httpx.AsyncClient(timeout=timeout, limits=limits)

    async def aclose(self) -> None:
        """Closes the connections (idempotent)."""
        await self._http.aclose()

    async def stream(
        self, worker: WorkerHandle, body: dict[str, object], stage: Role
    ) -> AsyncGenerator[TokenEvent, None]:
        """POST /generate and parse its NDJSON lines until one has a finish reason.

        Raises (from the iterator):
            InvalidArgument: the worker refused the input (400). WorkerUnavailable: it cannot
            be reached (and is marked down) or answered 503. WorkerError: anything else.
        """
        name, url = worker.spec.name, f"{worker.spec.url}/generate"
        try:
            async with self._http.stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    raise _status_error(name, response.status_code, await response.aread())
                async for text in response.aiter_lines():
                    if not text.strip():
                        continue
                    try:
                        line = msgspec.json.decode(text, type=_Line)
                    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
                        raise WorkerError(f"worker {name} sent a malformed line: {exc}") from exc
                    if line.finish_reason == "abort":
                        raise WorkerError(f"worker {name} aborted the request: {line.error or 'no reason given'}")
                    now = self._clock.now()
                    ids = tuple(line.token_ids)
                    yield TokenEvent(ids, line.finish_reason, line.cached_tokens, line.pool_tokens, now, name, stage)
                    if line.finish_reason is not None:
                        return
                raise WorkerError(f"worker {name} ended the stream before the request finished")
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            worker.healthy = False
            raise WorkerUnavailable(f"worker {name} at {worker.spec.url} is unreachable: {exc}") from exc
        except httpx.TimeoutException as exc:
            raise WorkerError(f"worker {name} did not answer within {self._read_timeout_s} s") from exc
        except httpx.HTTPError as exc:
            raise WorkerError(f"worker {name} failed: {exc!r}") from exc

    async def discover(self, workers: Sequence[WorkerHandle], timeout_s: float) -> None:
        """Refreshes with /health until every worker answered or `timeout_s` passed; those still
        silent stay marked down (mutates). Raises ConfigError on a role mismatch."""
        deadline = self._clock.now() + timeout_s
        pending = list(workers)
        while True:
            answered = await asyncio.gather(*(self.refresh(w, health=True) for w in pending))
            pending = [w for w, ok in zip(pending, answered, strict=True) if not ok]
            if not pending or self._clock.now() >= deadline:
                break
            await asyncio.sleep(0.05)  # NOTE: an async wait; the Clock protocol only blocks
        if pending:
            names = ", ".join(w.spec.name for w in pending)
            logger.warning("workers %s did not answer within %s s; marked down", names, timeout_s)

    async def refresh(self, worker: WorkerHandle, health: bool = False) -> bool:
        """GET /load (after /health, whose role must match, when `health`); marks the worker up
        or down (mutates). Returns whether it answered. Raises ConfigError on a role mismatch."""
        try:
            info = msgspec.json.decode(await self._get(worker, "/health"), type=_Health) if health else None
            load = msgspec.json.decode(await self._get(worker, "/load"), type=_Load)
        except (httpx.HTTPError, msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
            if worker.healthy:
                logger.warning("worker %s is down: %r", worker.spec.name, exc)
            worker.healthy = False
            return False
        if info is not None and info.role != worker.spec.role:
            raise ConfigError(f"worker {worker.spec.name} is declared {worker.spec.role} but reports {info.role}")
        if not worker.healthy:
            logger.info("worker %s is up", worker.spec.name)
        worker.block_tokens = info.block_tokens if info is not None else worker.block_tokens
        worker.load, worker.healthy = load, True
        return True

    async def poll_forever(self, workers: Sequence[WorkerHandle]) -> None:
        """Refreshes every worker every `poll_interval_s` until cancelled (mutates)."""
        while True:
            await asyncio.sleep(self._poll_interval_s)
            await asyncio.gather(*(self.refresh(w) for w in workers))

    async def _get(self, worker: WorkerHandle, path: str) -> bytes:
        response = await self._http.get(f"{worker.spec.url}{path}", timeout=self._probe_timeout_s)
        response.raise_for_status()
        return response.content


def _status_error(name: str, status: int, body: bytes) -> TsukimiError:
    message = body[:200].decode(errors="replace")
    with contextlib.suppress(msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        message = str(msgspec.json.decode(body, type=dict[str, object]).get("error", message))
    kind = {400: InvalidArgument, 503: WorkerUnavailable}.get(status, WorkerError)  # 400: the input's fault
    return kind(f"worker {name} answered HTTP {status}: {message}")
