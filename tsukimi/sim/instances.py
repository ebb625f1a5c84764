"""The simulated machines: block caches, prefill instances, decode instances and colocated
(vLLM-like) instances, advanced on the simulator's virtual time.

Prefill instances run their queue first in, first out; a job is computed in chunks of
`chunk_tokens` (each chunk pays a full iteration: weights read, overhead) after fetching
any prefix it reuses from elsewhere. Decode and colocated instances iterate continuously;
they are advanced lazily (`advance(until)`) in tight loops, so a step costs no event in the
simulator's heap. KV memory is reserved for a request's prompt and the output its
reservation policy guesses (tsukimi/sim/reservation.py) when it joins a batch; a request that
does not fit waits, and one that outgrows its reservation grows it or is preempted.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field

from tsukimi.eviction import EvictionPolicy
from tsukimi.scheduler.cost_model import CostModel
from tsukimi.scheduler.prefix_index import PrefixIndex
from tsukimi.sim.reservation import GROWTH_TOKENS, ReservationPolicy


class BlockCache:
    """A capacity-bounded set of blocks at one index location; publishes every change to
    the index. `capacity` None = unbounded. With a `lower` tier (an SSD below DRAM) every
    access is written through to it, so the lower tier holds whole chains (a prefix match
    needs a chain's head) and keeps what DRAM evicts, until its own policy evicts it."""

    def __init__(
        self,
        loc: str,
        capacity: int | None,
        policy: EvictionPolicy[int],
        index: PrefixIndex,
        lower: BlockCache | None = None,
    ) -> None:
        self.loc, self.capacity, self.policy, self.index, self.lower = loc, capacity, policy, index, lower
        self.hot: Callable[[int], bool] | None = None  # set by a hot-spot replicator: evict these last
        self.hot_evictions = 0  # hot blocks evicted (when nothing cold was left to evict)

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
                self.index.evicted(self.loc, self._victims(set(keep), excess))
        for position in range(len(keep) - 1, -1, -1):
            block = keep[position]
            if block in policy:
                policy.touch(block, position)
            else:
                policy.insert(block, position)
        if missing:
            self.index.stored(self.loc, missing)
        if self.lower is not None:
            self.lower.access(blocks)

    def _victims(self, protected: set[int], excess: int) -> list[int]:
        """Pop up to `excess` victims outside `protected`: cold blocks first, hot ones (see
        `hot`) only when no cold block is left. Mutates the policy."""
        hot, policy = self.hot, self.policy
        cold_only: Container[int] = protected if hot is None else _ColdOnly(protected, hot)
        victims = []
        for _ in range(excess):
            victim = policy.pop_victim(cold_only)
            if victim is None and hot is not None:
                victim = policy.pop_victim(protected)
                self.hot_evictions += victim is not None
            if victim is None:
                break
            victims.append(victim)
        return victims


@dataclass(frozen=True, slots=True)
class _ColdOnly:
    """A `keep` set for eviction: the protected blocks and the hot ones."""

    protected: set[int]
    hot: Callable[[int], bool]

    def __contains__(self, block: object) -> bool:
        return block in self.protected or (isinstance(block, int) and self.hot(block))


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
    ssd_tokens: int = 0  # prompt tokens loaded from an SSD tier
    generated: int = 1  # output tokens so far (the first comes from prefill)
    reserved_tokens: int = 0  # KV tokens its decode instance holds for it now
    held_since_s: float = 0.0
    preemptions: int = 0
    decode_token_s: float = 0.0  # reserved KV tokens x seconds held, summed over its stays
    epoch: int = 0  # bumped on preemption: older heap entries of the job are stale


@dataclass(slots=True)
class DecodeInstance:
    """Continuous batching: each step produces one token for every request in the batch."""

    name: str
    cost: CostModel
    capacity_tokens: int
    on_finish: Callable[[Job, float], None]
    sample_every_s: float = 10.0
    reservation: ReservationPolicy | None = None  # None: the oracle
    now: float = 0.0
    step_end: float | None = None  # None: idle
    batch: int = 0
    context: int = 0  # tokens of KV the batch reads per step
    reserved: int = 0
    steps: int = 0
    finishing: list[tuple[int, int, int, Job]] = field(default_factory=list)  # (last step, id, epoch, job)
    limits: list[tuple[int, int, int, Job]] = field(default_factory=list)  # (step its reservation runs out, ...)
    recompute: int = 0  # tokens of preempted requests recomputed in the step in flight
    preemptions: int = 0
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
            self.recompute = 0
            self._end_prefill_chunk()
            while self.finishing and self.finishing[0][0] <= self.steps:
                _, _, epoch, job = heapq.heappop(self.finishing)
                if epoch == job.epoch:
                    self._leave(job, job.output_tokens)
                    job.finish_s = self.now
                    self.on_finish(job, self.now)
            while self.limits and self.limits[0][0] <= self.steps:
                _, _, epoch, job = heapq.heappop(self.limits)
                if epoch == job.epoch and job.finish_s < 0:
                    self._outgrown(job)
            self._start_step()

    def _leave(self, job: Job, generated: int) -> None:
        """`job` leaves the batch having generated `generated` tokens: free its KV."""
        self.batch -= 1
        self.context -= job.input_tokens + generated - 1
        self.reserved -= job.reserved_tokens
        job.decode_token_s += job.reserved_tokens * (self.now - job.held_since_s)
        job.reserved_tokens = 0

    def _outgrown(self, job: Job) -> None:
        """`job` has filled its reservation: grow it by GROWTH_TOKENS, or preempt it when the
        instance has no room (it rejoins at the head of the queue and is recomputed)."""
        generated = job.reserved_tokens - job.input_tokens
        if self.reserved + GROWTH_TOKENS <= self.capacity_tokens:
            job.decode_token_s += job.reserved_tokens * (self.now - job.held_since_s)
            job.reserved_tokens += GROWTH_TOKENS
            job.held_since_s = self.now
            self.reserved += GROWTH_TOKENS
            self._push_limit(job, generated)
            return
        self._leave(job, generated)
        job.generated, job.epoch = generated, job.epoch + 1
        job.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(job)

    def _push_limit(self, job: Job, generated: int) -> None:
        """Schedule the step at which `job` (having `generated` tokens now) fills its reservation."""
        room = job.reserved_tokens - job.input_tokens - generated
        if generated + room < job.output_tokens:
            heapq.heappush(self.limits, (self.steps + room, job.request_id, job.epoch, job))

    def _need(self, job: Job) -> int:
        """KV tokens to reserve for `job` joining now."""
        if self.reservation is None:
            return job.input_tokens + job.output_tokens
        return job.input_tokens + self.reservation.output_tokens(job.output_tokens, job.generated)

    def _end_prefill_chunk(self) -> None:
        """A colocated instance's hook: the step's prefill chunk is done."""

    def _prefill_chunk(self) -> tuple[int, int]:
        """A colocated instance's hook: (tokens, cached context) of the next step's chunk."""
        return 0, 0

    def _start_step(self) -> None:
        waiting = self.waiting
        while waiting and (self.batch == 0 or self.reserved + self._need(waiting[0]) <= self.capacity_tokens):
            job = waiting.popleft()
            if job.generated == 1:
                job.decode_join_s = self.now
            remaining = job.output_tokens - job.generated
            if remaining <= 0:
                job.finish_s = self.now
                self.on_finish(job, self.now)
                continue
            if job.generated > 1:  # NOTE: preempted: its prompt and output so far are recomputed
                self.recompute += job.input_tokens + job.generated - 1
            self.batch += 1
            self.context += job.input_tokens + job.generated - 1
            job.reserved_tokens, job.held_since_s = self._need(job), self.now
            self.reserved += job.reserved_tokens
            heapq.heappush(self.finishing, (self.steps + remaining, job.request_id, job.epoch, job))
            self._push_limit(job, job.generated)
        chunk, chunk_context = self._prefill_chunk()
        chunk += self.recompute
        if self.batch or chunk:
            self.step_end = self.now + self.cost.mixed_step_s(chunk, chunk_context, self.batch, self.context)
        else:
            self.step_end = None


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
    head_reserved: int = 0  # KV tokens reserved for `head` while it is prefilled
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
            if self.reserved + self._need(job) > self.capacity_tokens and self.batch:
                self.chunk = 0
                return 0, 0
            self.prompts.popleft()
            self.head, self.head_reserved = job, self._need(job)
            self.reserved += self.head_reserved
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
        self.reserved -= self.head_reserved  # NOTE: reserved again when it joins the batch
        job.first_token_s = self.now
        assert self.cache is not None and self.on_first_token is not None
        self.cache.access(job.blocks)
        self.on_first_token(job, self.now)
        self.waiting.appendleft(job)
