"""The Conductor: Mooncake's KVCache-centric global scheduler (the paper's Algorithm 1).

For each request it estimates, for every prefill instance, the time to first token:

    TTFT(p) = queue(p) + min( prefill(uncached after p's local prefix),
                              transfer(the longer prefix held elsewhere) + prefill(uncached after it) )

takes the instance with the lowest, picks the decode instance with the lowest predicted
time between tokens among those within the SLO and their KV memory, and rejects the request
when no choice meets the SLOs. The fetch option is considered only when the remote prefix is
at least `balancing_threshold` times the local one, and only with `reuse = "global"`; the
fetched blocks then stay in the chosen instance's cache, so a hot prefix spreads to the
instances that use it (hot-spot replication). A prefix found on an SSD tier
(`location(name, "ssd")`) is loaded at the SSD's read bandwidth (`fetch_bandwidth_bytes_s`);
an instance's own SSD is considered in either reuse mode. With `links` (an object telling the
transfers in flight from a source), a source's bandwidth is shared: a fetch from a source with
n transfers in flight is estimated at 1/(n + 1) of it, and among sources holding equally long
prefixes the least loaded is preferred (the simulator's fair-share links, tsukimi/sim/links.py).

Rejection modes (`ConductorConfig.rejection`):

- none: everything is admitted; decode goes to the least loaded instance.
- baseline: TTFT is checked at arrival; the decode load only when prefill is done
  (`admit_decode`), so a request rejected there wasted its prefill.
- early: the current decode load is checked at arrival too.
- predicted: at arrival, the decode load is predicted for the moment the request would
  reach decode: each request in decode now counts with the probability that it is still
  there then, and each accepted request due there before then with the probability that it
  has not left yet, both from the distribution of observed decode-stage lengths (the
  paper's system-level prediction; tsukimi/scheduler/load_prediction.py).
- predicted_uniform: the paper's prediction as written (arXiv v3, Section 7.4): every decode
  stage is assumed to last the same time (the mean observed), requests in decode and due
  there are counted at the moment the request would reach decode, and the request is rejected
  when the average ratio of predicted TBT to the TBT SLO over all decode instances exceeds 1
  (a system-level load, not the chosen instance's).

A plain object over a clock the caller passes in (`now`): the simulator and the live router
drive the same code. Not thread-safe.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tsukimi.config import ConductorConfig
from tsukimi.errors import InvalidArgument
from tsukimi.scheduler.cost_model import CostModel, chunked_prefill_s
from tsukimi.scheduler.cpp import CppGroup
from tsukimi.scheduler.load_prediction import DecodeLoad, DecodeStagePredictor, expected_load, uniform_load
from tsukimi.scheduler.prefix_index import PrefixIndex, location

logger = logging.getLogger(__name__)

_INITIAL_OUTPUT_TOKENS = 256.0  # assumed mean output length until requests finish


@dataclass(frozen=True, slots=True)
class ScheduleRequest:
    """What the Conductor knows of a request: its prompt length and block hashes."""

    request_id: int
    input_tokens: int
    blocks: Sequence[int]


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request runs (or why not). Times are estimates in seconds.

    local_blocks: prefix blocks reused from the prefill instance's own cache;
    fetch_from / fetch_blocks: a location holding a longer prefix (another instance's cache,
    or this instance's own SSD tier) and how many more blocks come from it (they stay in the
    prefill instance's DRAM afterwards).
    """

    request_id: int
    accepted: bool
    reason: str = ""
    prefill: str | None = None
    decode: str | None = None
    local_blocks: int = 0
    fetch_from: str | None = None
    fetch_blocks: int = 0
    cached_tokens: int = 0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    ttft_s: float = 0.0
    tbt_s: float = 0.0


class SourceLoad(Protocol):
    """How busy the link of a KV source (a location) is: its transfers in flight, O(1)."""

    def active(self, source: str) -> int: ...


@dataclass(slots=True)
class _PrefillLoad:
    free_at: float = 0.0  # when its queue drains, by the estimates corrected by `shift`
    shift: float = 0.0  # how much later than booked the queue runs (the last finished job's error)
    jobs: dict[int, float] = field(default_factory=dict)  # request id -> end as booked (never shifted)


