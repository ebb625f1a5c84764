"""The discrete-event simulator: replays a Mooncake trace through simulated instances under a
virtual clock, with the same Conductor, prefix index and eviction policies as the live system.

Two cluster shapes:

- "pd" (Mooncake): prefill instances, each with a DRAM block cache and optionally an SSD
  tier below it (together they form the KV pool the Conductor indexes), and decode
  instances; the Conductor places every request.
- "colocated" (the vLLM-like baseline): instances that prefill and decode in one batch, each
  with its own prefix cache only, routed round-robin or to the least loaded.

The main loop pops the next event (an arrival, a prefill finishing, a KV transfer landing),
first brings every decode instance up to that time, then handles it. Deterministic: no
randomness, and ties in time are broken by event order.

With `contention`, KV transfers (prefix fetches, hot replicas, prefill-to-decode pushes) share
their source's link (tsukimi/sim/links.py) instead of each getting the whole bandwidth, and
the Conductor's estimates see each source's transfers in flight.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tsukimi.config import SIMULATOR_CONDUCTOR, ConductorConfig, SimConfig
from tsukimi.eviction import make_policy
from tsukimi.scheduler.baselines import make_router
from tsukimi.scheduler.conductor import Conductor, Decision, ScheduleRequest, fetch_bandwidth_bytes_s
from tsukimi.scheduler.cost_model import CostModel, RooflineCostModel, chunked_prefill_s
from tsukimi.scheduler.hotspots import HotSpotConfig
from tsukimi.scheduler.prefix_index import PrefixIndex, location
from tsukimi.sim.hotspots import REPLICA_LANDED, HotReplicator
from tsukimi.sim.instances import BlockCache, ColocatedInstance, DecodeInstance, Job
from tsukimi.sim.links import LINK_DONE, SourceLinks
from tsukimi.sim.reservation import ReservationPolicy
from tsukimi.sim.trace import TraceRequest

WAKE = 6  # event kind: time passes for the requests waiting for KV memory


@dataclass(slots=True)
class SimResult:
    """Every request's job (times filled in as far as it got), how rejected ones ended, and
    decode batch sizes over time per instance."""

    jobs: list[Job]
    rejected: dict[int, str] = field(default_factory=dict)  # request id -> reason
    samples: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    end_s: float = 0.0
    kv_bytes_per_token: int = 0
    preemptions: int = 0
    queued: dict[int, float] = field(default_factory=dict)  # request id -> its TTFT predicted when it queued


def simulate(
    trace: Sequence[TraceRequest],
    sim: SimConfig,
    conductor: ConductorConfig | None = None,
    cost: CostModel | None = None,
    progress: Callable[[int], None] | None = None,
    hot: HotSpotConfig | None = None,
    contention: bool = False,
) -> SimResult:
    """Replay `trace` through the cluster `sim` describes; pure apart from `progress`
    (called with the number of requests that arrived so far). `hot`: replicate hot prefixes
    into prefill instances' caches (PD only; tsukimi/sim/hotspots.py). `contention`: KV
    transfers share their source's link (PD only; tsukimi/sim/links.py)."""
    cost = cost or RooflineCostModel()
    jobs = [
        Job(i, r.timestamp_ms / 1000 / sim.speed, r.input_length, max(1, r.output_length), r.hash_ids)
        for i, r in enumerate(trace)
    ]
    runner = (
        _PdRun(sim, conductor or SIMULATOR_CONDUCTOR, cost, hot, contention)
        if sim.shape == "pd"
        else _ColocatedRun(sim, cost)
    )
    result = runner.run(jobs, progress)
    result.kv_bytes_per_token = cost.kv_bytes_per_token
    return result


