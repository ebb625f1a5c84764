"""`VllmBackend`: the Conductor over vLLM API servers, the state behind `tsukimi router
--backend vllm` (the HTTP side is tsukimi/integrations/vllm/proxy.py).

    prompt tokens -> VllmBlockHasher (vLLM's own block hashes) -> Conductor.schedule
        colocated: the instance with the lowest estimated TTFT (queue + prefill of the
                   tokens no cache holds + transfer from the pool), or 429
        pd:        the prefill instance so chosen; after its one-token prefill,
                   Conductor.admit_decode names the decode instance, or 429

The prefix index is fed by each instance's KV events (kv_events.py), so it holds exactly
what vLLM reports cached (and, with `pool`, every block some instance stored is assumed to
be in tsukimi's KV pool: the TsukimiConnector saves every full block there). Loads: the
Conductor's own bookings (corrected by when prefills really end) plus each instance's
/metrics (requests running and waiting, KV cache usage), polled; an instance whose /metrics
cannot be read is marked down and not placed on until it answers again.

Runs on one asyncio event loop (the Conductor and the index are not thread-safe).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import httpx
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from tsukimi.clock import Clock, WallClock
from tsukimi.config import ConductorConfig, Role, RouterConfig
from tsukimi.errors import ConfigError, Rejected, WorkerUnavailable
from tsukimi.integrations.vllm.block_hash import VllmBlockHasher, VllmHashConfig
from tsukimi.integrations.vllm.kv_events import EventSource, EventSubscriber, InstanceEvents
from tsukimi.scheduler.conductor import Conductor, ScheduleRequest
from tsukimi.scheduler.prefix_index import PrefixIndex
from tsukimi.serving.kv_events import stop_subscribers
from tsukimi.serving.router.router import cost_model

logger = logging.getLogger(__name__)

POOL_LOCATION = "pool/dram"
_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
}


@dataclass(frozen=True, slots=True)
class VllmInstance:
    """One vLLM API server: its name, role, base URL and KV event publisher (None: no events)."""

    name: str
    role: Role
    url: str
    events: EventSource | None = None


@dataclass(frozen=True, slots=True)
class VllmRouterConfig:
    """hash: how the instances hash blocks. pool: they share tsukimi's KV pool (TsukimiConnector).
    policy: "conductor" (Algorithm 1) or "round_robin" (the baseline). max_waiting_requests:
    429 "queue_full" when every instance has more waiting (0: no limit). poll_interval_s:
    /metrics polling. connect_timeout_s / read_timeout_s: calls to the instances."""

    hash: VllmHashConfig = field(default_factory=VllmHashConfig)
    pool: bool = False
    policy: Literal["conductor", "round_robin"] = "conductor"
    max_waiting_requests: int = 0
    poll_interval_s: float = 0.5
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.policy not in ("conductor", "round_robin"):
            raise ConfigError(f"vllm policy must be conductor or round_robin, got {self.policy!r}")


@dataclass(slots=True)
class InstanceState:
    """What the router knows of one instance: polled gauges, health and its own requests."""

    spec: VllmInstance
    healthy: bool = True  # NOTE: optimistic until a poll says otherwise
    polled: bool = False  # its /metrics answered at least once
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    in_flight: int = 0
    events: InstanceEvents | None = None


@dataclass(slots=True)
class Placement:
    """Where one request runs: the instance computing its prompt, the decode instance (PD,
    once admitted), its block keys and the Conductor's expectation of cached tokens."""

    request_id: int
    prefill: InstanceState
    prompt_tokens: int
    cached_tokens: int
    decode: InstanceState | None = None
    booked: bool = True
    notes: dict[str, object] = field(default_factory=dict)


