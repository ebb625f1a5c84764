"""The router's recent placement decisions, for the dashboard (tsukimi/serving/dashboard/app.py):
a bounded log the router appends to as it places each request, O(1) and never read on the
request path.

    PD:         Conductor.schedule -> Decision -> record(...)   (accepted or rejected, with why)
    colocated:  the least-loaded pick           -> picked(...)

Only the newest `capacity` entries are kept; `total` counts every entry ever recorded, so a
viewer can tell how many it missed between two looks.

Runs on the router's event loop (plain mutable state, no lock).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tsukimi.scheduler.conductor import Decision

DEFAULT_CAPACITY = 64


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """One placement. `time_s`: the router's clock; `prefill` / `decode`: the chosen instances
    (colocated: the worker is `prefill`, `decode` is ""); `cached_tokens` / `ttft_s`: what the
    Conductor expected to reuse and estimated the time to first token to be (colocated: 0);
    `reason`: why it was rejected ("" when accepted); `fetch_from`: where the Conductor planned
    to fetch a longer prefix from ("" for none)."""

    seq: int
    time_s: float
    request_id: str
    mode: str
    accepted: bool
    prompt_tokens: int
    prefill: str
    decode: str = ""
    cached_tokens: int = 0
    ttft_s: float = 0.0
    reason: str = ""
    fetch_from: str = ""


class DecisionLog:
    """The newest `capacity` decisions (see the module). Mutated by the router only."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._entries: deque[DecisionRecord] = deque(maxlen=capacity)
        self.total = 0

    def conductor(self, request_id: str, prompt_tokens: int, decision: Decision, now: float) -> None:
        """Records a Conductor decision (PD mode; mutates)."""
        self._entries.append(
            DecisionRecord(
                self.total,
                now,
                request_id,
                "pd",
                decision.accepted,
                prompt_tokens,
                decision.prefill or "",
                decision.decode or "",
                decision.cached_tokens,
                decision.ttft_s,
                decision.reason or (f"queued for KV memory ({decision.wait_s:.1f} s)" if decision.queued else ""),
                decision.fetch_from or "",
            )
        )
        self.total += 1

    def picked(self, request_id: str, prompt_tokens: int, worker: str, now: float) -> None:
        """Records the colocated worker picked for a request (mutates)."""
        self._entries.append(DecisionRecord(self.total, now, request_id, "colocated", True, prompt_tokens, worker))
        self.total += 1

    def recent(self, limit: int = DEFAULT_CAPACITY) -> list[DecisionRecord]:
        """The newest `limit` decisions, newest first (pure)."""
        out: list[DecisionRecord] = []
        for record in reversed(self._entries):
            if len(out) >= limit:
                break
            out.append(record)
        return out
