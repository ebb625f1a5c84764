"""The router's decision log: one `DecisionRecord` per request, keyed by the client's request id
(its `X-Request-Id`, else the id the router gave it), served at `GET /decisions` and shown on
the dashboard. The router's diagnostics live here, not in the OpenAI response body.

    the door           arrived_s            when the request reached the router (arrivals.py)
    arrival            open(...)            mode, prompt size, arrival time
    Conductor          placed(...)          accepted / rejected (reason, message), queued, the
                                            predicted TTFT at arrival, the prefill and decode
                                            workers, the Conductor's integer id
    baseline pick      picked(...)          the worker
    PD prefill placed  expect(...)          what the prefix index expected the prefill worker
                                            to reuse (of it, from the pool; other prefills ran
                                            there then)
    PD decode wait     waited_at_decode(...)  how long it waited after prefill for a place in
                                            its decode worker's batch (the TBT SLO)
    tokens             reused(...)          what the request really reused (of it, from the pool)
    failure            rejected(...)        429 / 503 before any token

Only the newest `capacity` (4096) records are kept, in arrival order; a request id seen again
starts a new record (the newer request's). `total` counts every record ever opened, so a
viewer can tell how many it missed between two looks.

Runs on the router's event loop (plain mutable state, no lock): O(1) per update.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import msgspec

from tsukimi.scheduler.conductor import Decision
from tsukimi.serving.router.index_feed import ExpectedReuse

DEFAULT_CAPACITY = 4096
RECENT = 64  # what GET /decisions answers without ids


class DecisionRecord(msgspec.Struct):
    """One request's placement and what came of it (mutated by the router until it ends).

    request_id: the client's id. time_s: the router's clock at arrival. mode: "pd" or
    "colocated". accepted: False when it was turned away (429 / 503); reason / message: why
    (the Conductor's reason: ttft_slo, tbt_slo, kv_memory, rejected_at_decode, queue_full,
    overloaded, no_instance) and what was predicted, in words. queued: the arrival decision
    queued it for decode KV memory. predicted_ttft_s: the Conductor's TTFT estimate at arrival
    (None: no Conductor placed it). prefill: the worker that computed the prompt (colocated:
    the worker); decode: the decode worker ("" if none). expected_*: what the prefix index
    expected the prefill worker to reuse, of it from the pool, and whether other prefills ran
    there when it was placed (None / False: colocated). cached_tokens / pool_tokens: what the
    request really reused, of it loaded from the pool (None until its first token).
    conductor_id: the Conductor's integer id of the request (None: no Conductor). seq: the
    record's number, in arrival order. decode_wait_s: how long it waited, prefilled, for a place
    in its decode worker's batch (None: it did not wait there). arrived_s: the router's clock
    when the request reached the router's door, its body not yet read
    (tsukimi/serving/router/arrivals.py; None: not known yet): `time_s - arrived_s` is how long
    its admission decision took.
    """

    request_id: str
    time_s: float
    mode: str
    prompt_tokens: int
    accepted: bool = True
    reason: str = ""
    message: str = ""
    queued: bool = False
    predicted_ttft_s: float | None = None
    prefill: str = ""
    decode: str = ""
    expected_cached_tokens: int | None = None
    expected_pool_tokens: int | None = None
    expected_concurrent: bool = False
    cached_tokens: int | None = None
    pool_tokens: int | None = None
    conductor_id: int | None = None
    seq: int = 0
    decode_wait_s: float | None = None
    arrived_s: float | None = None

    def placed(self, decision: Decision) -> None:
        """Takes a Conductor decision: the arrival's (or, once queued, its release's) placement,
        or its rejection (mutates)."""
        self.conductor_id = decision.request_id
        if self.predicted_ttft_s is None:  # NOTE: the arrival's estimate; a release's counts the wait
            self.predicted_ttft_s = decision.ttft_s
            self.queued = decision.queued
        if not decision.accepted:
            self.rejected(decision.reason, decision.message)
            return
        self.prefill = decision.prefill or ""
        # NOTE: colocated, the Conductor's decode pick is nominal: the prefill worker decodes too
        self.decode = decision.decode or "" if self.mode == "pd" else ""

    def picked(self, prefill: str, decode: str = "") -> None:
        """Takes a baseline's pick (mutates)."""
        self.prefill, self.decode = prefill, decode

    def expect(self, expected: ExpectedReuse) -> None:
        """Takes what the prefix index expected the prefill worker to reuse (mutates)."""
        self.expected_cached_tokens, self.expected_pool_tokens = expected.cached_tokens, expected.pool_tokens
        self.expected_concurrent = expected.concurrent

    def reused(self, cached_tokens: int, pool_tokens: int) -> None:
        """Takes what the request has reused so far (mutates)."""
        self.cached_tokens, self.pool_tokens = cached_tokens, pool_tokens

    def waited_at_decode(self, wait_s: float) -> None:
        """Takes the wait of a prefilled request for a place in its decode batch (mutates)."""
        self.decode_wait_s = wait_s

    def rejected(self, reason: str, message: str = "") -> None:
        """Marks it turned away (mutates)."""
        self.accepted, self.reason, self.message = False, reason, message


class DecisionLog:
    """The newest `capacity` records by request id (see the module). Mutated by the router only."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._records: OrderedDict[str, DecisionRecord] = OrderedDict()
        self.total = 0

    def open(self, request_id: str, time_s: float, mode: str, prompt_tokens: int) -> DecisionRecord:
        """A new record for a request arriving now, replacing one of the same id (mutates)."""
        record = DecisionRecord(request_id, time_s, mode, prompt_tokens, seq=self.total)
        self._records.pop(request_id, None)
        self._records[request_id] = record
        if len(self._records) > self.capacity:
            self._records.popitem(last=False)
        self.total += 1
        return record

    def get(self, request_ids: Sequence[str]) -> list[DecisionRecord]:
        """The records of `request_ids` still held, in the order asked (pure)."""
        return [self._records[rid] for rid in request_ids if rid in self._records]

    def recent(self, limit: int = RECENT) -> list[DecisionRecord]:
        """The newest `limit` records, newest first (pure)."""
        out: list[DecisionRecord] = []
        for record in reversed(self._records.values()):
            if len(out) >= limit:
                break
            out.append(record)
        return out
