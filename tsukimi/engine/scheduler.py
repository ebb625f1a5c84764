"""The engine's scheduler: the waiting and running queues, what each step computes, and what
happens to requests after it.

Each `schedule()` takes, within `max_batched_tokens`:

1. every running request's next tokens, oldest first (one per decode; a long prompt goes in
   chunks over several steps). A request that cannot get blocks preempts the newest running
   request not yet scheduled this step (recompute preemption: it gives up its KV and goes
   back to the front of the waiting queue); if none is left, it waits this step.
2. then waiting requests in arrival order, each admitted with its longest cached prefix
   (tsukimi/engine/block_manager.py) and given blocks for its next chunk; the first that
   cannot get blocks gives its prefix back and stops admission (a waiting request never
   holds blocks that a running one may need).

If nothing could be scheduled while requests run, the newest one is preempted and scheduling
is tried once more. `postprocess()` caches the blocks the step filled and appends each
sampled token, finishing requests that stop.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

from tsukimi.engine.block_manager import BlockManager, FilledBlock
from tsukimi.engine.request import EngineRequest, StepOutput
from tsukimi.engine.sampling import stop_reason
from tsukimi.errors import OutOfSpace

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's part of a step: the boundary between the `Scheduler` and the forward.

    The forward computes KV for `token_ids` at positions `start` onwards (`start` is
    `request.seq.num_tokens` until the forward commits) into `request.seq`'s blocks, offers
    the first `num_published` of `filled` (full prompt blocks) to the KV pool layer by layer,
    and samples a token for the request when `samples` (its tokens all have KV after the step).
    """

    request: EngineRequest
    start: int
    token_ids: tuple[int, ...]
    filled: tuple[FilledBlock, ...]
    num_published: int
    samples: bool

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def published(self) -> tuple[FilledBlock, ...]:
        return self.filled[: self.num_published]


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    """What one step computes, in token order (empty: nothing to do)."""

    requests: tuple[ScheduledRequest, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(entry.num_tokens for entry in self.requests)


class Scheduler:
    """Decides each step's batch and applies its results (not thread-safe; see the module).

    Args:
        blocks: the requests' blocks in the KV cache.
        max_batched_tokens: tokens per step at most (decodes first, then prompt chunks).
        eos_ids: the model's end-of-sequence tokens.
    """

    def __init__(self, blocks: BlockManager, max_batched_tokens: int, eos_ids: tuple[int, ...]) -> None:
        self.blocks, self.max_batched_tokens, self.eos_ids = blocks, max_batched_tokens, eos_ids
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []  # oldest admitted first
        self._ids: set[str] = set()

    def __contains__(self, request_id: object) -> bool:
        """Whether a request of this id is waiting or running."""
        return request_id in self._ids

    def __len__(self) -> int:
        """Requests waiting or running."""
        return len(self._ids)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: EngineRequest) -> None:
        """Queue `request` last (mutates; its id must be new: the engine checks)."""
        assert request.request_id not in self._ids
        self.waiting.append(request)
        self._ids.add(request.request_id)

    def abort(self, request_id: str) -> None:
        """Drop a request and free its blocks (mutates; unknown ids are ignored)."""
        for queue in (self.waiting, self.running):
            for request in list(queue):
                if request.request_id == request_id:
                    queue.remove(request)
                    self._finish(request)

    def schedule(self) -> ScheduledBatch:
        """This step's batch (mutates: admits, reserves blocks, preempts; see the module).

        Raises:
            OutOfSpace: requests wait, none runs, and the first cannot get its blocks.
        """
        scheduled = self._schedule()
        if not scheduled and self.running:  # every running request waits for blocks: free some
            self._preempt(self.running[-1])
            scheduled = self._schedule()
        if not scheduled and self.has_work():
            raise OutOfSpace("the KV cache cannot hold the next request")
        return ScheduledBatch(tuple(self._entry(request, count) for request, count in scheduled))

    def postprocess(
        self, batch: ScheduledBatch, tokens: list[int | None], recompute: Collection[EngineRequest] = ()
    ) -> list[StepOutput]:
        """Apply a step: cache the blocks it filled, append `tokens` (one per entry of `batch`,
        None where it sampled nothing) and finish the requests that stop (mutates). Requests in
        `recompute` (their pooled KV failed to load during the step: layer_loading.py) cache
        nothing and are preempted to compute again."""
        for entry in batch.requests:
            if entry.request in recompute:
                self._preempt(entry.request)
            else:
                self.blocks.cache_filled(entry.request, entry.filled)
        outputs = []
        for entry, token in zip(batch.requests, tokens, strict=True):
            if token is None:
                continue
            request = entry.request
            reason = stop_reason(token, len(request.output) + 1, request.params, self.eos_ids)
            emitted = () if reason == "stop" else (token,)
            request.output += emitted
            outputs.append(StepOutput(request.request_id, emitted, reason, request.cached_tokens, request.pool_tokens))
            if reason is not None:
                self.running.remove(request)
                self._finish(request)
        return outputs

    def check_invariants(self) -> None:
        """Assert the queues' consistency (for tests): every request in exactly one queue,
        waiting ones holding no blocks, running ones with blocks for all their KV."""
        queued = [*self.waiting, *self.running]
        assert len({id(r) for r in queued}) == len(queued) == len(self._ids)
        assert {r.request_id for r in queued} == self._ids
        for request in self.waiting:
            assert not request.admitted and not request.seq.block_table and not request.hashes
        bt = self.blocks.block_tokens
        for request in self.running:
            assert request.admitted and request.seq.num_tokens <= request.num_tokens
            assert len(request.seq.block_table) * bt >= request.seq.num_tokens
            assert len(request.hashes) <= request.seq.num_tokens // bt

    # -- internals ----------------------------------------------------------------------

    def _schedule(self) -> list[tuple[EngineRequest, int]]:
        scheduled: list[tuple[EngineRequest, int]] = []
        budget = self._schedule_running(scheduled, self.max_batched_tokens)
        self._schedule_waiting(scheduled, budget)
        return scheduled

    def _schedule_running(self, scheduled: list[tuple[EngineRequest, int]], budget: int) -> int:
        """Add running requests' next tokens to `scheduled`, oldest first; the budget left."""
        for request in list(self.running):
            if request not in self.running:
                continue  # preempted below for an older request
            count = min(request.num_tokens - request.seq.num_tokens, budget)
            if not count:
                continue
            while not self.blocks.reserve(request, count):
                victim = self.running[-1]
                if victim is request or any(victim is r for r, _ in scheduled):
                    count = 0
                    break
                self._preempt(victim)
            if count:
                scheduled.append((request, count))
                budget -= count
        return budget

    def _schedule_waiting(self, scheduled: list[tuple[EngineRequest, int]], budget: int) -> None:
        """Admit waiting requests in arrival order while the budget and the blocks last."""
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if not request.admitted:
                self.blocks.admit(request)
            count = min(request.num_tokens - request.seq.num_tokens, budget)
            if not self.blocks.reserve(request, count):
                self.blocks.unadmit(request)  # NOTE: never hold blocks while waiting: a running one may need them
                break
            self.running.append(self.waiting.popleft())
            scheduled.append((request, count))
            budget -= count

    def _entry(self, request: EngineRequest, count: int) -> ScheduledRequest:
        start = request.seq.num_tokens
        filled = self.blocks.filling(request, count)
        return ScheduledRequest(
            request,
            start,
            tuple(request.tokens[start : start + count]),
            filled,
            self.blocks.num_prompt_blocks(request, filled),
            start + count == request.num_tokens,
        )

    def _preempt(self, request: EngineRequest) -> None:
        """Out of blocks: `request` gives up its KV and recomputes (prompt + output so far) later."""
        logger.debug("preempting %s: the KV cache is full", request.request_id)
        self.running.remove(request)
        self.blocks.unadmit(request)
        self.waiting.appendleft(request)

    def _finish(self, request: EngineRequest) -> None:
        self.blocks.free(request)
        self._ids.discard(request.request_id)
