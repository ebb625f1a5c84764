"""Request placement over running workers, independent of any HTTP framework and of what the
workers are: `Router` owns the workers' view (health, load), the prefix index and the
Conductor, and reaches the workers through a `RouterBackend` (tsukimi/serving/router/backend.py:
tsukimi workers, or vLLM instances).

    colocated:  request -> place (Conductor, or the least_load / round_robin pick) -> worker
                -> tokens (a Conductor's booking ends with the first token)
    pd:         request -> block keys -> place (Conductor.schedule --(reject)--> Rejected(reason,
                           what was predicted); --(queued: no decode KV memory yet)--> waits for
                           its release, kv_wait.py; or the baseline's pick)
                        -> prefill stage (one token; its KV to the pool / the decode instance)
                        -> first token -> admit decode (Conductor.admit_decode, or the pick)
                        -> decode stage (prompt + first token, max_tokens - 1; the prefill's
                           hand-over) -> tokens -> decode_finished

`generate` yields `TokenEvent`s as the workers stream them; the stages stay inside the
router (its callers see one stream of tokens and the request's reuse counts). Every placement
is logged in the decision log under the client's request id (decision_log.py). A worker that
cannot be reached raises `WorkerUnavailable` (HTTP 503), one that fails, stalls or answers
garbage `WorkerError` (502), so a request never hangs on a dead worker; an error a worker
reports is raised as its own class. A request that found its worker unreachable before any
token is placed again (the `Retry` policy `PLACEMENT`). Loads come from the backend's polls
every `poll_interval_s` (liveness.py) and from a local count of this router's requests in
flight.

`update_weights` fans a live weight update out to every worker (a backend whose workers take
one: tsukimi/serving/worker/weight_update.py) and forgets what the prefix index knew of each
worker that updated and of the pool: their blocks of the old weights are unreachable now.

The prefix index learns only from the workers' KV events (stored and evicted blocks, in
order, a snapshot or replay after a gap: index_feed.py); the router records nothing itself
when a prefill finishes. A prefill worker that is a CPP group (its /health says so) is priced
by the Conductor with the pipeline estimate and never gets a sampling request (cpp_groups.py).

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
from tsukimi.config import ROLES, ROUTER_CONDUCTOR, ConductorConfig, RouterConfig
from tsukimi.errors import ConfigError, DuplicateRequest, InvalidArgument, Rejected, TsukimiError, WorkerUnavailable
from tsukimi.retry import Retry
from tsukimi.scheduler.baselines import make_router
from tsukimi.scheduler.block_hash import BlockHash
from tsukimi.scheduler.conductor import Conductor, Decision, ScheduleRequest
from tsukimi.scheduler.index_sync import EventStats
from tsukimi.scheduler.prefix_index import PrefixIndex, location
from tsukimi.scheduler.service_term import ServiceTerm
from tsukimi.serving.protocol import FinishReason, GenerateRequest, UpdateWeightsReply, UpdateWeightsRequest
from tsukimi.serving.router.backend import Handover, RouterBackend, Stage, StageChunk, WeightUpdates
from tsukimi.serving.router.cpp_groups import conductor_groups, excluded
from tsukimi.serving.router.decision_log import DecisionLog, DecisionRecord
from tsukimi.serving.router.index_feed import IndexFeed, expected_reuse
from tsukimi.serving.router.kv_wait import ReleaseWaits
from tsukimi.serving.router.liveness import Liveness
from tsukimi.serving.router.worker_client import WorkerClient
from tsukimi.serving.router.worker_costs import WorkerCostModel, conductor_cost
from tsukimi.serving.router.workers import POOL, WorkerHandle, WorkerSpec, WorkerStatus

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
    `weights_version`)."""

    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    cached_tokens: int
    pool_tokens: int
    time_s: float
    worker: str
    weights_version: str = ""


class RouterStats(msgspec.Struct, frozen=True):
    """What the router knows beyond its workers' loads (GET /stats): the prefix index's blocks
    per location, each worker's KV event counts (applied, stale, gaps, resyncs, snapshots,
    undecodable) and the Conductor's counters (accepted, rejected_*)."""

    backend: str
    mode: str
    policy: str
    index_blocks: dict[str, int]
    kv_events: dict[str, EventStats]
    conductor: dict[str, int]


