"""The Conductor's boundary types (tsukimi/scheduler/conductor.py): what it is told of a
request (`ScheduleRequest`), what it answers (`Decision`), and what it asks of the KV links
(`SourceLoad`). Kept apart so that callers (the router, the simulator) see only these."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ScheduleRequest:
    """What the Conductor knows of a request: its prompt length, block hashes and the most
    tokens it may generate (0: unknown; caps its KV reservation under `kv_wait`)."""

    request_id: int
    input_tokens: int
    blocks: Sequence[int]
    max_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request runs (or why not). Times are estimates in seconds.

    local_blocks: prefix blocks reused from the prefill instance's own cache;
    fetch_from / fetch_blocks: a location holding a longer prefix (another instance's cache,
    or this instance's own SSD tier) and how many more blocks come from it (they stay in the
    prefill instance's DRAM afterwards).
    queued: it waits for KV memory (`kv_wait`): placed later, by `Conductor.release`, whose
    decision has `queued` too and `wait_s` the time it waited; ttft_s counts the wait.
    message: why it was rejected or queued, in words (e.g. the predicted TTFT vs the SLO).
    prefill_s includes the prefill instance's learned per-job term (time outside engine steps:
    tsukimi/scheduler/service_term.py).
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
    queued: bool = False
    wait_s: float = 0.0
    message: str = ""


class SourceLoad(Protocol):
    """How busy the link of a KV source (a location) is: its transfers in flight, O(1)."""

    def active(self, source: str) -> int: ...
