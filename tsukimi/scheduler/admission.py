"""Queue, then reject: the Conductor's waiting room for requests whose decode placement lacks
KV memory or would break the TBT SLO (`ConductorConfig.kv_wait`).

A decode instance's KV memory is a ledger: every request booked on it (in decode, or on its
way from prefill) holds its prompt plus its expected output (the mean observed, capped by the
request's max_tokens) until it leaves decode. A request that does not fit now waits in a FIFO
when its predicted time to first token, the wait included, meets the TTFT SLO, and is
rejected otherwise:

    release(i) = the earliest time an instance frees enough: its booked requests and the
                 queued ones ahead leave, each at (joined or due) + its expected decode stage
                 (the observed mean; before any is observed, its output x the instance's TBT),
                 and never before the request ahead in the queue is released
    TTFT       = max(release, prefill queue, prefill of those ahead) - now + prefill + transfer

Freed memory (a request leaving decode, finishing at prefill, rejected or cancelled) releases
queued requests in order while the head fits (`release`), each then placed on a prefill
instance with the queues of that moment. The queue also holds requests whose prefill is done
but whose decode instance's batch is too large for the TBT SLO now (`at_decode`): in arrival
order with the rest, they keep their memory and join their instance when the batch shrinks.
Pure and driven by the caller's `now`, like the Conductor it serves
(tsukimi/scheduler/conductor.py); not thread-safe.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Container, Iterator, Mapping
from dataclasses import dataclass

from tsukimi.scheduler.cost_model import CostModel
from tsukimi.scheduler.load_prediction import DecodeLoad, DecodeStagePredictor


@dataclass(slots=True)
class QueuedRequest:
    """A request accepted to wait for KV memory, and what was predicted for it."""

    request_id: int
    arrived_s: float
    tokens: int  # its KV reservation: prompt + expected output
    decode: str  # the instance it was predicted to go to
    release_s: float  # when memory was predicted to free for it
    prefill: str  # the prefill instance it was predicted to use
    prefill_end_s: float  # when its prefill was predicted to end
    depart_s: float  # when it was predicted to leave decode
    ttft_s: float  # its predicted time to first token, the wait included
    at_decode: bool = False  # its prefill is done: it waits for a place in `decode`'s batch (TBT)


@dataclass(frozen=True, slots=True)
class Span:
    """A request's expected time in a decode batch, and the KV it holds there."""

    joined_s: float
    depart_s: float
    size: int  # its KV reservation: prompt + expected output
    context: int  # its context at mid-stage: prompt + half its output


@dataclass(frozen=True, slots=True)
class WaitPlan:
    """Where and when a request would get KV memory: `decode` None when it never fits."""

    decode: str | None
    release_s: float