@dataclass(frozen=True, slots=True)
class _Prefilled:
    """A PD prefill stage's outcome: its one event and the hand-over for the decode stage."""

    event: TokenEvent
    handover: Handover | None


class Router:
    """Places requests on workers and streams their tokens back (see the module).

    Args:
        workers: the workers; the mode decides which roles are allowed.
        config / conductor: the router's and the Conductor's settings (the live router's
            defaults, `ROUTER_CONDUCTOR`).
        clock: timestamps and the Conductor's `now`.
        backend: reaches the workers (None: tsukimi workers, a `WorkerClient`).

    Raises:
        ConfigError: no workers, or roles that fit no mode (or not the one asked for).
    """

    def __init__(
        self,
        workers: Sequence[WorkerSpec],
        config: RouterConfig | None = None,
        conductor: ConductorConfig | None = None,
        clock: Clock | None = None,
        backend: RouterBackend | None = None,
    ) -> None:
        self.config = cfg = config or RouterConfig()
        self.mode = _resolve_mode(cfg.mode, workers)
        self.clock: Clock = clock or WallClock()
        self.backend: RouterBackend = backend or WorkerClient(
            self.clock, cfg.connect_timeout_s, cfg.read_timeout_s, cfg.poll_interval_s
        )
        self.policy = _resolve_policy(cfg.policy, self.mode, self.backend.colocated_conductor)
        self.index = PrefixIndex()
        self.conductor: Conductor | None = None
        self.block_tokens = cfg.block_tokens
        self._conductor_config = conductor or ROUTER_CONDUCTOR
        self._workers = {w.name: WorkerHandle(w) for w in workers}
        # NOTE: the baselines' picks, one per role (a round robin's turn is its own role's)
        self._picks = {role: make_router(self.policy) for role in ROLES} if self.policy != "conductor" else {}
        self._liveness = Liveness(self.backend, self.clock, cfg.poll_interval_s)
        self._poller: asyncio.Task[None] | None = None
        self._feed: IndexFeed | None = None
        self._lock = asyncio.Lock()
        self._ids = itertools.count()
        self._running_prefills: dict[str, dict[int, list[BlockHash]]] = {}  # worker -> rid -> its block keys
        self._dispatches: dict[str, asyncio.Semaphore] = {}  # prefill worker -> its prompts in flight
        self.decisions = DecisionLog()  # every request's placement, by the client's id
        self._waits = ReleaseWaits(self.clock)  # requests queued for decode KV memory
        self._running: set[str] = set()  # the client ids of the requests in flight

    async def start(self) -> None:
        """Discovers the workers (retrying for `startup_timeout_s`; those still silent are
        marked down), builds the Conductor and the prefix index's feed, and starts polling
        loads. Idempotent; mutates.

        Raises:
            ConfigError: a worker reports another role than declared, or the workers disagree
                on block_tokens (or with `router.block_tokens`).
        """
        async with self._lock:
            if self._poller is not None:
                return
            cfg, workers = self.config, list(self._workers.values())
            try:
                await self._liveness.discover(workers, cfg.startup_timeout_s)
                self.conductor = self._build_conductor() if self.policy == "conductor" else None
                if self.conductor is not None or self.mode == "pd":  # NOTE: the prefix index is read
                    self.block_tokens = self.block_tokens if self.conductor else self._agreed_block_tokens()
                    self._feed = IndexFeed(self.index, self.block_tokens, self.backend.pooled, cfg.connect_timeout_s)
                    self._feed.start(workers)
                await self._probe_overhead()
            except BaseException:
                await self.close()
                raise
            polls = self._liveness.poll_forever(workers, self._refresh_cost)
            self._poller = asyncio.create_task(polls, name="router-load-poller")
            logger.info(
                "router started in %s mode (%s) over %d %s workers",
                self.mode,
                self.policy,
                len(self._workers),
                self.backend.kind,
            )

    async def close(self) -> None:
        """Stops polling and closes the connections (idempotent; mutates)."""
        try:
            if self._poller is not None:
                self._poller.cancel()
                # NOTE: a poller that died (a worker restarted with another role: ConfigError) re-raises here
                with contextlib.suppress(asyncio.CancelledError):
                    await self._poller
        finally:
            try:
                await self.backend.aclose()
            finally:
                if self._feed is not None:
                    await self._feed.close()
                self._poller = self._feed = None

    async def update_weights(
        self, request: UpdateWeightsRequest, secret: bytes | None
    ) -> dict[str, UpdateWeightsReply | TsukimiError]:
        """Update every worker's weights at once (see the module); each worker's reply or error.
        Mutates the prefix index.

        Raises:
            InvalidArgument: the backend's workers take no live weight update.
        """
        await self.start()
        if not isinstance(self.backend, WeightUpdates):
            raise InvalidArgument(f"{self.backend.kind} workers take no live weight update")
        outcome = await self.backend.update_weights(list(self._workers.values()), request, secret)
        for name, result in outcome.items():
            if isinstance(result, UpdateWeightsReply):
                self.index.drop_location(location(name, self.backend.tier))
        if any(isinstance(r, UpdateWeightsReply) for r in outcome.values()):
            self.index.drop_location(location(POOL, "dram"))
        return outcome

    def workers(self) -> list[WorkerStatus]:
        """The workers' health and loads as last seen (pure)."""
        return [w.status() for w in self._workers.values()]

    def stats(self) -> RouterStats:
        """The index's size, the KV events' counts and the Conductor's counters (pure)."""
        feed = self._feed.instances if self._feed is not None else {}
        return RouterStats(
            self.backend.kind,
            self.mode,
            self.policy,
            {loc: self.index.num_blocks(loc) for loc in self.index.locations()},
            {name: events.stats for name, events in feed.items()},
            dict(self.conductor.counters) if self.conductor is not None else {},
        )

    def generate(self, request: GenerateRequest, request_id: str = "") -> AsyncGenerator[TokenEvent, None]:
        """The request's tokens as the workers stream them; close the iterator early (aclose)
        to abort. Starts the router if needed. Its decision is logged under `request_id` (the
        client's; "" = `request.request_id`).

        Raises (from the iterator):
            DuplicateRequest: a request of the same id is running. Rejected: the Conductor turned
            it away, or every worker's queue is full. The error a
            worker reported, as its class (InvalidArgument, DuplicateRequest, ...).
            WorkerUnavailable / WorkerError: see the module.
        """
        return self._logged(request_id or request.request_id, request)

    async def _logged(self, key: str, request: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        """The request's events, its decision logged under `key` (the client's id), with what
        they reused and why none came. One request per key at a time: another one arriving
        while it runs is a DuplicateRequest (409), whatever worker either would run on, and
        leaves the running one's record alone."""
        if key in self._running:
            raise DuplicateRequest(f"request {key!r} ({request.request_id}) is already running")
        record = self.decisions.open(key, self.clock.now(), self.mode, len(request.prompt_ids))
        stages = self._generate_pd if self.mode == "pd" else self._generate_colocated
        self._running.add(key)
        started = False
        try:
            async with contextlib.aclosing(stages(request, record)) as events:
                async for event in events:
                    started = True
                    record.reused(event.cached_tokens, event.pool_tokens)
                    yield event
        except Rejected as exc:
            record.rejected(exc.reason, exc.detail)
            raise
        except WorkerUnavailable as exc:
            if not started:
                record.rejected("no_instance", str(exc))
            raise
        finally:
            self._running.discard(key)

    # -- colocated ----------------------------------------------------------------------

    async def _generate_colocated(
        self, request: GenerateRequest, record: DecisionRecord
    ) -> AsyncGenerator[TokenEvent, None]:
        await self.start()
        rid, attempts = next(self._ids), PLACEMENT.start(self.clock)
        keys = self._keys(request) if self.conductor is not None else []
        tried: dict[str, WorkerUnavailable] = {}
        while True:
            worker = await self._place(rid, request, keys, record, tried)
            booked, started = self.conductor is not None, False
            try:
                async with contextlib.aclosing(self._events(worker, request, "whole")) as events:
                    async for event in events:
                        if booked:  # NOTE: the Conductor books a colocated worker until its first token
                            self._free_prefill(rid)
                            booked = False
                        started = True
                        yield event
                return
            except WorkerUnavailable as exc:
                # NOTE: nothing was generated there, so another worker may take it.
                if started or not await attempts.wait_async(exc):
                    raise
                worker.healthy, tried[worker.spec.name] = False, exc
            finally:
                if booked:
                    self._free_prefill(rid)

    # -- PD -------------------------------------------------------------------------------

    async def _generate_pd(self, request: GenerateRequest, record: DecisionRecord) -> AsyncGenerator[TokenEvent, None]:
        await self.start()
        conductor, rid, prompt = self.conductor, next(self._ids), request.prompt_ids
        arrived_s, keys = self.clock.now(), self._keys(request)
        prefilled = await self._place_and_prefill(rid, request, keys, record)
        first = prefilled.event
        if first.finish_reason == "stop" or len(first.token_ids) >= request.max_tokens:
            if conductor is not None:
                self._free_prefill(rid)
            yield dataclasses.replace(first, finish_reason=first.finish_reason or "length")
            return
        try:
            decode, generated = await self._admit_decode(rid, arrived_s, record), len(first.token_ids)
        except TsukimiError:
            record.decode = ""  # NOTE: the arrival's plan; it never got there
            raise
        record.decode = decode.spec.name
        follow = msgspec.structs.replace(  # NOTE: on the first token's weights (a live update may intervene)
            request,
            prompt_ids=(*prompt, *first.token_ids),
            max_tokens=request.max_tokens - generated,
            weights_version=first.weights_version,
        )
        try:
            yield dataclasses.replace(first, finish_reason=None)
            stream = self._events(decode, follow, "decode", prefilled.handover)
            async with contextlib.aclosing(stream) as events:
                async for event in events:
                    generated += len(event.token_ids)
                    # NOTE: the decode worker loads the prompt's KV from the pool too: its pool
                    # tokens add to the prefill's; the cached ones are the prefill's
                    yield dataclasses.replace(
                        event, cached_tokens=first.cached_tokens, pool_tokens=first.pool_tokens + event.pool_tokens
                    )
        finally:
            if conductor is not None:
                conductor.decode_finished(rid, self.clock.now(), generated)
                self._wake()

    async def _place_and_prefill(
        self, rid: int, request: GenerateRequest, keys: list[BlockHash], record: DecisionRecord
    ) -> _Prefilled:
        """Places the request and runs its prefill stage, placing it again while the chosen
        prefill worker turns out unreachable; records what the index expected it to reuse."""
        attempts = PLACEMENT.start(self.clock)
        tried: dict[str, WorkerUnavailable] = {}
        while True:
            prefill = await self._place(rid, request, keys, record, tried)
            name = prefill.spec.name
            running = self._running_prefills.setdefault(name, {})
            record.expect(
                expected_reuse(
                    self.index,
                    name,
                    keys,
                    len(request.prompt_ids),
                    self.block_tokens,
                    list(running.values()),
                    self.backend.tier,
                    self.backend.pooled,
                )
            )
            running[rid] = keys
            try:
                async with self._dispatch(name):
                    return await self._prefill(prefill, request)
            except WorkerUnavailable as exc:
                self._free_prefill(rid)
                prefill.healthy, tried[name] = False, exc
                if not await attempts.wait_async(exc):
                    raise
            except BaseException:
                self._free_prefill(rid)
                raise
            finally:
                running.pop(rid, None)

    async def _admit_decode(self, rid: int, arrived_s: float, record: DecisionRecord) -> WorkerHandle:
        """The decode worker the request goes to (the Conductor admits it, or the pick). A
        request whose decode batch would break the TBT SLO now waits for a place in it (before
        its first token is sent) while the Conductor predicts its TTFT to meet the SLO, and no
        longer than the TTFT SLO from its arrival (`arrived_s`); `record` notes the wait.

        Raises:
            Rejected: the Conductor turned it away now, or it waited past its deadline.
            WorkerUnavailable: every decode worker is down.
        """
        down = {name for name, w in self._workers.items() if not w.healthy}
        conductor = self.conductor
        if conductor is None:
            return self._pick_worker("decode", down)
        name = conductor.admit_decode(rid, self.clock.now(), down, wait=True)
        if isinstance(name, Decision) and name.accepted:
            waited_since, deadline_s = self.clock.now(), arrived_s + conductor.config.ttft_slo_s
            name = (await self._waits.wait_at_decode(conductor, name, deadline_s)).decode
            record.waited_at_decode(self.clock.now() - waited_since)
        if not isinstance(name, str):
            self._wake()
            if all(w.spec.name in down for w in self._workers.values() if w.spec.role == "decode"):
                raise WorkerUnavailable("no decode worker is reachable: all are marked down")
            raise Rejected("rejected_at_decode", name.message if name is not None else "")  # the counter's name
        return self._workers[name]

    def _dispatch(self, name: str) -> contextlib.AbstractAsyncContextManager[object]:
        """`router.prefill_concurrency`: at most that many prompts in flight to prefill worker
        `name`, sent in the order the Conductor booked them (a FIFO wait here). The Conductor
        prices its queue as served in that order; a worker handed the whole burst at once
        serves it in the order its HTTP requests happen to land, and its first-booked request
        may come last (0: no limit). NOTE: tsukimi workers only: a vLLM instance batches the
        prompts it is given into its steps, which a limit here would starve."""
        limit = self.config.prefill_concurrency
        if not limit or self.conductor is None or self.backend.kind != "tsukimi":
            return contextlib.nullcontext()
        return self._dispatches.setdefault(name, asyncio.Semaphore(limit))

    async def _prefill(self, worker: WorkerHandle, request: GenerateRequest) -> _Prefilled:
        """Runs the prefill stage (one token) to its end: one event with all its tokens, and
        its hand-over for the decode stage."""
        # NOTE: the stream runs to its end (or raises), so nothing is left to close
        staged = [chunk async for chunk in self._stage(worker, request, "prefill")]
        chunks = [s.chunk for s in staged]
        event = TokenEvent(
            tuple(t for c in chunks for t in c.token_ids),
            chunks[-1].finish_reason,
            max(c.cached_tokens for c in chunks),
            max(c.pool_tokens for c in chunks),
            self.clock.now(),
            worker.spec.name,
            chunks[-1].weights_version,
        )
        return _Prefilled(event, next((s.handover for s in staged if s.handover is not None), None))

    # -- placement ------------------------------------------------------------------------

    async def _place(
        self,
        rid: int,
        request: GenerateRequest,
        keys: list[BlockHash],
        record: DecisionRecord,
        tried: dict[str, WorkerUnavailable],
    ) -> WorkerHandle:
        """The worker that computes the prompt: the Conductor's (waiting while it is queued for
        decode KV memory), or the baseline's pick. Mutates the Conductor's bookings.

        Raises:
            Rejected: the Conductor turned it away, or every worker's queue is full.
            WorkerUnavailable: no worker that could take it is reachable.
        """
        self._check_queues()
        conductor = self.conductor
        if conductor is None:
            worker = self._pick_worker("colocated" if self.mode == "colocated" else "prefill", tried)
            record.picked(worker.spec.name)
            return worker
        deadline_s = self.clock.now() + conductor.config.ttft_slo_s  # NOTE: a queued request waits no longer
        scheduled = ScheduleRequest(rid, len(request.prompt_ids), keys, request.max_tokens)
        while True:
            down = excluded(self._workers.values(), request)  # NOTE: and the CPP groups when sampling
            decision = conductor.schedule(scheduled, self.clock.now(), down)
            record.placed(decision)
            if not decision.accepted:
                if decision.reason == "no_instance":
                    raise WorkerUnavailable("no prefill or decode worker is reachable: all are marked down")
                raise Rejected(decision.reason, decision.message)
            if decision.queued:  # NOTE: placed once its decode KV memory frees; None: to be scheduled again
                forbidden = functools.partial(excluded, self._workers.values(), request)
                if (released := await self._waits.wait(conductor, decision, deadline_s, forbidden)) is None:
                    continue
                decision = released
                record.placed(decision)
            assert decision.prefill is not None
            return self._workers[decision.prefill]

    def _pick_worker(self, role: str, skip: dict[str, WorkerUnavailable] | set[str]) -> WorkerHandle:
        """The baseline's pick among the reachable workers of `role` not in `skip` (pure but
        for the round robin's turn). Raises WorkerUnavailable when there is none."""
        candidates = [w for w in self._workers.values() if w.spec.role == role and w.healthy and w.name not in skip]
        if not candidates:
            why = "; ".join(str(e) for e in skip.values()) if isinstance(skip, dict) else ""
            raise WorkerUnavailable(f"no {role} worker is reachable: {why or 'all are marked down'}")
        loads = [max(w.in_flight, w.load.waiting + w.load.running) for w in candidates]
        return candidates[self._picks[role].route(loads)]

    def _check_queues(self) -> None:
        """Raises Rejected("queue_full") when every reachable worker that could take the prompt
        has more than `max_waiting_requests` waiting or in flight (0: no limit)."""
        limit = self.config.max_waiting_requests
        first = ("colocated",) if self.mode == "colocated" else ("prefill",)
        up = [w for w in self._workers.values() if w.healthy and w.spec.role in first]
        if limit and up and all(w.load.waiting + w.in_flight > limit for w in up):
            raise Rejected("queue_full", f"every worker has more than {limit} requests waiting")

    def _keys(self, request: GenerateRequest) -> list[BlockHash]:
        return self.backend.block_keys(request.prompt_ids, self.block_tokens)

    async def _probe_overhead(self) -> None:
        """`router.overhead_probe`: one block's prompt, one token, through the prefill worker the
        Conductor picks; how late its first token came against the engine-time prediction is
        the prior of the per-job prefill term (a failed probe leaves it at 0, with a warning)."""
        conductor = self.conductor
        if conductor is None or conductor.service is None or self.mode != "pd" or not self.config.overhead_probe:
            return
        if self.backend.kind != "tsukimi":  # NOTE: in a vLLM instance the probe would be a real prompt in its
            return  # cache, the pool and the index; the term is learned from its own prefills there
        rid, start = next(self._ids), self.clock.now()
        request = GenerateRequest(f"tsukimi-overhead-probe-{rid}", tuple(range(1, self.block_tokens + 1)), 1)
        decision = conductor.schedule(
            ScheduleRequest(rid, len(request.prompt_ids), [], 1), start, excluded(self._workers.values(), request)
        )
        if not decision.accepted or decision.queued or decision.prefill is None:
            conductor.cancel(rid)
            return
        try:
            async with asyncio.timeout(self.config.read_timeout_s):
                await self._prefill(self._workers[decision.prefill], request)
            late = self.clock.now() - (start + decision.ttft_s)
            # NOTE: one probe cannot tell how much of it a prefill worker spends serially: all of
            # it is taken as serial (it then delays the queue too), the safe side for the SLO;
            # the probe's own end is the term's first error as well (it expires, the prior stays)
            conductor.service.prior_s = min(conductor.service.cap_s, max(0.0, late))
            logger.info("a request spends %.3f s outside engine steps (the start-up probe)", late)
        except (TsukimiError, TimeoutError) as exc:
            logger.warning("the start-up probe of the per-request TTFT term failed: %s", exc)
        finally:
            conductor.finished_at_prefill(rid, self.clock.now())

    def _free_prefill(self, rid: int) -> None:
        """The Conductor's booking of `rid` ends at its prefill (mutates)."""
        if self.conductor is not None:
            self.conductor.finished_at_prefill(rid, self.clock.now())
            self._wake()

    def _wake(self) -> None:
        """Decode KV memory may have freed: release the requests queued for it."""
        if self.conductor is not None:
            self._waits.wake(self.conductor, {name for name, w in self._workers.items() if not w.healthy})

    async def _events(
        self, worker: WorkerHandle, request: GenerateRequest, stage: Stage, handover: Handover | None = None
    ) -> AsyncGenerator[TokenEvent, None]:
        """One worker's stream of a stage as TokenEvents."""
        async with contextlib.aclosing(self._stage(worker, request, stage, handover)) as chunks:
            async for staged in chunks:
                chunk = staged.chunk
                yield TokenEvent(
                    tuple(chunk.token_ids),
                    chunk.finish_reason,
                    chunk.cached_tokens,
                    chunk.pool_tokens,
                    self.clock.now(),
                    worker.spec.name,
                    chunk.weights_version,
                )

    async def _stage(
        self, worker: WorkerHandle, request: GenerateRequest, stage: Stage, handover: Handover | None = None
    ) -> AsyncGenerator[StageChunk, None]:
        """The backend's stream of a stage, counted in the worker's `in_flight`."""
        worker.in_flight += 1
        worker.requests += 1
        try:
            async with contextlib.aclosing(self.backend.stream(worker, request, stage, handover)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            worker.in_flight -= 1

    def _refresh_cost(self) -> None:
        """After each poll: the Conductor's estimates follow the workers' reports (worker_costs.py)."""
        if self.conductor is not None and isinstance(self.conductor.cost, WorkerCostModel):
            self.conductor.cost.refresh(self._workers.values())

    def _agreed_block_tokens(self) -> int:
        """The block size the workers agree on (or the Conductor config's when none reports one).
        Raises ConfigError when they disagree."""
        seen = {w.block_tokens for w in self._workers.values() if w.block_tokens > 0} | {self.block_tokens} - {0}
        if len(seen) > 1:
            raise ConfigError(f"the workers (and router.block_tokens) disagree on block_tokens: {sorted(seen)}")
        if not seen:
            logger.warning("no worker reported block_tokens; using conductor.block_tokens")
        return seen.pop() if seen else self._conductor_config.block_tokens

    def _build_conductor(self) -> Conductor:
        """Builds the Conductor over the workers, once they agree on block_tokens."""
        self.block_tokens = self._agreed_block_tokens()  # NOTE: its capacity counts in blocks
        # NOTE: each decode worker's own KV memory (its polled total_blocks), unless the config sets one for all
        fixed = self.config.decode_capacity_tokens
        roles = ("prefill", "decode") if self.mode == "pd" else ("colocated", "colocated")
        capacity = {
            w.spec.name: fixed or w.load.total_blocks * self.block_tokens or DEFAULT_DECODE_CAPACITY_TOKENS
            for w in self._workers.values()
            if w.spec.role == roles[1]
        }
        config = dataclasses.replace(self._conductor_config, block_tokens=self.block_tokens)
        if (
            not self.backend.pooled
        ):  # NOTE: no pool: a worker reuses its own cache only, "global" would count on fetches
            config = dataclasses.replace(config, reuse="local")
        names = {role: [w.spec.name for w in self._workers.values() if w.spec.role == role] for role in ROLES}
        groups = conductor_groups(self._workers.values())  # NOTE: priced with the pipeline estimate
        cost = conductor_cost(self.config, self._workers.values())  # NOTE: the workers' profiles, or the config's
        conductor = Conductor(
            config, cost, self.index, names[roles[0]], names[roles[1]], capacity, self.backend.tier, groups=groups
        )
        conductor.service = ServiceTerm()  # NOTE: learned from each prefill's end (its first token)
        return conductor


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


def _resolve_policy(
    policy: str, mode: str, colocated_conductor: bool
) -> Literal["conductor", "least_load", "round_robin"]:
    """What "auto" means here: the Conductor in pd mode, and in colocated mode when the
    backend's workers feed its index; else least_load.

    Raises:
        ConfigError: least_load in pd mode (before round_robin existed as a PD baseline, pd
            ignored the policy; a config spelling least_load would silently lose the Conductor).
    """
    if policy == "auto":
        return "conductor" if mode == "pd" or colocated_conductor else "least_load"
    if policy == "least_load" and mode == "pd":
        raise ConfigError(
            "router.policy least_load places colocated workers; in pd mode choose auto or conductor (the "
            "Conductor), or round_robin (a baseline without it)"
        )
    assert policy in ("conductor", "least_load", "round_robin")
    return policy  # type: ignore[return-value]
