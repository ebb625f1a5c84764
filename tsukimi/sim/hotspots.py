"""Hot-spot replication in the simulator, and the skewed workload that shows what it is for.

`HotReplicator` watches every arriving request (`tsukimi.scheduler.hotspots.HotSpots`): when
its prefix is hot, the prefill instances `HotSpots.targets` names get a replica of it,
copied from the pool at the KV bandwidth (off their compute: the copy lands in their DRAM
cache while they keep prefilling). With contended links (tsukimi/sim/links.py) a copy is
read from the holder of the prefix with the fewest transfers in flight and shares its link
with that holder's other transfers. The replicas are ordinary cache entries afterwards, so an
instance that stops using them evicts them first (LRU). The Conductor then sees several
instances holding the prefix and spreads its requests over them.

`skewed_trace` builds the issue's workload: most requests share one long system prompt
(which changes every `phase_s`, as a popular prompt comes and goes), the others are
unique, at a rate above one prefill instance's capacity. With `ramp_s` > 0 a new prompt's
popularity ramps up: over its first `ramp_s` seconds it takes the shared requests over from the
previous prompt linearly, so one instance computes and holds it well before others need it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tsukimi.quantiles import quantile
from tsukimi.scheduler.conductor import Conductor
from tsukimi.scheduler.cost_model import CostModel
from tsukimi.scheduler.hotspots import HotSpotConfig, HotSpots
from tsukimi.sim.instances import BlockCache, Job
from tsukimi.sim.links import SourceLinks
from tsukimi.sim.trace import BLOCK_SIZE_TOKENS, TraceRequest

REPLICA_LANDED = 3  # the simulator's event kind of a replica landing in a cache


class HotReplicator:
    """Replicates hot prefixes into prefill instances' caches (see the module). Mutates the
    caches (and through them the prefix index) when replicas land."""

    def __init__(
        self,
        config: HotSpotConfig,
        caches: dict[str, BlockCache],
        conductor: Conductor,
        cost: CostModel,
        push: Callable[[float, int, object], None],
        links: SourceLinks | None = None,
    ) -> None:
        """`push(at, kind, payload)` schedules a simulator event; `caches` by instance name;
        `links`: copies share their source's link (None: each gets the KV bandwidth)."""
        self.spots = HotSpots(config)
        self.links = links
        self.caches, self.conductor, self.cost, self.push = caches, conductor, cost, push
        self._locations = {name: cache.loc for name, cache in caches.items()}
        self._in_flight: set[tuple[str, int]] = set()  # (instance, last block of the prefix)
        self.num_replicas = 0
        self.replicated_tokens = 0
        self._now = 0.0  # the last arrival's time: hotness is judged as of then
        if config.evict_hot_last:
            for cache in caches.values():
                cache.hot = self._is_hot

    def _is_hot(self, block: int) -> bool:
        return self.spots.is_hot(block, self._now)

    def on_arrival(self, job: Job, now: float) -> None:
        """Count `job`'s blocks; start copies of its hot prefix to the instances that should
        hold it (mutates: schedules REPLICA_LANDED events)."""
        self._now = now
        hot = self.spots.observe(job.blocks, now)
        if not hot:
            return
        blocks = tuple(job.blocks[:hot])
        index, cfg = self.conductor.index, self.conductor.config
        targets = self.spots.targets(index, blocks, self._locations, lambda n: self.conductor.prefill_queue_s(n, now))
        tokens = min(hot * cfg.block_tokens, job.input_tokens)
        for name in targets:
            if (name, blocks[-1]) in self._in_flight:
                continue
            self._in_flight.add((name, blocks[-1]))
            self._copy(name, blocks, tokens, now)
            self.num_replicas += 1
            self.replicated_tokens += tokens

    def _copy(self, name: str, blocks: tuple[int, ...], tokens: int, now: float) -> None:
        """Start copying `blocks` (`tokens` of KV) to `name`: REPLICA_LANDED when they arrive."""
        links = self.links
        if links is None:
            landed = now + self.cost.transfer_s(tokens, self.conductor.config.kv_bandwidth_bytes_s)
            self.push(landed, REPLICA_LANDED, (name, blocks))
            return
        index = self.conductor.index
        holders = [loc for loc in self._locations.values() if index.match_at(loc, blocks) == len(blocks)]
        source = min(holders, key=lambda loc: (links.active(loc), loc))
        num_bytes = tokens * self.cost.kv_bytes_per_token
        links.start(source, num_bytes, now, lambda t: self.push(t, REPLICA_LANDED, (name, blocks)))

    def landed(self, payload: object) -> None:
        """A replica arrived in its instance's cache (mutates the cache and the index)."""
        assert isinstance(payload, tuple)
        name, blocks = payload
        self._in_flight.discard((name, blocks[-1]))
        self.caches[name].access(blocks)


@dataclass(frozen=True, slots=True)
class SkewedWorkload:
    """requests at `rate_rps` (Poisson); a `shared` fraction start with the current system
    prompt of `prefix_blocks` blocks (a new one every `phase_s`), then `suffix_blocks`
    unique blocks; the others are `unique_blocks` unique blocks. Blocks of 512 tokens.
    `ramp_s`: a shared request `t` seconds into a phase uses the previous phase's prompt with
    probability 1 - t / ramp_s (0: none)."""

    requests: int = 2000
    rate_rps: float = 12.0
    shared: float = 0.9
    prefix_blocks: int = 16
    suffix_blocks: int = 2
    unique_blocks: int = 8
    output_tokens: int = 64
    phase_s: float = 30.0
    seed: int = 0
    ramp_s: float = 0.0
    prompts: int = 1


def skewed_trace(workload: SkewedWorkload) -> list[TraceRequest]:
    """The requests of `workload`, deterministic for its seed (pure)."""
    rng = random.Random(workload.seed)
    ids = iter(range(1, 1 << 62))
    prompts: dict[tuple[int, int], list[int]] = {}
    out: list[TraceRequest] = []
    t_s = 0.0
    for _ in range(workload.requests):
        t_s += rng.expovariate(workload.rate_rps)
        phase = int(t_s // workload.phase_s)
        if rng.random() < workload.shared:
            if workload.ramp_s > 0 and phase > 0 and rng.random() > (t_s % workload.phase_s) / workload.ramp_s:
                phase -= 1  # NOTE: the new prompt's popularity is still ramping up
            key = (phase, rng.randrange(workload.prompts)) if workload.prompts > 1 else (phase, 0)
            prefix = prompts.setdefault(key, [next(ids) for _ in range(workload.prefix_blocks)])
            blocks = prefix + [next(ids) for _ in range(workload.suffix_blocks)]
        else:
            blocks = [next(ids) for _ in range(workload.unique_blocks)]
        out.append(
            TraceRequest(int(t_s * 1000), len(blocks) * BLOCK_SIZE_TOKENS, workload.output_tokens, tuple(blocks))
        )
    return out


def p90_ttft_s(jobs: Sequence[Job]) -> float:
    """The 90th percentile TTFT of the jobs that got a first token (pure)."""
    return quantile((j.first_token_s - j.arrival_s for j in jobs if j.first_token_s >= 0), 0.9)
