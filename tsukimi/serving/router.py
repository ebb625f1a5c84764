"""Request placement over running workers, independent of any HTTP framework: `Router` owns
the workers' view (health, load) and, in PD mode, the Conductor and its prefix index.

    colocated:  request -> least-loaded worker ------------------------------> tokens
    pd:         request -> hash_blocks -> Conductor.schedule --(reject)--> Rejected(reason)
                        -> prefill worker (max_tokens=1; publishes the prompt's KV to the pool)
                        -> first token -> admit_decode -> decode worker (prompt + first token,
                           max_tokens - 1; loads the prompt's KV from the pool) -> tokens
                        -> decode_finished

`generate` yields `TokenEvent`s as the worker streams them. Every worker call goes through one
`WorkerClient` (tsukimi/serving/worker_client.py), with connect and read timeouts: a worker
that cannot be reached raises `WorkerUnavailable` (HTTP 503), one that fails, stalls or answers
garbage `WorkerError` (502), so a request never hangs on a dead worker. Loads come from
`GET /load`, polled every `poll_interval_s`, and from a local count of this router's requests
in flight.

NOTE: the prefix index learns of blocks only when a prefill finishes here (the prompt's full
blocks at the prefill worker and at the pool); workers do not report evictions back, so the
index over-approximates what is cached, and the Conductor may expect a hit that turns into
recomputation. That costs time, never correctness.

Runs on one asyncio event loop (the Conductor and the index are not thread-safe).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
from collections.abc import AsyncGenerator, Sequence
from typing import Literal, cast

from tsukimi.clock import Clock, WallClock
from tsukimi.config import ROLES, ConductorConfig, Role, RouterConfig
from tsukimi.errors import ConfigError, Rejected, WorkerError, WorkerUnavailable
from tsukimi.scheduler.baselines import make_router
from tsukimi.scheduler.block_hash import hash_blocks
from tsukimi.scheduler.conductor import Conductor, ScheduleRequest
from tsukimi.scheduler.cost_model import CostModel, LinearCostModel
from tsukimi.scheduler.prefix_index import PrefixIndex, location
from tsukimi.serving.worker_client import (
    POOL,
    FinishReason,
    GenerateRequest,
    TokenEvent,
    WorkerClient,
    WorkerHandle,
    WorkerSpec,
    WorkerStatus,
)

__all__ = [  # NOTE: the worker-facing types and the errors live elsewhere; re-exported for callers
    "DEFAULT_DECODE_CAPACITY_TOKENS",
    "POOL",
    "ROLES",
    "FinishReason",
    "GenerateRequest",
    "Rejected",
    "Role",
    "Router",
    "TokenEvent",
    "WorkerError",
    "WorkerSpec",
    "WorkerStatus",
    "WorkerUnavailable",
]

logger = logging.getLogger(__name__)

DEFAULT_DECODE_CAPACITY_TOKENS = 65536


def cost_model(config: RouterConfig) -> CostModel:
    """The Conductor's cost model built from the router's coefficients (pure)."""
    model = LinearCostModel(
        (config.prefill_base_s, config.prefill_token_s, config.prefill_pair_s),
        (config.decode_step_s, config.decode_request_s, config.decode_context_token_s),
        config.kv_bytes_per_token,
    )
    # NOTE: CostModel declares kv_bytes_per_token as a plain (settable) attribute, which a
    # frozen dataclass's field does not satisfy for mypy; the Conductor only reads it.
    return cast(CostModel, model)


class Router:
    """Places requests on workers and streams their tokens back (see the module).

    Args:
        workers: the workers; the mode decides which roles are allowed.
        config / conductor: the router's and the Conductor's settings.
        clock: timestamps and the Conductor's `now`.

    Raises:
        ConfigError: no workers, or roles that fit no mode (or not the one asked for).
    """

    def __init__(
        self, workers: Sequence[WorkerSpec], config: RouterConfig | None = None,
        conductor: ConductorConfig | None = None, clock: Clock | None = None,
    ) -> None:  # fmt: skip
        self.config = config or RouterConfig()
        self.mode = _resolve_mode(self.config.mode, workers)
        self.clock: Clock = clock or WallClock()
        self.index = PrefixIndex()
        self.conductor: Conductor | None = None
        self.block_tokens = self.config.block_tokens
        self._conductor_config = conductor or ConductorConfig()
        self._workers = {w.name: WorkerHandle(w) for w in workers}
        self._policy = make_router(self.config.policy)
        self._client: WorkerClient | None = None
        self._poller: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._ids = itertools.count()

    async def start(self) -> None:
        """Probes the workers (retrying for `startup_timeout_s`; those still silent are marked
        down), builds the Conductor in PD mode and starts polling loads. Idempotent; mutates.

        Raises:
            ConfigError: a worker reports another role than declared, or PD workers disagree
                on block_tokens (or with `router.block_tokens`).
        """
        async with self._lock:
            if self._poller is not None:
                return
            cfg, workers = self.config, list(self._workers.values())
            client = WorkerClient(self.clock, cfg.connect_timeout_s, cfg.read_timeout_s, cfg.poll_interval_s)
            self._client = client
            try:
                await client.discover(workers, cfg.startup_timeout_s)
                self.conductor = self._build_conductor() if self.mode == "pd" else None
            except BaseException:
                await self.close()
                raise
            self._poller = asyncio.create_task(client.poll_forever(workers), name="router-load-poller")
            logger.info("router started in %s mode over %d workers", self.mode, len(self._workers))

    async def close(self) -> None:
        """Stops polling and closes the connections (idempotent; mutates)."""
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self._client is not None:
            await self._client.aclose()
        self._poller = self._client = None

    def workers(self) -> list[WorkerStatus]:
        """The workers' health and loads as last seen (pure)."""
        return [w.status() for w in self._workers.values()]

    def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        """The request's tokens as the workers stream them; close the iterator early (aclose)
        to abort. Starts the router if needed.

        Raises (from the iterator):
            Rejected: the Conductor turned it away (PD). InvalidArgument: a worker refused the
            input (400). WorkerUnavailable / WorkerError: see the module.
        """
        return self._generate_pd(request) if self.mode == "pd" else self._generate_colocated(request)

    async def _generate_colocated(self, request: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        await self.start()
        tried: dict[str, WorkerUnavailable] = {}
        while True:
            worker = self._pick_colocated(tried)
            worker.in_flight += 1
            started = False
            try:
                async with contextlib.aclosing(self._stream(worker, request.body(), "colocated")) as stream:
                    async for event in stream:
                        started = True
                        yield event
                return
            except WorkerUnavailable as exc:
                if started:
                    raise
                # NOTE: nothing was generated there, so another worker may take it.
                worker.healthy, tried[worker.spec.name] = False, exc
            finally:
                worker.in_flight -= 1

    def _pick_colocated(self, tried: dict[str, WorkerUnavailable]) -> WorkerHandle:
        candidates = [w for w in self._workers.values() if w.healthy and w.spec.name not in tried]
        if not candidates:
            why = "; ".join(str(e) for e in tried.values()) or "all are marked down"
            raise WorkerUnavailable(f"no colocated worker is reachable: {why}")
        loads = [max(w.in_flight, w.load.waiting + w.load.running) for w in candidates]
        return candidates[self._policy.route(loads)]

    async def _generate_pd(self, request: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        await self.start()
        conductor = self.conductor
        assert conductor is not None
        rid, prompt = next(self._ids), request.prompt_ids
        blocks = hash_blocks(prompt, self.block_tokens)
        while True:  # NOTE: a prefill worker found down before any token: place the request again
            down = {name for name, w in self._workers.items() if not w.healthy}
            decision = conductor.schedule(ScheduleRequest(rid, len(prompt), blocks), self.clock.now(), down)
            if not decision.accepted:
                if decision.reason == "no_instance":
                    raise WorkerUnavailable("no prefill or decode worker is reachable: all are marked down")
                raise Rejected(decision.reason)
            assert decision.prefill is not None
            prefill = self._workers[decision.prefill]
            try:
                first = await self._prefill(prefill, request)
                break
            except WorkerUnavailable:
                conductor.finished_at_prefill(rid, self.clock.now())
                prefill.healthy = False
            except BaseException:
                conductor.finished_at_prefill(rid, self.clock.now())
                raise
        self.index.stored(location(prefill.spec.name, "dram"), blocks)
        self.index.stored(location(POOL, "dram"), blocks)
        if first.finish_reason == "stop" or len(first.token_ids) >= request.max_tokens:
            conductor.finished_at_prefill(rid, self.clock.now())
            yield dataclasses.replace(first, finish_reason=first.finish_reason or "length")
            return
        down = {name for name, w in self._workers.items() if not w.healthy}
        name = conductor.admit_decode(rid, self.clock.now(), down)
        if name is None:
            if all(w.spec.name in down for w in self._workers.values() if w.spec.role == "decode"):
                raise WorkerUnavailable("no decode worker is reachable: all are marked down")
            raise Rejected("rejected_at_decode")  # the Conductor's counter name
        decode, generated = self._workers[name], len(first.token_ids)
        body = request.body([*prompt, *first.token_ids], request.max_tokens - generated)
        decode.in_flight += 1
        try:
            yield dataclasses.replace(first, finish_reason=None)
            async with contextlib.aclosing(self._stream(decode, body, "decode")) as stream:
                async for event in stream:
                    generated += len(event.token_ids)
                    yield event
        finally:
            decode.in_flight -= 1
            conductor.decode_finished(rid, self.clock.now(), generated)

    async def _prefill(self, worker: WorkerHandle, request: GenerateRequest) -> TokenEvent:
        """Runs the prefill stage (max_tokens=1) to its end; one event with all its tokens."""
        worker.in_flight += 1
        try:  # NOTE: the stream runs to its end (or raises), so nothing is left to close
            events = [event async for event in self._stream(worker, request.body(max_tokens=1), "prefill")]
        finally:
            worker.in_flight -= 1
        last = events[-1]
        tokens = tuple(t for e in events for t in e.token_ids)
        cached, pool = max(e.cached_tokens for e in events), max(e.pool_tokens for e in events)
        return dataclasses.replace(last, token_ids=tokens, cached_tokens=cached, pool_tokens=pool)

    def _stream(self, worker: WorkerHandle, body: dict[str, object], stage: Role) -> AsyncGenerator[TokenEvent, None]:
        assert self._client is not None
        return self._client.stream(worker, body, stage)

    def _build_conductor(self) -> Conductor:
        """Checks that the PD workers agree on block_tokens, then builds the Conductor over them."""
        seen = {w.block_tokens for w in self._workers.values() if w.block_tokens > 0} | {self.block_tokens} - {0}
        if len(seen) > 1:
            raise ConfigError(f"PD workers (and router.block_tokens) disagree on block_tokens: {sorted(seen)}")
        if not seen:
            logger.warning("no worker reported block_tokens; using conductor.block_tokens")
        self.block_tokens = seen.pop() if seen else self._conductor_config.block_tokens
        capacity = self.config.decode_capacity_tokens
        if not capacity:
            known = [w.load.total_blocks for w in self._workers.values() if w.spec.role == "decode"]
            capacity = min((b for b in known if b > 0), default=0) * self.block_tokens or DEFAULT_DECODE_CAPACITY_TOKENS
        conductor = dataclasses.replace(self._conductor_config, block_tokens=self.block_tokens)
        names = {role: [w.spec.name for w in self._workers.values() if w.spec.role == role] for role in ROLES}
        return Conductor(conductor, cost_model(self.config), self.index, names["prefill"], names["decode"], capacity)


def _resolve_mode(mode: str, workers: Sequence[WorkerSpec]) -> Literal["colocated", "pd"]:
    roles = {w.role for w in workers}
    if mode in ("auto", "colocated") and roles == {"colocated"}:
        return "colocated"
    if mode in ("auto", "pd") and roles == {"prefill", "decode"}:
        return "pd"
    raise ConfigError(f"workers with roles {sorted(roles) or 'none'} fit no {mode} mode: colocated needs colocated "
                      "workers only, pd prefill and decode workers only")  # fmt: skip
