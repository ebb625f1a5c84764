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

Queue, then reject (`kv_wait`, with "early" and the predicted modes): a request whose decode
placement lacks KV memory waits in a FIFO when its predicted TTFT, the wait for memory
included, meets the TTFT SLO, and only then is rejected (reason "ttft_slo", with a message
saying what was predicted); memory is a ledger of what each booked request holds
(tsukimi/scheduler/admission.py). `schedule` answers such a request with `queued`; the caller
calls `release(now)` after each event that frees memory (`decode_finished`,
`finished_at_prefill`, a rejection at `admit_decode`, `cancel`) and starts the requests it
returns; a request that stops waiting (its client left, its deadline passed) is `cancel`ed.

A plain object over a clock the caller passes in (`now`): the simulator and the live router
drive the same code. Not thread-safe.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, overload

from tsukimi.config import ConductorConfig
from tsukimi.errors import InvalidArgument
from tsukimi.scheduler.admission import KvLedger, QueuedRequest
from tsukimi.scheduler.cost_model import CostModel, chunked_prefill_s
from tsukimi.scheduler.cpp import CppGroup
from tsukimi.scheduler.decisions import Decision, ScheduleRequest, SourceLoad
from tsukimi.scheduler.load_prediction import DecodeLoad, DecodeStagePredictor
from tsukimi.scheduler.placement import DecodeForecast, best_decode, cached_tokens, fetch_bandwidth_bytes_s, no_load
from tsukimi.scheduler.prefix_index import PrefixIndex, location
from tsukimi.scheduler.service_term import ServiceTerm

__all__ = ["WAITING_MODES", "Conductor", "Decision", "ScheduleRequest", "SourceLoad", "fetch_bandwidth_bytes_s"]

logger = logging.getLogger(__name__)

_INITIAL_OUTPUT_TOKENS = 256.0  # assumed mean output length until requests finish
WAITING_MODES = ("early", "predicted", "predicted_uniform")  # the modes that check decode load at arrival


@dataclass(slots=True)
class _PrefillLoad:
    free_at: float = 0.0  # when its queue drains, by the estimates corrected by `shift`
    shift: float = 0.0  # how much later than booked the queue runs (the last finished job's error)
    jobs: dict[int, float] = field(default_factory=dict)  # request id -> end as booked (never shifted)
    started: dict[int, tuple[float, float]] = field(default_factory=dict)  # id -> (booked at, engine-time work)
    last_done: float = float("-inf")  # when its last job finished


