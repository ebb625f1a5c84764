"""The Conductor: Mooncake's KVCache-centric global scheduler (the paper's Algorithm 1).

For each request it estimates, for every prefill instance, the time to first token:

    TTFT(p) = queue(p) + min( prefill(uncached after p's local prefix),
                              transfer(the longer prefix held elsewhere) + prefill(uncached after it) )

takes the instance with the lowest, picks the decode instance with the lowest predicted
time between tokens among those within the SLO and their KV memory, and rejects the request
when no choice meets the SLOs. The fetch option is considered only when the remote prefix is
at least `balancing_threshold` times the local one, and only with `reuse = "global"`; the
fetched blocks then stay in the chosen instance's cache, so a hot prefix spreads to the
instances that use it (hot-spot replication).

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

A plain object over a clock the caller passes in (`now`): the simulator and the live router
drive the same code. Not thread-safe.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field

from tsukimi.config import ConductorConfig
from tsukimi.errors import InvalidArgument
from tsukimi.scheduler.cost_model import CostModel, chunked_prefill_s
from tsukimi.scheduler.cpp import CppGroup
from tsukimi.scheduler.load_prediction import DecodeStagePredictor
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
    fetch_from / fetch_blocks: a location holding a longer prefix and how many more blocks
    come from it (they stay on the prefill instance afterwards).
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


@dataclass(slots=True)
class _PrefillLoad:
    free_at: float = 0.0  # when its queue drains, by the estimates corrected by `shift`
    shift: float = 0.0  # how much later than booked the queue runs (the last finished job's error)
    jobs: dict[int, float] = field(default_factory=dict)  # request id -> end as booked (never shifted)


@dataclass(slots=True)
class _DecodeLoad:
    capacity_tokens: int
    active: dict[int, tuple[float, int]] = field(default_factory=dict)  # id -> (joined at, context tokens)
    active_tokens: int = 0  # the sum of the active requests' context tokens
    incoming: dict[int, tuple[float, int]] = field(default_factory=dict)  # id -> (due at, context tokens)


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
    ) -> None:
        if not prefill or not decode:
            raise InvalidArgument("the Conductor needs at least one prefill and one decode instance")
        self.config, self.cost, self.index = config, cost, index
        self.groups = dict(groups or {})
        self._prefill = {name: _PrefillLoad() for name in sorted(prefill)}
        self._decode = {name: _DecodeLoad(decode_capacity_tokens) for name in sorted(decode)}
        self._local = {name: location(name, tier) for name in self._prefill}  # type: ignore[arg-type]
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
        at = now + best.ttft_s if mode == "predicted" else now
        decode, tbt_s, problem = self._best_decode(request.input_tokens, now, at if mode == "predicted" else None)
        if mode in ("early", "predicted") and problem:
            return self._reject(best, problem)
        decision = _replace(best, decode=decode, tbt_s=tbt_s)
        self._book(decision, request, now)
        self.counters["accepted"] += 1
        return decision

    def admit_decode(self, request_id: int, now: float, exclude: Container[str] = ()) -> str | None:
        """Prefill of `request_id` is done: the decode instance it goes to, or None when it is
        rejected now (modes other than "none", when no instance meets the TBT SLO; any mode
        when every decode instance is in `exclude`). Mutates."""
        prefill, _, tokens = self._requests[request_id]
        self._prefill_done(prefill, request_id, now)
        for load in self._decode.values():
            load.incoming.pop(request_id, None)
        self._exclude = exclude
        if all(name in exclude for name in self._decode):
            del self._requests[request_id]
            self.counters["rejected_no_instance"] += 1
            return None
        chosen, _, problem = self._best_decode(tokens, now, None)
        if problem and self.config.rejection != "none":
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
        # NOTE: the longest prefix held anywhere, and the runner-up for the location that
        # holds the longest itself (an instance cannot fetch from its own cache).
        ranked = sorted(matches.items(), key=lambda item: (-item[1], item[0]))[:2] if cfg.reuse == "global" else []
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
            remote = next(((loc, n) for loc, n in ranked if loc != local_loc), None)
            if remote is not None and remote[1] > local and remote[1] >= cfg.balancing_threshold * local:
                fetched = _cached_tokens(remote[1], block, tokens)
                transfer_s = cost.transfer_s(fetched - cached, cfg.kv_bandwidth_bytes_s)
                fetched_s = compute_s(fetched, group)
                if transfer_s + fetched_s < option[0]:
                    option = (fetched_s, transfer_s, remote[0], remote[1] - local, fetched)
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

    def _best_decode(self, input_tokens: int, now: float, at: float | None) -> tuple[str, float, str]:
        """(the instance with the lowest TBT among those with room in their KV memory, or with
        the most room when none has enough; that TBT; "" when it meets the SLO, else why not:
        "tbt_slo" / "kv_memory") for the load now, or predicted for time `at`."""
        mean_out = self._output_sum / self._output_n if self._output_n else _INITIAL_OUTPUT_TOKENS
        best: tuple[float, float, str] | None = None  # (no room, tbt, name): lowest wins
        for name, load in self._decode.items():
            if name in self._exclude:
                continue
            if at is None:
                count, context = float(len(load.active)), float(load.active_tokens)
            else:
                count, context = self._predicted(load, now, at)
            context += count * mean_out / 2
            overflow = max(0.0, context + input_tokens + mean_out - load.capacity_tokens)
            tbt_s = self.cost.decode_step_s(round(count) + 1, int(context + input_tokens + mean_out / 2))
            if best is None or (overflow, tbt_s) < best[:2]:
                best = (overflow, tbt_s, name)
        assert best is not None
        overflow, tbt_s, name = best
        return name, tbt_s, "kv_memory" if overflow else ("tbt_slo" if tbt_s > self.config.tbt_slo_s else "")

    def _predicted(self, load: _DecodeLoad, now: float, at: float) -> tuple[float, float]:
        """Expected (requests, their prompt tokens) in `load` at time `at`."""
        stages, horizon = self._stages, at - now
        count = context = 0.0
        for joined, tokens in load.active.values():
            p = stages.still_present(now - joined, horizon)
            count, context = count + p, context + p * tokens
        for due, tokens in load.incoming.values():
            if due <= at:
                p = stages.survival(at - due)
                count, context = count + p, context + p * tokens
        return count, context

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


def _cached_tokens(blocks: int, block_tokens: int, input_tokens: int) -> int:
    """Tokens covered by `blocks` prefix blocks; at least one token is always computed."""
    return max(0, min(blocks * block_tokens, input_tokens - 1))


def _replace(decision: Decision, **changes: object) -> Decision:
    return dataclasses.replace(decision, **changes)  # type: ignore[arg-type]