class Conductor:
    """Places requests on prefill and decode instances (see the module).

    Args:
        config: SLOs, rejection mode, thresholds, bandwidth.
        cost: the cost model of the instances (all alike).
        index: where blocks are cached; instance caches are `location(name, tier)`.
        prefill / decode: instance names; decode_capacity_tokens: KV tokens a decode
            instance holds.
        tier: the tier of the instances' own caches in the index.
        groups: prefill instances that are CPP groups (tsukimi/scheduler/cpp.py), priced with
            the pipeline's estimate: the Conductor sends them the prompts they serve fastest.
        links: the transfers in flight per source, for contention-aware fetch estimates
            (None: every fetch gets the whole bandwidth).
    """

    def __init__(
        self,
        config: ConductorConfig,
        cost: CostModel,
        index: PrefixIndex,
        prefill: Sequence[str],
        decode: Sequence[str],
        decode_capacity_tokens: int,
        tier: str = "dram",
        groups: Mapping[str, CppGroup] | None = None,
        *,
        links: SourceLoad | None = None,
    ) -> None:
        if not prefill or not decode:
            raise InvalidArgument("the Conductor needs at least one prefill and one decode instance")
        self.config, self.cost, self.index, self.links = config, cost, index, links
        self.groups = dict(groups or {})
        self._prefill = {name: _PrefillLoad() for name in sorted(prefill)}
        self._decode = {name: DecodeLoad(decode_capacity_tokens) for name in sorted(decode)}
        self._local = {name: location(name, tier) for name in self._prefill}  # type: ignore[arg-type]
        self._ssd = {name: location(name, "ssd") for name in self._prefill}
        self._requests: dict[int, tuple[str, str, int]] = {}  # id -> (prefill, decode, input tokens)
        self._stages = DecodeStagePredictor(config.decode_estimate_s)
        self._output_sum, self._output_n = 0.0, 0
        self.counters: Counter[str] = Counter()
        self._exclude: Container[str] = ()  # instances the current call must not pick

    # -- decisions ----------------------------------------------------------------------

    def schedule(self, request: ScheduleRequest, now: float, exclude: Container[str] = ()) -> Decision:
        """Place `request` arriving at `now` (mutates: books the instances on acceptance).
        Instances in `exclude` (e.g. down) are not considered; with none left the decision is
        a rejection with reason "no_instance"."""
        if request.input_tokens <= 0:
            raise InvalidArgument(f"request {request.request_id}: input_tokens must be > 0")
        self._exclude = exclude
        if all(name in exclude for name in self._prefill) or all(name in exclude for name in self._decode):
            self.counters["rejected_no_instance"] += 1
            return Decision(request.request_id, False, "no_instance")
        best = self._best_prefill(request, now)
        cfg = self.config
        if cfg.rejection != "none" and best.ttft_s > cfg.ttft_slo_s:
            return self._reject(best, "ttft_slo")
        mode = cfg.rejection
        forecast = mode if mode in ("predicted", "predicted_uniform") else "now"
        decode, tbt_s, problem = self._best_decode(request.input_tokens, now, now + best.ttft_s, forecast)
        if mode in ("early", "predicted", "predicted_uniform") and problem:
            return self._reject(best, problem)
        decision = _replace(best, decode=decode, tbt_s=tbt_s)
        self._book(decision, request, now)
        self.counters["accepted"] += 1
        return decision

    def admit_decode(self, request_id: int, now: float, exclude: Container[str] = ()) -> str | None:
        """Prefill of `request_id` is done: the decode instance it goes to, or None when it is
        rejected now (when no instance meets the TBT SLO: "baseline" always, "early" and the
        predicted modes with `recheck_decode`; any mode when every decode instance is in
        `exclude`). Mutates."""
        prefill, _, tokens = self._requests[request_id]
        self._prefill_done(prefill, request_id, now)
        for load in self._decode.values():
            load.incoming.pop(request_id, None)
        self._exclude = exclude
        if all(name in exclude for name in self._decode):
            del self._requests[request_id]
            self.counters["rejected_no_instance"] += 1
            return None
        chosen, _, problem = self._best_decode(tokens, now, now, "now")
        mode = self.config.rejection
        if problem and (mode == "baseline" or (mode != "none" and self.config.recheck_decode)):
            del self._requests[request_id]
            self.counters["rejected_at_decode"] += 1
            return None
        self._decode[chosen].active[request_id] = (now, tokens)
        self._decode[chosen].active_tokens += tokens
        self._requests[request_id] = (prefill, chosen, tokens)
        return chosen

    def finished_at_prefill(self, request_id: int, now: float) -> None:
        """Prefill of `request_id` produced its only output token: it never reaches decode."""
        prefill, _, _ = self._requests.pop(request_id)
        self._prefill_done(prefill, request_id, now)
        for load in self._decode.values():
            load.incoming.pop(request_id, None)

    def decode_finished(self, request_id: int, now: float, output_tokens: int) -> None:
        """The request left its decode instance (mutates the load and the estimates)."""
        _, decode, _ = self._requests.pop(request_id)
        joined, tokens = self._decode[decode].active.pop(request_id)
        self._decode[decode].active_tokens -= tokens
        self._stages.observe(now - joined)
        self._output_sum += output_tokens
        self._output_n += 1

    def prefill_queue_s(self, name: str, now: float) -> float:
        """The estimated wait before a new job would start on prefill instance `name`."""
        return max(0.0, self._prefill[name].free_at - now)

    # -- internals ----------------------------------------------------------------------

    def _best_prefill(self, request: ScheduleRequest, now: float) -> Decision:
        cfg = self.config
        matches = self.index.match(request.blocks) if request.blocks else {}
        # NOTE: the longest prefixes held anywhere: an instance cannot fetch from its own
        # caches (DRAM and SSD), so the third is the best another may fetch from.
        # With links, equally long prefixes are ranked by their source's load.
        busy = self.links.active if self.links is not None else _no_load
        ranked = sorted(matches.items(), key=lambda i: (-i[1], busy(i[0]), i[0]))[:3] if cfg.reuse == "global" else []
        cost, block, chunk = self.cost, cfg.block_tokens, cfg.prefill_chunk_tokens
        tokens = request.input_tokens
        best: Decision | None = None
        prefill_s: dict[tuple[int, CppGroup | None], float] = {}  # instances share most estimates

        def compute_s(cached: int, group: CppGroup | None = None) -> float:
            key, new = (cached, group), tokens - cached
            if key not in prefill_s:
                if group is None:
                    prefill_s[key] = chunked_prefill_s(cost, new, cached, chunk)
                else:
                    prefill_s[key] = group.prefill_s(cost, new, cached, chunk)
            return prefill_s[key]

        for name, load in self._prefill.items():
            if name in self._exclude:
                continue
            queue_s = max(0.0, load.free_at - now)
            local_loc = self._local[name]
            local = matches.get(local_loc, 0)
            cached = _cached_tokens(local, block, tokens)
            group = self.groups.get(name)
            option: tuple[float, float, str | None, int, int] = (compute_s(cached, group), 0.0, None, 0, cached)
            own_ssd = self._ssd[name]
            sources = [(own_ssd, matches.get(own_ssd, 0))]  # NOTE: its own SSD tier counts as local
            remote = next(((loc, n) for loc, n in ranked if loc not in (local_loc, own_ssd)), None)
            if remote is not None and remote[1] >= cfg.balancing_threshold * local:
                sources.append(remote)
            for source, held in sources:
                if held <= local:
                    continue
                fetched = _cached_tokens(held, block, tokens)
                bandwidth = fetch_bandwidth_bytes_s(cfg, source, own_ssd) / (1 + busy(source))
                transfer_s = cost.transfer_s(fetched - cached, bandwidth)
                fetched_s = compute_s(fetched, group)
                if transfer_s + fetched_s < option[0] + option[1]:
                    option = (fetched_s, transfer_s, source, held - local, fetched)
            ttft_s = queue_s + option[0] + option[1]
            if best is None or ttft_s < best.ttft_s:
                fetch_from, fetch_blocks = option[2], option[3]
                best = Decision(
                    request.request_id, True, prefill=name, local_blocks=local, fetch_from=fetch_from,
                    fetch_blocks=fetch_blocks, cached_tokens=option[4], queue_s=queue_s, prefill_s=option[0],
                    transfer_s=option[1], ttft_s=ttft_s,
                )  # fmt: skip
        assert best is not None
        return best

    def _best_decode(self, input_tokens: int, now: float, at: float, forecast: str) -> tuple[str, float, str]:
        """(the instance with the lowest TBT among those with room in their KV memory, or with
        the most room when none has enough; that TBT; "" when it meets the SLO, else why not:
        "tbt_slo" / "kv_memory") for the load now (`forecast` "now") or the load predicted for
        time `at` ("predicted": survival; "predicted_uniform": the paper's, where the SLO test
        is on the average TBT ratio over the instances)."""
        mean_out = self._output_sum / self._output_n if self._output_n else _INITIAL_OUTPUT_TOKENS
        best: tuple[float, float, str, float] | None = None  # (no room, tbt, name, tbt without it): lowest wins
        stage_s = self._stages.mean_s
        total_s, instances = 0.0, 0
        for name, load in self._decode.items():
            if name in self._exclude:
                continue
            without_s = 0.0
            if forecast == "now":
                count, context = float(len(load.active)), float(load.active_tokens)
            elif forecast == "predicted":
                count, context = expected_load(load, self._stages, now, at)
            else:
                count, context = uniform_load(load, at, stage_s)
                without_s = self.cost.decode_step_s(round(count), int(context + count * mean_out / 2))
                total_s, instances = total_s + without_s, instances + 1
            context += count * mean_out / 2
            overflow = max(0.0, context + input_tokens + mean_out - load.capacity_tokens)
            tbt_s = self.cost.decode_step_s(round(count) + 1, int(context + input_tokens + mean_out / 2))
            if best is None or (overflow, tbt_s) < best[:2]:
                best = (overflow, tbt_s, name, without_s)
        assert best is not None
        overflow, tbt_s, name, without_s = best
        slo = self.config.tbt_slo_s
        # NOTE: predicted_uniform tests the system's average, with the request on its instance.
        system_s = (total_s - without_s + tbt_s) / instances if forecast == "predicted_uniform" else tbt_s
        over = system_s > slo
        return name, tbt_s, "kv_memory" if overflow else ("tbt_slo" if over else "")

    def _book(self, decision: Decision, request: ScheduleRequest, now: float) -> None:
        assert decision.prefill is not None and decision.decode is not None
        load = self._prefill[decision.prefill]
        start = max(load.free_at, now)
        load.free_at = start + decision.prefill_s + decision.transfer_s
        load.jobs[request.request_id] = load.free_at - load.shift
        self._decode[decision.decode].incoming[request.request_id] = (now + decision.ttft_s, request.input_tokens)
        self._requests[request.request_id] = (decision.prefill, decision.decode, request.input_tokens)

    def _prefill_done(self, name: str, request_id: int, now: float) -> None:
        load = self._prefill[name]
        booked_end = load.jobs.pop(request_id, now)
        if not load.jobs:
            load.free_at, load.shift = now, 0.0
            return
        # NOTE: FIFO: the jobs behind this one now run `error` later than booked; free_at
        # already carries the previous error, so only the change is applied.
        error = now - booked_end
        load.free_at += error - load.shift
        load.shift = error

    def _reject(self, best: Decision, reason: str) -> Decision:
        self.counters[f"rejected_{reason}"] += 1
        return _replace(best, accepted=False, reason=reason)


def fetch_bandwidth_bytes_s(config: ConductorConfig, source: str, own_ssd: str) -> float:
    """The rate at which a prefill instance whose SSD tier is `own_ssd` loads KV held at
    `source`: its own SSD's read bandwidth, another instance's SSD at the lower of that and the
    network's, any DRAM at the network's; pure."""
    if source == own_ssd:
        return config.ssd_read_bytes_s
    if source.endswith("/ssd"):
        return min(config.ssd_read_bytes_s, config.kv_bandwidth_bytes_s)
    return config.kv_bandwidth_bytes_s


def _no_load(source: str) -> int:
    return 0


def _cached_tokens(blocks: int, block_tokens: int, input_tokens: int) -> int:
    """Tokens covered by `blocks` prefix blocks; at least one token is always computed."""
    return max(0, min(blocks * block_tokens, input_tokens - 1))


def _replace(decision: Decision, **changes: object) -> Decision:
    return dataclasses.replace(decision, **changes)  # type: ignore[arg-type]