class _PdRun:
    def __init__(
        self,
        sim: SimConfig,
        cfg: ConductorConfig,
        cost: RooflineCostModel | CostModel,
        hot: HotSpotConfig | None,
        contention: bool = False,
    ) -> None:
        self.sim, self.cfg, self.cost = sim, cfg, cost
        self.index = PrefixIndex()
        self.prefill = [f"prefill-{i}" for i in range(sim.num_prefill)]
        node_tokens = cost.kv_capacity_tokens() if isinstance(cost, RooflineCostModel) else 1 << 40
        capacity = sim.decode_kv_tokens or node_tokens
        self.caches = {name: self._cache(name) for name in self.prefill}
        self.queues: dict[str, deque[tuple[Job, Decision]]] = {name: deque() for name in self.prefill}
        self.busy: dict[str, bool] = dict.fromkeys(self.prefill, False)
        self.reservation = _reservation(sim)
        self.decode = {
            f"decode-{i}": DecodeInstance(
                f"decode-{i}", cost, capacity, self._finished, sim.sample_every_s, self.reservation
            )
            for i in range(sim.num_decode)
        }
        self.events: list[tuple[float, int, int, object]] = []
        self.seq = itertools.count()
        self.links = SourceLinks(self._link_bytes_s, self._push) if contention else None
        self.conductor = Conductor(cfg, cost, self.index, self.prefill, list(self.decode), capacity, links=self.links)
        self.result = SimResult([])
        self.waiting: dict[int, Job] = {}  # queued for KV memory or the TBT SLO (ConductorConfig.kv_wait)
        self.waiting_at_decode: dict[int, tuple[str, Job]] = {}  # prefilled, queued for the TBT SLO: (prefill, job)
        self.wake_at = float("inf")  # the pending WAKE event, if any
        self.hot = HotReplicator(hot, self.caches, self.conductor, cost, self._push, self.links) if hot else None

    def _link_bytes_s(self, source: str) -> float:
        """A KV source's link: an SSD tier reads at the SSD's bandwidth, a DRAM at the NIC's."""
        return self.cfg.ssd_read_bytes_s if source.endswith("/ssd") else self.cfg.kv_bandwidth_bytes_s

    def _cache(self, name: str) -> BlockCache:
        """`name`'s DRAM cache, over an SSD tier when the cluster has one."""
        sim, index = self.sim, self.index
        ssd = (
            BlockCache(location(name, "ssd"), sim.ssd_blocks, make_policy(sim.policy), index)
            if sim.ssd_blocks
            else None
        )
        return BlockCache(location(name, "dram"), sim.cache_blocks, make_policy(sim.policy), index, ssd)

    def run(self, jobs: list[Job], progress: Callable[[int], None] | None) -> SimResult:
        self.result.jobs = jobs
        for job in jobs:
            self._push(job.arrival_s, 0, job)
        arrived = 0
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            for instance in self.decode.values():
                instance.advance(now)
            if kind == 0:
                assert isinstance(payload, Job)
                self._arrive(payload, now)
                arrived += 1
                if progress is not None and arrived % 500 == 0:
                    progress(arrived)
            elif kind == REPLICA_LANDED:
                assert self.hot is not None
                self.hot.landed(payload)
            elif kind == LINK_DONE:
                assert self.links is not None
                self.links.fire(payload, now)
            elif kind == WAKE:
                self.wake_at = float("inf")
            else:
                assert isinstance(payload, tuple)
                instance_name, job = payload
                if kind == 1:
                    self._prefill_done(instance_name, job, now)
                else:
                    self.decode[instance_name].join(job, now)
            if self.waiting or self.waiting_at_decode:
                self._release(now)
        for instance in self.decode.values():
            instance.advance(float("inf"))
            self.result.end_s = max(self.result.end_s, instance.now)
        self.result.samples = {name: inst.samples for name, inst in self.decode.items()}
        self.result.preemptions = sum(inst.preemptions for inst in self.decode.values())
        return self.result

    def _push(self, at: float, kind: int, payload: object) -> None:
        heapq.heappush(self.events, (at, next(self.seq), kind, payload))

    def _arrive(self, job: Job, now: float) -> None:
        decision = self.conductor.schedule(ScheduleRequest(job.request_id, job.input_tokens, job.blocks), now)
        if self.hot is not None:
            self.hot.on_arrival(job, now)
        if not decision.accepted:
            self.result.rejected[job.request_id] = decision.reason
            return
        if decision.queued:  # NOTE: it starts when `_release` finds its KV memory
            self.waiting[job.request_id] = job
            self.result.queued[job.request_id] = decision.ttft_s
            return
        self._enqueue(job, decision, now)

    def _enqueue(self, job: Job, decision: Decision, now: float) -> None:
        assert decision.prefill is not None
        self.queues[decision.prefill].append((job, decision))
        if not self.busy[decision.prefill]:
            self._start_prefill(decision.prefill, now)

    def _release(self, now: float) -> None:
        """Starts the queued requests the Conductor places now (KV memory found, the TBT SLO
        met; one waiting at decode goes there); while some still wait, a WAKE event every TBT
        SLO keeps time moving (decode instances advance on events)."""
        for decision in self.conductor.release(now):
            if decision.request_id in self.waiting_at_decode:
                assert decision.decode is not None
                prefill, job = self.waiting_at_decode.pop(decision.request_id)
                self._to_decode(prefill, decision.decode, job, now)
            else:
                self._enqueue(self.waiting.pop(decision.request_id), decision, now)
        if (self.waiting or self.waiting_at_decode) and self.wake_at == float("inf"):
            self.wake_at = now + self.cfg.tbt_slo_s
            self._push(self.wake_at, WAKE, None)

    def _start_prefill(self, name: str, now: float) -> None:
        """Start the next queued job on `name`, with the prefix actually cached now."""
        if not self.queues[name]:
            self.busy[name] = False
            return
        job, decision = self.queues[name].popleft()
        self.busy[name] = True
        block = self.cfg.block_tokens
        local = self.index.match_at(self.caches[name].loc, job.blocks)
        fetched = self.index.match_at(decision.fetch_from, job.blocks) if decision.fetch_from else 0
        job.cached_tokens = max(0, min(max(local, fetched) * block, job.input_tokens - 1))
        job.fetch_tokens = max(0, job.cached_tokens - max(0, min(local * block, job.input_tokens - 1)))
        job.compute_s = chunked_prefill_s(
            self.cost, job.input_tokens - job.cached_tokens, job.cached_tokens, self.cfg.prefill_chunk_tokens
        )
        job.prefill_start_s = now
        job.instances = (name,)
        bandwidth = self.cfg.kv_bandwidth_bytes_s
        if decision.fetch_from is not None:
            bandwidth = fetch_bandwidth_bytes_s(self.cfg, decision.fetch_from, location(name, "ssd"))
            job.ssd_tokens = job.fetch_tokens if decision.fetch_from.endswith("/ssd") else 0
        if self.links is not None and decision.fetch_from is not None:
            fetch_bytes = job.fetch_tokens * self.cost.kv_bytes_per_token
            self.links.start(
                decision.fetch_from, fetch_bytes, now, lambda t: self._push(t + job.compute_s, 1, (name, job))
            )
            return
        duration = self.cost.transfer_s(job.fetch_tokens, bandwidth) + job.compute_s
        self._push(now + duration, 1, (name, job))

    def _prefill_done(self, name: str, job: Job, now: float) -> None:
        job.first_token_s = now
        self.caches[name].access(job.blocks)
        if job.output_tokens <= 1:  # its only token came from prefill: nothing to decode
            self.conductor.finished_at_prefill(job.request_id, now)
            job.finish_s = now
            self._start_prefill(name, now)
            return
        decode = self.conductor.admit_decode(job.request_id, now, wait=True)
        if isinstance(decode, Decision) and decode.accepted:  # NOTE: it waits for a place in the decode batch
            self.waiting_at_decode[job.request_id] = (name, job)
        elif decode is None or isinstance(decode, Decision):
            self.result.rejected[job.request_id] = "decode_overloaded"
        else:
            self._to_decode(name, decode, job, now)
        self._start_prefill(name, now)

    def _to_decode(self, prefill: str, decode: str, job: Job, now: float) -> None:
        """Sends a prefilled job's KV to its decode instance, where it joins when it lands."""
        job.instances = (prefill, decode)
        if self.links is not None:  # NOTE: the KV leaves through the prefill instance's NIC
            push_bytes = job.input_tokens * self.cost.kv_bytes_per_token
            self.links.start(location(prefill, "dram"), push_bytes, now, lambda t: self._push(t, 2, (decode, job)))
        else:
            landed = now + self.cost.transfer_s(job.input_tokens, self.cfg.kv_bandwidth_bytes_s)
            self._push(landed, 2, (decode, job))

    def _finished(self, job: Job, now: float) -> None:
        self.conductor.decode_finished(job.request_id, now, job.output_tokens)
        if self.reservation is not None:
            self.reservation.observe(job.output_tokens)


