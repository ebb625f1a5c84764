"""Request placement over running workers, independent of any HTTP framework: `Router` owns
the workers' view (health, load) and, in PD mode, the Conductor and its prefix index.

    colocated:  request -> least-loaded worker ------------------------------> tokens
    pd:         request -> hash_blocks -> Conductor.schedule --(reject)--> Rejected(reason, what was predicted)
                        --(queued: no decode KV memory yet)--> waits for its release (kv_wait.py)
                        -> prefill worker (max_tokens=1; publishes the prompt's KV to the pool)
                        -> first token -> admit_decode -> decode worker (prompt + first token,
                           max_tokens - 1; loads the prompt's KV from the pool) -> tokens
                        -> decode_finished

`generate` yields `TokenEvent`s as the workers stream them; the stages stay inside the
router (its callers see one stream of tokens and the request's reuse counts). Every worker call
goes through one `WorkerClient` (tsukimi/serving/router/worker_client.py), with connect and read
timeouts: a worker that cannot be reached raises `WorkerUnavailable` (HTTP 503), one that
fails, stalls or answers garbage `WorkerError` (502), so a request never hangs on a dead
worker; an error a worker reports is raised as its own class. A request that found its
worker unreachable before any token is placed again (the `Retry` policy `PLACEMENT`). Loads
come from `GET /load`, polled every `poll_interval_s`, and from a local count of this
router's requests in flight.

`update_weights` fans a live weight update out to every worker (each swaps in the new weights
on its own; tsukimi/serving/worker/weight_update.py) and forgets what the prefix index knew of each
worker that updated and of the pool: their blocks of the old weights are unreachable now (the
workers' KV format digest changed). Even without that the index would only misjudge costs.

The prefix index learns only from the prefill workers' KV events (stored and evicted blocks,
in order, a snapshot after a gap: tsukimi/serving/router/index_feed.py); the router records nothing
itself when a prefill finishes. Each PD request's events carry what the index expected the
prefill worker to reuse at decision time (`expected_cached_tokens`), beside what it reused.

A prefill worker that is a CPP group (its /health says so) is priced by the Conductor with
the pipeline estimate and never gets a sampling request (tsukimi/serving/router/cpp_groups.py).

Runs on one asyncio event loop (the Conductor and the index are not thread-safe).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec

from tsukimi.clock import Clock, WallClock
from tsukimi.config import ROLES, ConductorConfig, RouterConfig
from tsukimi.engine.block_manager import weights_salt
from tsukimi.errors import ConfigError, Rejected, TsukimiError, WorkerUnavailable
from tsukimi.retry import Retry
from tsukimi.scheduler.baselines import make_router
from tsukimi.scheduler.block_hash import BlockHash, hash_blocks
from tsukimi.scheduler.conductor import Conductor, ScheduleRequest
from tsukimi.scheduler.prefix_index import PrefixIndex, location
from tsukimi.serving.protocol import FinishReason, GenerateRequest, UpdateWeightsReply, UpdateWeightsRequest
from tsukimi.serving.router.cpp_groups import conductor_groups, excluded
from tsukimi.serving.router.decision_log import DecisionLog
from tsukimi.serving.router.index_feed import ExpectedReuse, IndexFeed, expected_reuse
from tsukimi.serving.router.kv_wait import ReleaseWaits
from tsukimi.serving.router.worker_client import POOL, WorkerClient, WorkerHandle, WorkerSpec, WorkerStatus
from tsukimi.serving.router.worker_costs import WorkerCostModel, conductor_cost
from tsukimi.serving.router.worker_costs import cost_model as cost_model  # NOTE: re-exported for its importers

logger = logging.getLogger(__name__)

DEFAULT_DECODE_CAPACITY_TOKENS = 65536
# NOTE: a request whose worker could not be reached before any token goes to another one, at
# once; the set of workers still up bounds the tries (the Conductor or the pick runs out).
PLACEMENT = Retry(attempts=None, on=(WorkerUnavailable,))


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """Tokens of one request as the workers streamed them. `finish_reason` is set on the last
    event only; `cached_tokens` / `pool_tokens` count the request's prompt tokens whose KV was
    reused so far (of those, loaded from the KV pool), over every worker that served it;
    `time_s` is the router's clock when the event arrived; `worker` produced the tokens (on
    `weights_version`); `expected`: what the prefix index expected the prefill worker to reuse
    (PD only)."""

    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    cached_tokens: int
    pool_tokens: int
    time_s: float
    worker: str
    weights_version: str = ""
    expected: ExpectedReuse | None = None


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
        self,
        workers: Sequence[WorkerSpec],
        config: RouterConfig | None = None,
        conductor: ConductorConfig | None = None,
        clock: Clock | None = None,
    ) -> None:
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
        self._feed: IndexFeed | None = None
        self._lock = asyncio.Lock()
        self._ids = itertools.count()
        self._running_prefills: dict[str, dict[int, list[BlockHash]]] = {}  # worker -> rid -> its block hashes
        self._salt = b""  # the workers' block-hash salt (their weights version, after a live update)
        self.decisions = DecisionLog()  # the recent placements, for the dashboard
        self._waits = ReleaseWaits(self.clock)  # requests queued for decode KV memory

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
                if self.conductor is not None:
                    self._feed = IndexFeed(self.index, self.block_tokens, cfg.connect_timeout_s)
                    self._feed.start(workers)
            except BaseException:
                await self.close()
                raise
            polls = client.poll_forever(workers, self._refresh_cost)
            self._poller = asyncio.create_task(polls, name="router-load-poller")
            logger.info("router started in %s mode over %d workers", self.mode, len(self._workers))

    async def close(self) -> None:
        """Stops polling and closes the connections (idempotent; mutates)."""
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self._client is not None:
            await self._client.aclose()
        if self._feed is not None:
            await self._feed.close()
        self._poller = self._client = self._feed = None

    async def update_weights(
        self, request: UpdateWeightsRequest, secret: bytes | None
    ) -> dict[str, UpdateWeightsReply | TsukimiError]:
        """Update every worker's weights at once (see the module); each worker's reply or error.
        Mutates the prefix index."""
        await self.start()
        assert self._client is not None
        client, workers = self._client, list(self._workers.values())
        results = await asyncio.gather(
            *(client.update_weights(w, request, secret) for w in workers), return_exceptions=True
        )
        outcome: dict[str, UpdateWeightsReply | TsukimiError] = {}
        for worker, result in zip(workers, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, TsukimiError):
                raise result
            outcome[worker.spec.name] = result
            if isinstance(result, UpdateWeightsReply):
                self.index.drop_location(location(worker.spec.name, "dram"))
        if any(isinstance(r, UpdateWeightsReply) for r in outcome.values()):
            self.index.drop_location(location(POOL, "dram"))
        versions = {r.weights_version if isinstance(r, UpdateWeightsReply) else "" for r in outcome.values()}
        if len(versions) == 1 and "" not in versions:  # NOTE: every worker on one version: hash as they do
            self._salt = weights_salt(versions.pop())
        return outcome

    def workers(self) -> list[WorkerStatus]:
        """The workers' health and loads as last seen (pure)."""
        return [w.status() for w in self._workers.values()]

    def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        """The request's tokens as the workers stream them; close the iterator early (aclose)
        to abort. Starts the router if needed.

        Raises (from the iterator):
            Rejected: the Conductor turned it away (PD). The error a worker reported, as its
            class (InvalidArgument, DuplicateRequest, ...). WorkerUnavailable / WorkerError:
            see the module.
        """
        return self._generate_pd(request) if self.mode == "pd" else self._generate_colocated(request)

    async def _generate_colocated(self, request: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        await self.start()
        attempts = PLACEMENT.start(self.clock)
        tried: dict[str, WorkerUnavailable] = {}
        while True:
            worker = self._pick_colocated(tried)
            self.decisions.picked(request.request_id, len(request.prompt_ids), worker.spec.name, self.clock.now())
            started = False
            try:
                async with contextlib.aclosing(self._events(worker, request)) as events:
                    async for event in events:
                        started = True
                        yield event
                return
            except WorkerUnavailable as exc:
                # NOTE: nothing was generated there, so another worker may take it.
                if started or not await attempts.wait_async(exc):
                    raise
                worker.healthy, tried[worker.spec.name] = False, exc

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
        blocks = hash_blocks(prompt, self.block_tokens, self._salt)
        first = await self._place_and_prefill(conductor, rid, request, blocks)
        if first.finish_reason == "stop" or len(first.token_ids) >= request.max_tokens:
            conductor.finished_at_prefill(rid, self.clock.now())
            self._wake()
            yield dataclasses.replace(first, finish_reason=first.finish_reason or "length")
            return
        decode, generated = self._admit_decode(conductor, rid), len(first.token_ids)
        follow = msgspec.structs.replace(  # NOTE: on the first token's weights (a live update may intervene)
            request,
            prompt_ids=(*prompt, *first.token_ids),
            max_tokens=request.max_tokens - generated,
            weights_version=first.weights_version,
        )
        try:
            yield dataclasses.replace(first, finish_reason=None)
            async with contextlib.aclosing(self._events(decode, follow)) as events:
                async for event in events:
                    generated += len(event.token_ids)
                    # NOTE: the decode worker loads the prompt's KV from the pool too: its pool
                    # tokens add to the prefill's; the cached ones are the prefill's
                    yield dataclasses.replace(
                        event,
                        cached_tokens=first.cached_tokens,
                        pool_tokens=first.pool_tokens + event.pool_tokens,
                        expected=first.expected,
                    )
        finally:
            conductor.decode_finished(rid, self.clock.now(), generated)
            self._wake()

    async def _place_and_prefill(
        self, conductor: Conductor, rid: int, request: GenerateRequest, blocks: list[BlockHash]
    ) -> TokenEvent:
        """Schedules the request and runs its prefill, placing it again while the chosen prefill
        worker turns out unreachable; its one event, with the reuse the index expected."""
        attempts = PLACEMENT.start(self.clock)
        deadline_s = self.clock.now() + conductor.config.ttft_slo_s  # NOTE: a queued request waits no longer
        scheduled = ScheduleRequest(rid, len(request.prompt_ids), blocks, request.max_tokens)
        while True:
            down = excluded(self._workers.values(), request)  # NOTE: and the CPP groups when sampling
            decision = conductor.schedule(scheduled, self.clock.now(), down)
            self.decisions.conductor(request.request_id, len(request.prompt_ids), decision, self.clock.now())
            if not decision.accepted:
                if decision.reason == "no_instance":
                    raise WorkerUnavailable("no prefill or decode worker is reachable: all are marked down")
                raise Rejected(decision.reason, decision.message)
            if decision.queued:  # NOTE: placed once its decode KV memory frees; None: to be scheduled again
                forbidden = functools.partial(excluded, self._workers.values(), request)
                if (released := await self._waits.wait(conductor, decision, deadline_s, forbidden)) is None:
                    continue
                decision = released
                self.decisions.conductor(request.request_id, len(request.prompt_ids), decision, self.clock.now())
            assert decision.prefill is not None
            prefill = self._workers[decision.prefill]
            running = self._running_prefills.setdefault(decision.prefill, {})
            expected = expected_reuse(
                self.index, decision.prefill, blocks, len(request.prompt_ids), self.block_tokens, list(running.values())
            )
            running[rid] = blocks
            try:
                return dataclasses.replace(await self._prefill(prefill, request), expected=expected)
            except WorkerUnavailable as exc:
                conductor.finished_at_prefill(rid, self.clock.now())
                self._wake()
                prefill.healthy = False
                if not await attempts.wait_async(exc):
                    raise
            except BaseException:
                conductor.finished_at_prefill(rid, self.clock.now())
                self._wake()
                raise
            finally:
                running.pop(rid, None)

    def _admit_decode(self, conductor: Conductor, rid: int) -> WorkerHandle:
        """The decode worker the Conductor admits the request to. Raises Rejected or WorkerUnavailable."""
        down = {name for name, w in self._workers.items() if not w.healthy}
        name = conductor.admit_decode(rid, self.clock.now(), down)
        if name is None:
            self._wake()
            if all(w.spec.name in down for w in self._workers.values() if w.spec.role == "decode"):
                raise WorkerUnavailable("no decode worker is reachable: all are marked down")
            raise Rejected("rejected_at_decode")  # the Conductor's counter name
        return self._workers[name]

    def _wake(self) -> None:
        """Decode KV memory may have freed: release the requests queued for it."""
        if self.conductor is not None:
            self._waits.wake(self.conductor, {name for name, w in self._workers.items() if not w.healthy})

    async def _prefill(self, worker: WorkerHandle, request: GenerateRequest) -> TokenEvent:
        """Runs the prefill stage (one token) to its end; one event with all its tokens."""
        # NOTE: the stream runs to its end (or raises), so nothing is left to close
        events = [event async for event in self._events(worker, msgspec.structs.replace(request, max_tokens=1))]
        last = events[-1]
        tokens = tuple(t for e in events for t in e.token_ids)
        cached, pool = max(e.cached_tokens for e in events), max(e.pool_tokens for e in events)
        return dataclasses.replace(last, token_ids=tokens, cached_tokens=cached, pool_tokens=pool)

    async def _events(self, worker: WorkerHandle, request: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        """One worker's stream as TokenEvents, counted in the worker's `in_flight`."""
        assert self._client is not None
        worker.in_flight += 1
        worker.requests += 1
        try:
            async with contextlib.aclosing(self._client.stream(worker, request)) as chunks:
                async for chunk in chunks:
                    now = self.clock.now()
                    ids = tuple(chunk.token_ids)
                    yield TokenEvent(
                        ids,
                        chunk.finish_reason,
                        chunk.cached_tokens,
                        chunk.pool_tokens,
                        now,
                        worker.spec.name,
                        chunk.weights_version,
                    )
        finally:
            worker.in_flight -= 1

    def _refresh_cost(self) -> None:
        """After each poll: the Conductor's estimates follow the workers' reports (worker_costs.py)."""
        if self.conductor is not None and isinstance(self.conductor.cost, WorkerCostModel):
            self.conductor.cost.refresh(self._workers.values())

    def _build_conductor(self) -> Conductor:
        """Checks that the PD workers agree on block_tokens, then builds the Conductor over them."""
        seen = {w.block_tokens for w in self._workers.values() if w.block_tokens > 0} | {self.block_tokens} - {0}
        if len(seen) > 1:
            raise ConfigError(f"PD workers (and router.block_tokens) disagree on block_tokens: {sorted(seen)}")
        if not seen:
            logger.warning("no worker reported block_tokens; using conductor.block_tokens")
        self.block_tokens = seen.pop() if seen else self._conductor_config.block_tokens
        # NOTE: each decode worker's own KV memory (its /load total_blocks), unless the config sets one for all
        fixed = self.config.decode_capacity_tokens
        capacity = {
            w.spec.name: fixed or w.load.total_blocks * self.block_tokens or DEFAULT_DECODE_CAPACITY_TOKENS
            for w in self._workers.values()
            if w.spec.role == "decode"
        }
        conductor = dataclasses.replace(self._conductor_config, block_tokens=self.block_tokens)
        names = {role: [w.spec.name for w in self._workers.values() if w.spec.role == role] for role in ROLES}
        groups = conductor_groups(self._workers.values())  # NOTE: priced with the pipeline estimate
        cost = conductor_cost(self.config, self._workers.values())  # NOTE: the workers' profiles, or the config's
        return Conductor(conductor, cost, self.index, names["prefill"], names["decode"], capacity, groups=groups)


def _resolve_mode(mode: str, workers: Sequence[WorkerSpec]) -> Literal["colocated", "pd"]:
    roles = {w.role for w in workers}
    if mode in ("auto", "colocated") and roles == {"colocated"}:
        return "colocated"
    if mode in ("auto", "pd") and roles == {"prefill", "decode"}:
        return "pd"
    raise ConfigError(
        f"workers with roles {sorted(roles) or 'none'} fit no {mode} mode: colocated needs colocated "
        "workers only, pd prefill and decode workers only"
    )