class VllmBackend:
    """The Conductor and the prefix index over vLLM instances (see the module).

    Raises:
        ConfigError: no instance, duplicate names, or roles that are neither all colocated
            nor prefill + decode.
    """

    def __init__(
        self,
        instances: Sequence[VllmInstance],
        config: VllmRouterConfig | None = None,
        router: RouterConfig | None = None,
        conductor: ConductorConfig | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.config = config or VllmRouterConfig()
        roles = {i.role for i in instances}
        if roles not in ({"colocated"}, {"prefill", "decode"}):
            raise ConfigError(f"vLLM instances must be all colocated, or prefill and decode; got {sorted(roles)}")
        if len({i.name for i in instances}) != len(instances):
            raise ConfigError("duplicate vLLM instance names")
        self.mode = "colocated" if roles == {"colocated"} else "pd"
        self.clock: Clock = clock or WallClock()
        self.hasher = VllmBlockHasher(self.config.hash)
        self.index = PrefixIndex()
        self.instances = {i.name: InstanceState(i) for i in instances}
        pool = POOL_LOCATION if self.config.pool else None
        for state in self.instances.values():
            state.events = InstanceEvents(self.index, state.spec.name, self.hasher.block_size, pool)
        base = conductor or ConductorConfig()
        # NOTE: without the pool a vLLM instance can reuse only its own cache: "global" would
        # let the Conductor count on fetching another instance's blocks, which nothing does.
        cfg = dataclasses.replace(
            base, block_tokens=self.hasher.block_size, reuse=base.reuse if self.config.pool else "local"
        )
        prefill = [i.name for i in instances if i.role in ("prefill", "colocated")]
        decode = [i.name for i in instances if i.role in ("decode", "colocated")]
        self.conductor = Conductor(
            cfg, cost_model(router or RouterConfig()), self.index, prefill, decode, 1 << 40, "hbm"
        )
        self._ids, self._rr = itertools.count(), itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self._zmq: zmq.asyncio.Context | None = None
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.config.read_timeout_s, connect=self.config.connect_timeout_s)
        )

    async def start(self) -> None:
        """Subscribes to every instance's events and starts polling loads (idempotent; mutates)."""
        if self._tasks:
            return
        self._zmq = zmq.asyncio.Context()
        for state in self.instances.values():
            if state.spec.events is not None and state.events is not None:
                sub = EventSubscriber(state.events, state.spec.events, self._zmq)
                self._tasks.append(asyncio.create_task(sub.run(), name=f"kv-events-{state.spec.name}"))
        self._tasks.append(asyncio.create_task(self._poll_forever(), name="vllm-load-poller"))
        logger.info("vLLM router (%s, %s) over %d instances", self.mode, self.config.policy, len(self.instances))

    async def close(self) -> None:
        """Stops the subscribers and the poller, closes the connections (idempotent; mutates)."""
        await stop_subscribers(self._tasks, self._zmq)
        self._zmq = None
        await self.client.aclose()

    # -- placement ---------------------------------------------------------------------------

    def place(self, tokens: Sequence[int]) -> Placement:
        """Chooses the instance that computes the prompt `tokens` (mutates the bookings).

        Raises:
            WorkerUnavailable: every instance of a needed role is down.
            Rejected: the Conductor's SLO check, or every instance's queue is full.
        """
        down = {name for name, s in self.instances.items() if not s.healthy}
        limit = self.config.max_waiting_requests
        if limit and all(s.waiting + s.in_flight > limit for s in self._up(("prefill", "colocated"))):
            raise Rejected("queue_full")
        rid = next(self._ids)
        if self.config.policy == "round_robin":
            up = self._up(("prefill", "colocated"))
            if not up:
                raise WorkerUnavailable("no vLLM instance is reachable: all are marked down")
            return Placement(rid, up[next(self._rr) % len(up)], len(tokens), 0, booked=False)
        blocks = self.hasher.keys(tokens)
        decision = self.conductor.schedule(ScheduleRequest(rid, max(1, len(tokens)), blocks), self.clock.now(), down)
        if not decision.accepted:
            if decision.reason == "no_instance":
                raise WorkerUnavailable("no vLLM instance is reachable: all are marked down")
            raise Rejected(decision.reason)
        assert decision.prefill is not None
        logger.debug(
            "request %d -> %s (%d cached tokens expected, TTFT %.3f s)",
            rid,
            decision.prefill,
            decision.cached_tokens,
            decision.ttft_s,
        )
        return Placement(rid, self.instances[decision.prefill], len(tokens), decision.cached_tokens)

    def prefill_done(self, placement: Placement) -> InstanceState | None:
        """The prompt is computed (first token out). Colocated: frees the booking, returns
        None. PD: the decode instance the Conductor admits it to (mutates).

        Raises:
            Rejected / WorkerUnavailable: PD, no decode instance takes it now.
        """
        now = self.clock.now()
        if self.mode == "colocated":
            if placement.booked:
                placement.booked = False
                self.conductor.finished_at_prefill(placement.request_id, now)
            return None
        if not placement.booked:  # round robin over PD: any decode instance, in turn
            up = self._up(("decode",))
            if not up:
                raise WorkerUnavailable("no vLLM decode instance is reachable")
            placement.decode = up[next(self._rr) % len(up)]
            return placement.decode
        down = {name for name, s in self.instances.items() if not s.healthy}
        name = self.conductor.admit_decode(placement.request_id, now, down)
        if name is None:
            placement.booked = False
            if not self._up(("decode",)):
                raise WorkerUnavailable("no vLLM decode instance is reachable: all are marked down")
            raise Rejected("rejected_at_decode")
        placement.decode = self.instances[name]
        return placement.decode

    def finished(self, placement: Placement, output_tokens: int) -> None:
        """The request left the cluster, normally or not (mutates; safe to call once more)."""
        if not placement.booked:
            return
        placement.booked = False
        if self.mode == "colocated" or placement.decode is None:
            self.conductor.finished_at_prefill(placement.request_id, self.clock.now())
        else:
            self.conductor.decode_finished(placement.request_id, self.clock.now(), output_tokens)

    def _up(self, roles: tuple[str, ...]) -> list[InstanceState]:
        return [s for s in self.instances.values() if s.healthy and s.spec.role in roles]

    # -- loads -------------------------------------------------------------------------------

    async def poll_once(self) -> None:
        """Reads every instance's /metrics once; marks the unreachable ones down (mutates)."""
        await asyncio.gather(*(self._poll(state) for state in self.instances.values()))

    async def _poll_forever(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.config.poll_interval_s)

    async def _poll(self, state: InstanceState) -> None:
        try:
            response = await self.client.get(f"{state.spec.url}/metrics", timeout=self.config.connect_timeout_s + 1)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            if state.healthy:
                logger.warning("vLLM instance %s is unreachable (%s): marked down", state.spec.name, exc)
            state.healthy = False
            return
        values = {name: 0.0 for name in _GAUGES.values()}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                if sample.name in _GAUGES:
                    values[_GAUGES[sample.name]] += sample.value
        state.running, state.waiting, state.kv_usage = values["running"], values["waiting"], values["kv_usage"]
        state.polled = True
        if not state.healthy:
            logger.info("vLLM instance %s answers again", state.spec.name)
        state.healthy = True

    def stats(self) -> dict[str, object]:
        """The instances' loads and event counts and the index's size (pure), for /stats."""
        out: dict[str, object] = {
            "mode": self.mode,
            "policy": self.config.policy,
            "index_blocks": {loc: self.index.num_blocks(loc) for loc in self.index.locations()},
        }
        out["instances"] = {
            name: {
                "role": s.spec.role,
                "healthy": s.healthy,
                "running": s.running,
                "waiting": s.waiting,
                "kv_usage": s.kv_usage,
                "in_flight": s.in_flight,
                "events": dataclasses.asdict(s.events.stats) if s.events else None,
            }
            for name, s in self.instances.items()
        }
        out["counters"] = dict(self.conductor.counters)
        return out