class _ColocatedRun:
    def __init__(self, sim: SimConfig, cost: CostModel) -> None:
        self.sim, self.cost = sim, cost
        self.index = PrefixIndex()
        capacity = cost.kv_capacity_tokens() if isinstance(cost, RooflineCostModel) else 1 << 40
        self.reservation = _reservation(sim)
        self.instances = [self._instance(f"colocated-{i}", capacity) for i in range(sim.num_colocated)]
        self.router = make_router(sim.router)

    def _instance(self, name: str, capacity: int) -> ColocatedInstance:
        cache = BlockCache(location(name, "dram"), self.sim.cache_blocks, make_policy(self.sim.policy), self.index)
        return ColocatedInstance(
            name,
            self.cost,
            capacity,
            self._finished,
            self.sim.sample_every_s,
            self.reservation,
            cache=cache,
            chunk_tokens=self.sim.colocated_chunk_tokens,
            on_first_token=_ignore,
        )

    def run(self, jobs: list[Job], progress: Callable[[int], None] | None) -> SimResult:
        for n, job in enumerate(jobs, 1):
            for instance in self.instances:
                instance.advance(job.arrival_s)
            instance = self.instances[self.router.route([i.load for i in self.instances])]
            job.instances = (instance.name,)
            instance.submit(job, job.arrival_s)
            if progress is not None and n % 500 == 0:
                progress(n)
        end = 0.0
        for instance in self.instances:
            instance.advance(float("inf"))
            end = max(end, instance.now)
        preemptions = sum(i.preemptions for i in self.instances)
        return SimResult(jobs, {}, {i.name: i.samples for i in self.instances}, end, preemptions=preemptions)

    def _finished(self, job: Job, now: float) -> None:
        if self.reservation is not None:
            self.reservation.observe(job.output_tokens)


def _ignore(job: Job, now: float) -> None:
    return None


def _reservation(sim: SimConfig) -> ReservationPolicy | None:
    return None if sim.reservation == "oracle" else ReservationPolicy(sim.reservation, sim.max_output_tokens)