class KvLedger:
    """The decode instances' KV memory as the Conductor booked it, and the waiting queue.

    Args:
        decode: the Conductor's books of the decode instances (read, never changed here).
        stages: the observed decode-stage lengths.
        cost: for the TBT of an instance before any decode stage is observed.
    """

    def __init__(self, decode: Mapping[str, DecodeLoad], stages: DecodeStagePredictor, cost: CostModel) -> None:
        self._decode, self._stages, self._cost = decode, stages, cost
        self.reserved: dict[int, int] = {}  # request id -> tokens held on its decode instance
        self.queue: deque[QueuedRequest] = deque()

    def used_tokens(self, name: str) -> int:
        """Tokens reserved on decode instance `name` by the requests booked there."""
        load = self._decode[name]
        return sum(
            self.reserved.get(rid, tokens) for rid, (_, tokens) in (*load.active.items(), *load.incoming.items())
        )

    def room(self, tokens: int, exclude: Container[str]) -> str | None:
        """The instance with the most free KV among those `tokens` fit in now, or None."""
        best: tuple[int, str] | None = None
        for name, load in self._decode.items():
            if name in exclude:
                continue
            free = load.capacity_tokens - self.used_tokens(name)
            if free >= tokens and (best is None or free > best[0]):
                best = (free, name)
        return best[1] if best is not None else None

    def plan(self, tokens: int, now: float, exclude: Container[str]) -> WaitPlan:
        """When and where `tokens` would fit, behind the queue (pure)."""
        after = self.queue[-1].release_s if self.queue else now
        best = WaitPlan(None, float("inf"))
        for name, load in self._decode.items():
            if name in exclude or tokens > load.capacity_tokens:
                continue
            leaving = sorted(self.departures(name, now))
            need = sum(size for _, size in leaving) + tokens - load.capacity_tokens
            at = now
            for depart_s, size in leaving:
                if need <= 0:
                    break
                need, at = need - size, depart_s
            release_s = max(at, after, now)
            if release_s < best.release_s:
                best = WaitPlan(name, release_s)
        return best

    def stage_s(self, name: str, output_tokens: int) -> float:
        """A request's expected decode stage on `name`: the observed mean, or before any is
        observed its output at the instance's TBT with one more request."""
        return self._stages.mean_s if self._stages.observed else output_tokens * self._tbt_s(name)

    def cold_stage_s(self, output_tokens: int, exclude: Container[str]) -> float:
        """A decode stage's length before any is observed: `output_tokens` at the TBT of the most
        loaded instance not in `exclude` with one more request (what it is booked for now)."""
        return max((output_tokens * self._tbt_s(name) for name in self._decode if name not in exclude), default=1.0)

    def prefill_end_s(self, prefill: str) -> float:
        """When the queued requests planned on `prefill` were predicted to finish prefill."""
        return max((q.prefill_end_s for q in self.queue if q.prefill == prefill), default=0.0)

    def release(self, exclude: Container[str], place: Callable[[QueuedRequest, str], bool]) -> None:
        """Releases queued requests in order while the head fits: `place(head, decode)` books
        it (False: it could not be placed now, e.g. the TBT SLO; the queue stops there). A
        request waiting at decode holds its memory already: `place` gets its own instance.
        Mutates."""
        while self.queue:
            head = self.queue[0]
            name = head.decode if head.at_decode else self.room(head.tokens, exclude)
            if name is None or not place(head, name):
                return
            self.queue.popleft()

    def enqueue(self, entry: QueuedRequest) -> None:
        """Adds `entry` to the queue in arrival order (mutates): one waiting at decode arrived
        before most of those waiting to start."""
        at = len(self.queue)
        while at and self.queue[at - 1].arrived_s > entry.arrived_s:
            at -= 1
        self.queue.insert(at, entry)

    def cancel(self, request_id: int) -> QueuedRequest | None:
        """Removes a queued request (it left or timed out); the entry, or None if not queued."""
        for entry in self.queue:
            if entry.request_id == request_id:
                self.queue.remove(entry)
                return entry
        return None

    def _tbt_s(self, name: str) -> float:
        load = self._decode[name]
        return self._cost.decode_step_s(len(load.active) + len(load.incoming) + 1, self.used_tokens(name))

    def departures(self, name: str, now: float, active_only: bool = False) -> Iterator[tuple[float, int]]:
        """(expected departure, tokens) of every request holding or due to hold KV on `name`
        (`active_only`: of those in its batch now)."""
        for span in self.spans(name, now):
            if span.joined_s <= now or not active_only:
                yield span.depart_s, span.size

    def batch_at(self, name: str, now: float, at: float) -> tuple[int, int]:
        """(requests, their context tokens at mid-stage) expected in `name`'s decode batch at
        time `at`: those joined by then and not yet left, by the spans of `spans` (pure)."""
        count = context = 0
        for span in self.spans(name, now):
            if span.joined_s <= at < span.depart_s:
                count, context = count + 1, context + span.context
        return count, context

    def spans(self, name: str, now: float) -> Iterator[Span]:
        """When each request holding or due to hold KV on `name` is expected in its batch: in
        it now (joined in the past), on its way (joining when due), or queued for it (joining
        when its prefill is predicted to end); each leaves after the expected decode stage."""
        load = self._decode[name]
        mean_s = self._stages.mean_s if self._stages.observed else None
        tbt_s = self._tbt_s(name) if mean_s is None else 0.0
        for rid, (joined, tokens) in load.active.items():
            size = self.reserved.get(rid, tokens)
            stage = mean_s if mean_s is not None else (size - tokens) * tbt_s
            yield Span(joined, max(now, joined + stage), size, (tokens + size) // 2)
        for rid, (due, tokens) in load.incoming.items():
            size = self.reserved.get(rid, tokens)
            stage = mean_s if mean_s is not None else (size - tokens) * tbt_s
            yield Span(max(now, due), max(now, due) + stage, size, (tokens + size) // 2)
        for entry in self.queue:
            if entry.decode == name and not entry.at_decode:  # NOTE: one at decode is in `incoming` already
                yield Span(entry.prefill_end_s, entry.depart_s, entry.tokens, entry.tokens)