class Conductor:
    """Places requests on prefill and decode instances (see the module).

    Args:
        config: SLOs, rejection mode, thresholds, bandwidth.
        cost: the cost model of the instances (all alike).
        index: where blocks are cached; instance caches are `location(name, tier)`.
        prefill / decode: instance names; decode_capacity_tokens: KV tokens a decode
            instance holds (one for all, or each instance's own by name).
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
        decode_capacity_tokens: int | Mapping[str, int],
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
        capacity = decode_capacity_tokens
        self._decode = {
            name: DecodeLoad(capacity if isinstance(capacity, int) else capacity[name]) for name in sorted(decode)
        }
        self._local = {name: location(name, tier) for name in self._prefill}  # type: ignore[arg-type]
        self._ssd = {name: location(name, "ssd") for name in self._prefill}
        self._requests: dict[int, tuple[str, str, int]] = {}  # id -> (prefill, decode, input tokens)
        self._arrived: dict[int, float] = {}  # id -> when it arrived (booked requests)
        # NOTE: the per-job term a prefill instance serves a prompt with beyond its engine time
        # (serialized: it delays the jobs queued behind), learned at each prefill's end; None
        # (the simulator's): its instances spend nothing outside the cost model's steps
        self.service: ServiceTerm | None = None
        self._stages = DecodeStagePredictor(config.decode_estimate_s or 1.0)
        self._kv = KvLedger(self._decode, self._stages, cost)
        self._released: list[Decision] = []
        self._waiting: dict[int, ScheduleRequest] = {}  # the queued requests
        self._output_sum, self._output_n = 0.0, 0
        self.counters: Counter[str] = Counter()
        self._exclude: Container[str] = ()  # instances the current call must not pick
        # NOTE: called with every decision `schedule` and `release` make, and its request (a log, a dashboard)
        self.on_decision: Callable[[Decision, ScheduleRequest], None] | None = None

    # -- decisions ----------------------------------------------------------------------

    def schedule(self, request: ScheduleRequest, now: float, exclude: Container[str] = ()) -> Decision:
        """Place `request` arriving at `now` (mutates: books the instances on acceptance).
        Instances in `exclude` (e.g. down) are not considered; with none left the decision is
        a rejection with reason "no_instance"."""
        decision = self._schedule(request, now, exclude)
        if self.on_decision is not None:
            self.on_decision(decision, request)
        return decision

    def _schedule(self, request: ScheduleRequest, now: float, exclude: Container[str]) -> Decision:
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
        if cfg.decode_estimate_s == 0 and not self._stages.observed:  # NOTE: no fixed prior: the cost model's
            self._stages.prior_s = max(1e-3, self._kv.cold_stage_s(self._output_reserve(request), exclude))
        decode, tbt_s, problem = self._best_decode(request.input_tokens, now, now + best.ttft_s, forecast)
        if cfg.kv_wait and mode in WAITING_MODES:
            return self._place_or_queue(request, _replace(best, decode=decode, tbt_s=tbt_s), now, problem)
        if mode in WAITING_MODES and problem:
            return self._reject(best, problem)
        decision = _replace(best, decode=decode, tbt_s=tbt_s)
        self._book(decision, request, now)
        self.counters["accepted"] += 1
        return decision

    @overload
    def admit_decode(
        self, request_id: int, now: float, exclude: Container[str] = (), *, wait: Literal[False] = False
    ) -> str | None: ...

    @overload
    def admit_decode(
        self, request_id: int, now: float, exclude: Container[str] = (), *, wait: bool
    ) -> str | Decision | None: ...

    def admit_decode(
        self, request_id: int, now: float, exclude: Container[str] = (), *, wait: bool = False
    ) -> str | Decision | None:
        """Prefill of `request_id` is done: the decode instance it goes to, or None when it is
        rejected now (when no instance meets the TBT SLO: "baseline" always, "early" and the
        predicted modes with `recheck_decode`; any mode when every decode instance is in
        `exclude`). Mutates.

        With `wait` (a caller that can hold the request: the router, the simulator) and
        `kv_wait`, a request that would break the TBT SLO now waits in the queue for its
        instance's batch to shrink while its predicted TTFT, the wait included, meets the TTFT
        SLO: the answer is then a `queued` Decision, and `release` places it later (or
        `cancel` drops it); when it is predicted to miss the SLO, the answer is a rejected
        Decision saying what was predicted (reason "ttft_slo")."""
        prefill, _, tokens = self._requests[request_id]
        self._prefill_done(prefill, request_id, now)
        for load in self._decode.values():
            load.incoming.pop(request_id, None)
        self._exclude = exclude
        if all(name in exclude for name in self._decode):
            self._drop(request_id)
            self.counters["rejected_no_instance"] += 1
            return None
        chosen, _, problem = self._best_decode(tokens, now, now, "now")
        mode = self.config.rejection
        booked = self._requests[request_id][1]
        if request_id in self._kv.reserved and booked not in exclude:
            # NOTE: kv_wait booked its memory there: it stays, and the ledger, not this check, judges
            # memory; its TBT there is judged alone (best_decode names memory first when both fail)
            chosen = booked
            problem = "tbt_slo" if self._tbt_now_s(booked, tokens, now) > self.config.tbt_slo_s else ""
        if problem and (mode == "baseline" or (mode != "none" and self.config.recheck_decode)):
            if wait and problem == "tbt_slo" and self.config.kv_wait and mode in WAITING_MODES:
                waiting = self._wait_at_decode(request_id, chosen, now)
                if waiting.accepted:
                    return waiting
                self._drop(request_id)
                self.counters["rejected_at_decode"] += 1
                return waiting
            self._drop(request_id)
            self.counters["rejected_at_decode"] += 1
            return None
        self._join_decode(request_id, chosen, now)
        return chosen

    def finished_at_prefill(self, request_id: int, now: float) -> None:
        """Prefill of `request_id` produced its only output token: it never reaches decode (also:
        a request released from the queue whose client left before it started)."""
        self._prefill_done(self._requests[request_id][0], request_id, now)
        self._drop(request_id)

    def decode_finished(self, request_id: int, now: float, output_tokens: int) -> None:
        """The request left its decode instance (mutates the load and the estimates)."""
        _, decode, _ = self._requests.pop(request_id)
        self._arrived.pop(request_id, None)
        joined, tokens = self._decode[decode].active.pop(request_id)
        self._decode[decode].active_tokens -= tokens
        self._kv.reserved.pop(request_id, None)
        self._stages.observe(now - joined)
        self._output_sum += output_tokens
        self._output_n += 1

    def prefill_queue_s(self, name: str, now: float) -> float:
        """The estimated wait before a new job would start on prefill instance `name`."""
        return max(0.0, self._prefill[name].free_at - now)

    def release(self, now: float, exclude: Container[str] = ()) -> list[Decision]:
        """Places the queued requests, in order, while the head fits: its KV memory, and the
        TBT SLO at its decode instance (each on the prefill instance best for it now; one
        waiting at decode joins its instance's batch); their decisions, `queued` and with the
        wait they had (mutates: books them). Call after every event that frees memory or
        shrinks a decode batch (`decode_finished`, `finished_at_prefill`, a rejection at
        `admit_decode`, `cancel`), and now and then while requests wait (the TBT forecast
        moves with time)."""
        self._exclude = exclude
        if not self._kv.queue:
            return []
        prefill_up = not all(name in exclude for name in self._prefill)

        def place(head: QueuedRequest, decode: str) -> bool:
            if head.at_decode:
                return self._release_at_decode(head, decode, now)
            if not prefill_up:
                return False
            request = self._waiting[head.request_id]
            best = self._best_prefill(request, now)
            if self.config.rejection in WAITING_MODES and self._decode_busy():
                # NOTE: the TBT check of `schedule`, at this moment; with every decode batch empty
                # waiting cannot lower it (the instances' floor), so it goes
                mode = self.config.rejection
                forecast = mode if mode in ("predicted", "predicted_uniform") else "now"
                if self._best_decode(request.input_tokens, now, now + best.ttft_s, forecast)[2] == "tbt_slo":
                    return False
            del self._waiting[head.request_id]
            best = _replace(best, decode=decode)
            self._book(best, request, now, head.tokens, head.arrived_s)
            waited = now - head.arrived_s
            self._released.append(_replace(best, queued=True, wait_s=waited, ttft_s=waited + best.ttft_s))
            if self.on_decision is not None:
                self.on_decision(self._released[-1], request)
            self.counters["released"] += 1
            return True

        self._kv.release(exclude, place)
        released, self._released = self._released, []
        return released

    def cancel(self, request_id: int) -> bool:
        """Takes a queued request out of the queue (its client left, or its deadline passed);
        one waiting at decode gives back its booking too. False when it is not queued
        (mutates). Call `release` after it."""
        entry = self._kv.cancel(request_id)
        if entry is None:
            return False
        if entry.at_decode:
            self._drop(request_id)
        else:
            del self._waiting[request_id]
        self.counters["cancelled"] += 1
        return True

    def decode_capacity_tokens(self) -> dict[str, int]:
        """Each decode instance's KV memory in tokens, by name."""
        return {name: load.capacity_tokens for name, load in self._decode.items()}

    @property
    def queued(self) -> int:
        """Requests waiting for KV memory."""
        return len(self._kv.queue)

    # -- internals ----------------------------------------------------------------------

    def _place_or_queue(self, request: ScheduleRequest, best: Decision, now: float, problem: str) -> Decision:
        """`kv_wait`: place `best` now when its KV memory fits, its decode load meets the TBT
        SLO (`problem` is not "tbt_slo") and nobody waits, else queue it when the predicted
        TTFT with the wait meets the SLO, else reject it (mutates)."""
        out = self._output_reserve(request)
        tokens, slo = request.input_tokens + out, self.config.ttft_slo_s
        tbt = problem == "tbt_slo"
        name = None if self._kv.queue or tbt else self._kv.room(tokens, self._exclude)
        if name is not None:
            decision = _replace(best, decode=name)
            self._book(decision, request, now, tokens)
            self.counters["accepted"] += 1
            return decision
        plan = self._kv.plan(tokens, now, self._exclude)
        if plan.decode is None:
            return self._reject(best, "kv_memory", f"needs {tokens} KV tokens, more than any decode instance holds")
        assert best.prefill is not None
        release_s, waiting_for = plan.release_s, "KV memory"
        if tbt:
            release_s, waiting_for = max(release_s, self._tbt_release_s(request, best, plan.release_s, now)), "TBT"
            if release_s == float("inf"):
                never = f"and no decode batch is predicted to shrink enough within the TTFT SLO {slo:g} s"
                tbt_slo = self.config.tbt_slo_s
                why = f"predicted TBT {best.tbt_s * 1e3:.1f} ms > the TBT SLO {tbt_slo * 1e3:g} ms, {never}"
                return self._reject(best, "tbt_slo", why)
        start = max(release_s, now + best.queue_s, self._kv.prefill_end_s(best.prefill))
        end = start + best.prefill_s + best.transfer_s
        wait, ttft = release_s - now, end - now
        why = f"predicted TTFT {ttft:.2f} s (waiting {wait:.2f} s for {waiting_for} on {plan.decode}) "
        if ttft > slo:
            return self._reject(_replace(best, ttft_s=ttft, wait_s=wait), "ttft_slo", f"{why}> the TTFT SLO {slo:g} s")
        depart = end + self._kv.stage_s(plan.decode, out)
        self._kv.enqueue(
            QueuedRequest(request.request_id, now, tokens, plan.decode, release_s, best.prefill, end, depart, ttft)
        )
        self._waiting[request.request_id] = request
        self.counters["queued"] += 1
        return _replace(
            best,
            decode=plan.decode,
            queued=True,
            wait_s=wait,
            queue_s=start - now,
            ttft_s=ttft,
            message=f"{why}<= the TTFT SLO {slo:g} s",
        )

    def _tbt_release_s(self, request: ScheduleRequest, best: Decision, after: float, now: float) -> float:
        """The earliest time from `after` at which a decode instance's batch, as the ledger
        expects it when the request would reach decode, meets the TBT SLO with the request in
        it: tried where a request is expected to leave, up to the TTFT SLO; inf when none
        does (pure). NOTE: the ledger's timeline, not the rejection mode's forecast: the
        survival forecast keeps a request that outlived every observed stage forever."""
        out = self._output_reserve(request)
        mine = request.input_tokens + out // 2
        candidates = [name for name in self._decode if name not in self._exclude]
        times = {after} | {t for name in candidates for t, _ in self._kv.departures(name, now)}
        for t in sorted(t for t in times if after <= t <= now + self.config.ttft_slo_s):
            for name in candidates:
                count, context = self._kv.batch_at(name, now, t + best.ttft_s)
                if self.cost.decode_step_s(count + 1, context + mine) <= self.config.tbt_slo_s:
                    return t
        return float("inf")

    def _wait_at_decode(self, request_id: int, decode: str, now: float) -> Decision:
        """Queues a prefilled request for a place in `decode`'s batch when the TTFT predicted
        with the wait meets the SLO (accepted, queued); else a rejection saying what was
        predicted (nothing is queued). The wait: until enough of the batch has left for it,
        and the ones waiting ahead of it there, to meet the TBT SLO (pure but for the queue)."""
        prefill, _, tokens = self._requests[request_id]
        arrived = self._arrived.get(request_id, now)
        load, slo = self._decode[decode], self.config.tbt_slo_s
        ahead = sum(1 for q in self._kv.queue if q.at_decode and q.decode == decode)
        size = self._kv.reserved.get(request_id, tokens)
        leaving = sorted(self._kv.departures(decode, now, active_only=True))
        per_request = (load.active_tokens + tokens) / (len(load.active) + 1) + (size - tokens) / 2
        release_s = float("inf")
        for gone in range(len(leaving) + 1):
            batch = len(load.active) - gone + ahead + 1
            if self.cost.decode_step_s(batch, int(batch * per_request)) <= slo:
                release_s = leaving[gone - 1][0] if gone else now
                break
        wait, ttft = release_s - now, release_s - arrived
        why = f"predicted TTFT {ttft:.2f} s (waiting {wait:.2f} s for {decode}'s batch to meet the TBT SLO) "
        if ttft > self.config.ttft_slo_s:
            return Decision(
                request_id,
                False,
                "ttft_slo",
                prefill=prefill,
                decode=decode,
                ttft_s=ttft,
                wait_s=wait,
                message=f"{why}> the TTFT SLO {self.config.ttft_slo_s:g} s",
            )
        depart = release_s + self._kv.stage_s(decode, size - tokens)
        self._kv.enqueue(
            QueuedRequest(request_id, arrived, size, decode, release_s, "", 0.0, depart, ttft, at_decode=True)
        )
        self._decode[decode].incoming[request_id] = (now, tokens)  # NOTE: held there: the ledger counts its memory
        self.counters["queued_at_decode"] += 1
        return Decision(
            request_id,
            True,
            prefill=prefill,
            decode=decode,
            queued=True,
            wait_s=wait,
            ttft_s=ttft,
            message=f"{why}<= the TTFT SLO {self.config.ttft_slo_s:g} s",
        )

    def _release_at_decode(self, head: QueuedRequest, decode: str, now: float) -> bool:
        """Places a request waiting at decode when its instance's batch now meets the TBT SLO
        with it (the check of `admit_decode`); False otherwise (mutates on success)."""
        if decode in self._exclude:
            return False
        tokens = self._requests[head.request_id][2]
        if self._decode[decode].active and self._tbt_now_s(decode, tokens, now) > self.config.tbt_slo_s:
            return False
        self._decode[decode].incoming.pop(head.request_id, None)
        self._join_decode(head.request_id, decode, now)
        prefill = self._requests[head.request_id][0]
        waited = now - head.arrived_s
        self._released.append(
            Decision(head.request_id, True, prefill=prefill, decode=decode, queued=True, wait_s=waited, ttft_s=waited)
        )
        self.counters["released_at_decode"] += 1
        return True

    def _mean_out(self) -> float:
        """The mean output length observed (the assumed one until a request finished)."""
        return self._output_sum / self._output_n if self._output_n else _INITIAL_OUTPUT_TOKENS

    def _service_s(self, now: float) -> float:
        """The learned per-job term of a prefill instance's service (0: none learned)."""
        return self.service.estimate_s(now) if self.service is not None else 0.0

    def _tbt_now_s(self, decode: str, input_tokens: int, now: float) -> float:
        """The TBT of `decode`'s batch now with a request of `input_tokens` added (pure)."""
        mean_out = self._mean_out()
        forecast = DecodeForecast(self._stages, self.cost, self.config.tbt_slo_s, mean_out)
        return best_decode({decode: self._decode[decode]}, forecast, input_tokens, now, now, "now")[1]

    def _decode_busy(self) -> bool:
        """Whether a decode instance not excluded has requests in its batch or on their way."""
        return any(load.active or load.incoming for name, load in self._decode.items() if name not in self._exclude)

    def _join_decode(self, request_id: int, decode: str, now: float) -> None:
        prefill, _, tokens = self._requests[request_id]
        self._decode[decode].active[request_id] = (now, tokens)
        self._decode[decode].active_tokens += tokens
        self._requests[request_id] = (prefill, decode, tokens)

    def _drop(self, request_id: int) -> None:
        """Forgets a request wherever it is booked (nothing observed; mutates)."""
        _, decode, _ = self._requests.pop(request_id)
        self._arrived.pop(request_id, None)
        for load in self._decode.values():
            load.incoming.pop(request_id, None)
        active = self._decode[decode].active.pop(request_id, None)
        if active is not None:
            self._decode[decode].active_tokens -= active[1]
        self._kv.reserved.pop(request_id, None)

    def _output_reserve(self, request: ScheduleRequest) -> int:
        """The output tokens a request's KV reservation counts: the mean observed, capped by its max_tokens."""
        mean_out = self._mean_out()
        return math.ceil(min(mean_out, request.max_tokens) if request.max_tokens > 0 else mean_out)

    def _best_prefill(self, request: ScheduleRequest, now: float) -> Decision:
        cfg = self.config
        matches = self.index.match(request.blocks) if request.blocks else {}
        # NOTE: the longest prefixes held anywhere: an instance cannot fetch from its own
        # caches (DRAM and SSD), so the third is the best another may fetch from.
        # With links, equally long prefixes are ranked by their source's load.
        busy = self.links.active if self.links is not None else no_load
        ranked = sorted(matches.items(), key=lambda i: (-i[1], busy(i[0]), i[0]))[:3] if cfg.reuse == "global" else []
        cost, block, chunk = self.cost, cfg.block_tokens, cfg.prefill_chunk_tokens
        tokens = request.input_tokens
        service = self._service_s(now)
        best: Decision | None = None
        prefill_s: dict[tuple[int, CppGroup | None], float] = {}  # instances share most estimates

        def compute_s(cached: int, group: CppGroup | None = None) -> float:
            key, new = (cached, group), tokens - cached
            if key not in prefill_s:
                if group is None:
                    prefill_s[key] = chunked_prefill_s(cost, new, cached, chunk) + service
                else:
                    prefill_s[key] = group.prefill_s(cost, new, cached, chunk) + service
            return prefill_s[key]

        for name, load in self._prefill.items():
            if name in self._exclude:
                continue
            queue_s = max(0.0, load.free_at - now)
            local_loc = self._local[name]
            local = matches.get(local_loc, 0)
            cached = cached_tokens(local, block, tokens)
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
                fetched = cached_tokens(held, block, tokens)
                bandwidth = fetch_bandwidth_bytes_s(cfg, source, own_ssd) / (1 + busy(source))
                transfer_s = cost.transfer_s(fetched - cached, bandwidth)
                fetched_s = compute_s(fetched, group)
                if transfer_s + fetched_s < option[0] + option[1]:
                    option = (fetched_s, transfer_s, source, held - local, fetched)
            ttft_s = queue_s + option[0] + option[1]
            if best is None or ttft_s < best.ttft_s:
                fetch_from, fetch_blocks = option[2], option[3]
                best = Decision(
                    request.request_id,
                    True,
                    prefill=name,
                    local_blocks=local,
                    fetch_from=fetch_from,
                    fetch_blocks=fetch_blocks,
                    cached_tokens=option[4],
                    queue_s=queue_s,
                    prefill_s=option[0],
                    transfer_s=option[1],
                    ttft_s=ttft_s,
                )
        assert best is not None
        return best

    def _best_decode(self, input_tokens: int, now: float, at: float, forecast: str) -> tuple[str, float, str]:
        """See `best_decode` (tsukimi/scheduler/placement.py), over the instances not excluded."""
        mean_out = self._mean_out()
        loads = {name: load for name, load in self._decode.items() if name not in self._exclude}
        return best_decode(
            loads,
            DecodeForecast(self._stages, self.cost, self.config.tbt_slo_s, mean_out),
            input_tokens,
            now,
            at,
            forecast,
        )

    def _book(
        self, decision: Decision, request: ScheduleRequest, now: float, reserve_tokens: int = 0, arrived: float = -1.0
    ) -> None:
        assert decision.prefill is not None and decision.decode is not None
        self._arrived[request.request_id] = now if arrived < 0 else arrived
        if reserve_tokens:
            self._kv.reserved[request.request_id] = reserve_tokens
        load = self._prefill[decision.prefill]
        start = max(load.free_at, now)
        load.free_at = start + decision.prefill_s + decision.transfer_s
        load.jobs[request.request_id] = load.free_at - load.shift
        engine_s = decision.prefill_s + decision.transfer_s - self._service_s(now)
        load.started[request.request_id] = (now, engine_s)
        self._decode[decision.decode].incoming[request.request_id] = (now + decision.ttft_s, request.input_tokens)
        self._requests[request.request_id] = (decision.prefill, decision.decode, request.input_tokens)

    def _prefill_done(self, name: str, request_id: int, now: float) -> None:
        load = self._prefill[name]
        if request_id not in load.jobs:  # NOTE: done before (it waited at decode since)
            return
        booked_at, engine_s = load.started.pop(request_id)
        if self.service is not None:  # NOTE: one job at a time: it began when booked or when the last ended
            self.service.observe(now, now - max(booked_at, load.last_done) - engine_s)
        load.last_done = now
        booked_end = load.jobs.pop(request_id)
        if not load.jobs:
            load.free_at, load.shift = now, 0.0
            return
        # NOTE: FIFO: the jobs behind this one now run `error` later than booked; free_at
        # already carries the previous error, so only the change is applied.
        error = now - booked_end
        load.free_at += error - load.shift
        load.shift = error

    def _reject(self, best: Decision, reason: str, message: str = "") -> Decision:
        self.counters[f"rejected_{reason}"] += 1
        if not message and reason == "ttft_slo":
            message = f"predicted TTFT {best.ttft_s:.2f} s > the TTFT SLO {self.config.ttft_slo_s:g} s"
        return _replace(best, accepted=False, reason=reason, message=message)


def _replace(decision: Decision, **changes: object) -> Decision:
    return dataclasses.replace(decision, **changes)  # type: ignore[arg-type]
