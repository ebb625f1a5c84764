"""The simulated machines: block caches, prefill instances, decode instances and colocated
(vLLM-like) instances, advanced on the simulator's virtual time.

Prefill instances run their queue first in, first out; a job is computed in chunks of
`chunk_tokens` (each chunk pays a full iteration: weights read, overhead) after fetching
any prefix it reuses from elsewhere. Decode and colocated instances iterate continuously;
they are advanced lazily (`advance(until)`) in tight loops, so a step costs no event in the
simulator's heap. KV memory is reserved for a request's whole context (prompt + output) when
it joins a batch; a request that does not fit waits.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tsukimi.eviction import EvictionPolicy
from tsukimi.scheduler.cost_model import CostModel
from tsukimi.scheduler.prefix_index import PrefixIndex


class BlockCache:
    """A capacity-bounded set of blocks at one index location; publishes every change to
    the index. `capacity` None = unbounded."""

    def __init__(self, loc: str, capacity: int | None, policy: EvictionPolicy[int], index: PrefixIndex) -> None:
        self.loc, self.capacity, self.policy, self.index = loc, capacity, policy, index

    def access(self, blocks: Sequence[int]) -> None:
        """Touch the resident blocks and insert the others, last to first (a chain is then
        evicted from its tail); the request's own blocks are never evicted for it, and a
        request longer than the cache keeps its first `capacity` blocks. Mutates."""
        keep = blocks if self.capacity is None else blocks[: self.capacity]
        policy = self.policy
        missing = [b for b in keep if b not in policy]
        if self.capacity is not None:
            excess = len(policy) + len(missing) - self.capacity
            if excess > 0:
                protected = set(keep)
                victims = []
                for _ in range(excess):
                    victim = policy.pop_victim(protected)
                    if victim is None:
                        break
                    victims.append(victim)
                self.index.evicted(self.loc, victims)
        for position in range(len(keep) - 1, -1, -1):
            block = keep[position]
            if block in policy:
                policy.touch(block, position)
            else:
                policy.insert(block, position)
        if missing:
            self.index.stored(self.loc, missing)


@dataclass(slots=True)
class Job:
    """One request's work on the instances, and what happened to it (times in seconds)."""

    request_id: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    blocks: Sequence[int]
    cached_tokens: int = 0
    fetch_tokens: int = 0
    prefill_start_s: float = -1.0
    first_token_s: float = -1.0
    decode_join_s: float = -1.0
    finish_s: float = -1.0
    compute_s: float = 0.0
    instances: tuple[str, ...] = ()


