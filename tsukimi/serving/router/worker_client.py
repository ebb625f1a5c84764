"""The router's backend for tsukimi workers (tsukimi/serving/router/backend.py): the router's side
of the workers' internal HTTP API (tsukimi/serving/protocol.py), every call over one
`httpx.AsyncClient`:

    stream          POST /generate (GenerateRequest) -> TokenChunk, ...  (the last has a finish_reason)
    health / poll   GET /health (role, block_tokens, KV event ports, cost profile) / GET /load
    update_weights  POST /admin/update_weights to every worker; then its block keys take the
                    new weights' salt
    block_keys      hash_blocks of the prompt, salted as the workers salt theirs

A prefill worker makes the first token only, by its role (tsukimi/serving/worker/server.py): a
prefill stage sends the request as it is. The prefix index learns from the prefill workers'
KV events (each one's /health names its PUB and snapshot ports; decode and colocated workers
feed nothing), and every block a prefill worker caches is in the KV pool too.

An error a worker reports arrives as (code, message) and is raised here as the same class
(`protocol.raise_error`). Every call has connect and read timeouts: a worker that cannot be
reached raises `WorkerUnavailable` (HTTP 503), one that fails, stalls or answers garbage
`WorkerError` (502), so a request never hangs on a dead worker; how each HTTP failure maps onto
them, and the connect retry, is tsukimi/serving/router/worker_http.py's.

Runs on one asyncio event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Sequence
from typing import TypeVar

import httpx
import msgspec

from tsukimi import httpd
from tsukimi.clock import Clock
from tsukimi.engine.block_manager import weights_salt
from tsukimi.errors import TsukimiError, WorkerError, WorkerUnavailable
from tsukimi.scheduler.block_hash import BlockHash, hash_blocks
from tsukimi.scheduler.prefix_index import Tier
from tsukimi.serving.kv_events import EventSource
from tsukimi.serving.protocol import (
    GenerateRequest,
    Health,
    Load,
    TokenChunk,
    UpdateWeightsReply,
    UpdateWeightsRequest,
    from_reply,
    raise_error,
)
from tsukimi.serving.router.backend import Handover, Stage, StageChunk
from tsukimi.serving.router.worker_http import open_stream, probe, stream_error
from tsukimi.serving.router.workers import WorkerHandle

logger = logging.getLogger(__name__)
ProbeT = TypeVar("ProbeT", Health, Load)

_DECODE_ERRORS = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)


class WorkerClient:
    """The tsukimi workers' backend: every HTTP call to them, over one connection pool (see the
    module). Implements `RouterBackend` and `WeightUpdates`.

    Args:
        clock: times the connect retries.
        connect_timeout_s / read_timeout_s: per call; /health and /load also wait at most
            twice `poll_interval_s`.
        poll_interval_s: how often the router polls them.
        transport: the connections' transport (None: sockets; tests pass a mock).
    """

    kind = "tsukimi"
    tier: Tier = "dram"  # NOTE: a worker's block pool is its CPU cache
    pooled = True
    colocated_conductor = False

    def __init__(
        self,
        clock: Clock,
        connect_timeout_s: float,
        read_timeout_s: float,
        poll_interval_s: float,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._clock, self._read_timeout_s, self._transport = clock, read_timeout_s, transport
        self._connect_timeout_s = connect_timeout_s
        # NOTE: at least 0.5 s: a busy worker answered /load in over 0.1 s (2 polls of 50 ms) and
        # was marked down mid-request, failing it (test_real_workers_pd_matches_colocated in CI)
        self._probe_timeout_s = min(connect_timeout_s, max(0.5, 2 * poll_interval_s))
        self._client: httpx.AsyncClient | None = None
        self.salt = b""  # the workers' block-hash salt (their weights version, after a live update)

    @property
    def _http(self) -> httpx.AsyncClient:
        """The connection pool, opened on first use (again after `aclose`)."""
        if self._client is None or self._client.is_closed:
            timeout = httpx.Timeout(self._read_timeout_s, connect=self._connect_timeout_s)
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            self._client = httpx.AsyncClient(timeout=timeout, limits=limits, transport=self._transport)
        return self._client

    async def aclose(self) -> None:
        """Closes the connections (idempotent; a later call opens new ones)."""
        if self._client is not None:
            await self._client.aclose()

    def block_keys(self, prompt: Sequence[int], block_tokens: int) -> list[BlockHash]:
        """hash_blocks of the prompt, salted as the workers salt theirs (pure)."""
        return hash_blocks(prompt, block_tokens, self.salt)

    def events(self, worker: WorkerHandle, health: Health | None) -> EventSource | None:
        """A prefill worker's publisher, where its /health says (None for other roles)."""
        if worker.spec.role != "prefill" or health is None or not health.kv_events_port:
            return None
        host = httpx.URL(worker.spec.url).host
        return EventSource(
            f"tcp://{host}:{health.kv_events_port}", snapshot_endpoint=f"tcp://{host}:{health.kv_snapshot_port}"
        )

    async def stream(
        self, worker: WorkerHandle, request: GenerateRequest, stage: Stage, handover: Handover | None = None
    ) -> AsyncGenerator[StageChunk, None]:
        """POST /generate and parse its NDJSON lines until one has a finish reason. Every stage
        sends the request as it is: a prefill worker makes one token by its role.

        Raises (from the iterator): the error the worker reported, as its class (e.g.
            InvalidArgument 400, DuplicateRequest 409); WorkerUnavailable: it cannot be
            reached (and is marked down) or answered 503; WorkerError: anything else.
        """
        name = worker.spec.name
        built = self._http.build_request("POST", f"{worker.spec.url}/generate", content=msgspec.json.encode(request))
        try:
            response = await open_stream(self._http, built, worker, self._clock)
            try:
                if response.status_code != 200:
                    raise raise_error(response.status_code, await response.aread(), name)
                async for text in response.aiter_lines():
                    if not text.strip():
                        continue
                    try:
                        chunk = msgspec.json.decode(text, type=TokenChunk)
                    except _DECODE_ERRORS as exc:
                        raise WorkerError(f"worker {name} sent a malformed line: {exc}") from exc
                    if chunk.error is not None:
                        raise from_reply(chunk.error, name)
                    yield StageChunk(chunk)
                    if chunk.finish_reason is not None:
                        return
                raise WorkerError(f"worker {name} ended the stream before the request finished")
            finally:
                await response.aclose()
        except httpx.HTTPError as exc:
            raise stream_error(worker, exc, self._read_timeout_s) from exc

    async def update_weights(
        self, workers: Sequence[WorkerHandle], request: UpdateWeightsRequest, secret: bytes | None
    ) -> dict[str, UpdateWeightsReply | TsukimiError]:
        """POST /admin/update_weights (signed with `secret`) to every worker at once, waiting for
        their drains too; each worker's reply or error. Once every worker runs one version, the
        block keys take its salt (mutates)."""
        results = await asyncio.gather(*(self._update(w, request, secret) for w in workers), return_exceptions=True)
        outcome: dict[str, UpdateWeightsReply | TsukimiError] = {}
        for worker, result in zip(workers, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, TsukimiError):
                raise result
            outcome[worker.spec.name] = result
        versions = {r.weights_version if isinstance(r, UpdateWeightsReply) else "" for r in outcome.values()}
        if len(versions) == 1 and "" not in versions:  # NOTE: every worker on one version: hash as they do
            self.salt = weights_salt(versions.pop())
        return outcome

    async def _update(
        self, worker: WorkerHandle, request: UpdateWeightsRequest, secret: bytes | None
    ) -> UpdateWeightsReply:
        """One worker's update. Raises the error it reported, as its class; WorkerUnavailable:
        unreachable; WorkerError: anything else."""
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
        except _DECODE_ERRORS as exc:
            raise WorkerError(f"worker {name} answered the weight update with garbage: {exc}") from exc

    async def health(self, worker: WorkerHandle) -> Health:
        """GET /health. Raises RpcTimeout (late) or WorkerError."""
        return await self._probe(worker, "/health", Health)

    async def poll(self, worker: WorkerHandle) -> Load:
        """GET /load. Raises RpcTimeout (late) or WorkerError."""
        return await self._probe(worker, "/load", Load)

    async def _probe(self, worker: WorkerHandle, path: str, kind: type[ProbeT]) -> ProbeT:
        response = await probe(self._http, worker, path, self._probe_timeout_s)
        try:
            return msgspec.json.decode(response.content, type=kind)
        except _DECODE_ERRORS as exc:
            raise WorkerError(f"worker {worker.spec.name} answered {path} with garbage: {exc}") from exc