@dataclass(slots=True)
class DecodeInstance:
    """Continuous batching: each step produces one token for every request in the batch."""

    name: str
    cost: CostModel
    capacity_tokens: int
    on_finish: Callable[[Job, float], None]
    sample_every_s: float = 10.0
    now: float = 0.0
    step_end: float | None = None  # None: idle
    batch: int = 0
    context: int = 0  # tokens of KV the batch reads per step
    reserved: int = 0
    steps: int = 0
    finishing: list[tuple[int, int, Job]] = field(default_factory=list)  # (last step, id, job)
    waiting: deque[Job] = field(default_factory=deque)
    samples: list[tuple[float, int]] = field(default_factory=list)
    next_sample_s: float = 0.0

    def join(self, job: Job, at: float) -> None:
        """`job`'s KV arrived at `at` (>= now): it joins at the next step boundary."""
        self._enqueue(self.waiting, job, at)

    def _enqueue(self, queue: deque[Job], job: Job, at: float) -> None:
        self.advance(at)
        queue.append(job)
        if self.step_end is None:  # idle: start stepping now
            self._record_until(at)
            self.now = at
            self._start_step()

    def _record_until(self, t: float) -> None:
        """Sample the batch size at every grid point (multiples of sample_every_s) before `t`."""
        while self.next_sample_s < t:
            self.samples.append((self.next_sample_s, self.batch))
            self.next_sample_s = (len(self.samples)) * self.sample_every_s

    def advance(self, until: float) -> None:
        """Run every step that ends by `until` (mutates)."""
        while self.step_end is not None and self.step_end <= until:
            self._record_until(self.step_end)
            self.now = self.step_end
            self.steps += 1
            self.context += self.batch
            self._end_prefill_chunk()
            while self.finishing and self.finishing[0][0] <= self.steps:
                job = heapq.heappop(self.finishing)[2]
                self.batch -= 1
                self.context -= job.input_tokens + job.output_tokens - 1
                self.reserved -= job.input_tokens + job.output_tokens
                job.finish_s = self.now
                self.on_finish(job, self.now)
            self._start_step()

    def _end_prefill_chunk(self) -> None:
        """A colocated instance's hook: the step's prefill chunk is done."""

    def _prefill_chunk(self) -> tuple[int, int]:
        """A colocated instance's hook: (tokens, cached context) of the next step's chunk."""
        return 0, 0

    def _start_step(self) -> None:
        waiting = self.waiting
        while waiting and (self.batch == 0 or self.reserved + _need(waiting[0]) <= self.capacity_tokens):
            job = waiting.popleft()
            job.decode_join_s = self.now
            remaining = job.output_tokens - 1  # the first token came from prefill
            if remaining <= 0:
                job.finish_s = self.now
                self.on_finish(job, self.now)
                continue
            self.batch += 1
            self.context += job.input_tokens
            self.reserved += _need(job)
            heapq.heappush(self.finishing, (self.steps + remaining, job.request_id, job))
        chunk, chunk_context = self._prefill_chunk()
        if self.batch or chunk:
            self.step_end = self.now + self.cost.mixed_step_s(chunk, chunk_context, self.batch, self.context)
        else:
            self.step_end = None


def _need(job: Job) -> int:
    return job.input_tokens + job.output_tokens


@dataclass(slots=True)
class ColocatedInstance(DecodeInstance):
    """A vLLM-like instance: prefill and decode in one batch. Each step runs the decode batch
    plus a chunk of at most `chunk_tokens` of the oldest waiting prompt (chunked prefill),
    reusing only this instance's own prefix cache."""

    cache: BlockCache | None = None
    chunk_tokens: int = 2048
    block_tokens: int = 512
    on_first_token: Callable[[Job, float], None] | None = None
    prompts: deque[Job] = field(default_factory=deque)
    head: Job | None = None
    head_done: int = 0  # prompt tokens of `head` computed (cached ones included)
    chunk: int = 0  # tokens of the step in flight

    def submit(self, job: Job, at: float) -> None:
        """A new request arrives at `at` (>= now)."""
        self._enqueue(self.prompts, job, at)

    @property
    def load(self) -> int:
        """Requests here: waiting, being prefilled, or decoding."""
        return len(self.prompts) + (self.head is not None) + self.batch + len(self.waiting)

    def _prefill_chunk(self) -> tuple[int, int]:
        if self.head is None and self.prompts:
            job = self.prompts[0]
            if self.reserved + _need(job) > self.capacity_tokens and self.batch:
                self.chunk = 0
                return 0, 0
            self.prompts.popleft()
            self.head, self.reserved = job, self.reserved + _need(job)
            assert self.cache is not None
            matched = self.cache.index.match_at(self.cache.loc, job.blocks)
            job.cached_tokens = max(0, min(matched * self.block_tokens, job.input_tokens - 1))
            job.prefill_start_s = self.now
            self.head_done = job.cached_tokens
        if self.head is None:
            self.chunk = 0
            return 0, 0
        self.chunk = min(self.chunk_tokens, self.head.input_tokens - self.head_done)
        return self.chunk, self.head_done

    def _end_prefill_chunk(self) -> None:
        job = self.head
        if job is None or not self.chunk:
            return
        self.head_done += self.chunk
        self.chunk = 0
        if self.head_done < job.input_tokens:
            return
        self.head = None
        self.reserved -= _need(job)  # NOTE: reserved again when it joins the batch
        job.first_token_s = self.now
        assert self.cache is not None and self.on_first_token is not None
        self.cache.access(job.blocks)
        self.on_first_token(job, self.now)
        self.waiting.appendleft(job)
