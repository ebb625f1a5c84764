"""The `pool` workload of `tsukimi bench serve` (issue 26 item 5): many distinct long documents
and conversations whose working set exceeds each instance's KV cache, so that reuse must come
from the KV pool rather than from the instance that happened to compute a prefix.

Built from a Mooncake trace (the conversation trace's `hash_ids`, 512-token chained blocks):

    family     the requests that share their first two trace blocks (block 0 is every request's
               system prompt): one conversation's turns, or questions over one document, in
               trace order; a family ends before its first request longer than
               `max_prompt_tokens`, and only families of >= `min_turns` requests are kept
               (the first `families`, each cut to `turns`)
    tokens     each trace block becomes `trace_block_tokens` token ids drawn from its hash id
               (a few of the tiny model's 16-token blocks), so the same hash id is the same
               tokens wherever it appears and shared prefixes stay shared; a prompt is its
               trace length scaled by `trace_block_tokens` / 512
    schedule   round by round (every family's turn 1, then every family's turn 2, ...), one
               request every 1 / `rate` s; a turn is sent at its time or when its family's
               previous turn has ended, whichever is later (tsukimi/bench/serve.py sends them)

Between two turns of a family every other family's turn runs, so a family's prefix is far
back in any one instance's cache: an instance holding a quarter of the working set has
usually evicted it, the pool still holds it. `sizing` counts the working set (distinct full
16-token blocks over all prompts) and sizes each instance's cache from it. Everything here is
pure: the same trace and workload give the same requests.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tsukimi.errors import ConfigError
from tsukimi.sim.trace import TraceRequest

TRACE_BLOCK_TOKENS = 512  # the Mooncake traces' block size
_VOCAB = (3, 250)  # NOTE: ids every tokenizer here has (as the other workloads); only reuse matters


@dataclass(frozen=True, slots=True)
class PoolWorkload:
    """The workload's shape (see the module). num_blocks: each worker's KV cache in blocks, 0 =
    `cache_fraction` of the working set, or what two of the longest requests need if more."""

    families: int = 24
    turns: int = 4
    min_turns: int = 3
    trace_block_tokens: int = 128  # 8 of the tiny model's blocks per trace block
    max_prompt_tokens: int = 4000  # NOTE: the tiny model's context is 4096 tokens, the output included
    max_tokens: int = 8
    rate: float = 1.0  # requests per second (NOTE: one prefill worker keeps up on a loaded 2-CPU box)
    cache_fraction: float = 0.25
    num_blocks: int = 0

    def __post_init__(self) -> None:
        for name in ("families", "turns", "trace_block_tokens", "max_prompt_tokens", "max_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"pool workload {name} must be >= 1, got {getattr(self, name)}")
        if not 2 <= self.min_turns <= self.turns:
            raise ConfigError(
                f"pool workload needs 2 <= min_turns <= turns (reuse needs a second turn), got {self.min_turns} "
                f"and {self.turns}"
            )
        if not (self.rate > 0 and 0 < self.cache_fraction <= 1 and self.num_blocks >= 0):
            raise ConfigError(
                f"pool workload needs rate > 0, 0 < cache_fraction <= 1, num_blocks >= 0; got {self.rate}, "
                f"{self.cache_fraction}, {self.num_blocks}"
            )


QUICK_POOL = PoolWorkload(
    families=4, turns=2, min_turns=2, trace_block_tokens=32, max_prompt_tokens=512, max_tokens=4, rate=8.0
)


@dataclass(frozen=True, slots=True)
class PoolRequest:
    """One request of the workload: its send time (from the start of the run), its family and
    turn (0-based), its prompt and how many tokens it generates."""

    at_s: float
    family: int
    turn: int
    prompt: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class PoolSizing:
    """The working set in `block_tokens`-token blocks (distinct full blocks over every prompt),
    the largest request's blocks (prompt + output), each worker's cache (`num_blocks`) and the
    share of the working set that cache holds."""

    working_set_blocks: int
    largest_request_blocks: int
    num_blocks: int
    cache_fraction: float


def families(trace: Sequence[TraceRequest], workload: PoolWorkload) -> list[list[TraceRequest]]:
    """The trace's families (see the module), in the order they start, each in trace order.
    Pure.

    Raises:
        ConfigError: the trace holds fewer than `workload.families` families of `min_turns` or
            more requests that fit.
    """
    max_blocks = workload.max_prompt_tokens // workload.trace_block_tokens
    by_key: dict[int, list[TraceRequest]] = {}
    closed: set[int] = set()
    for request in trace:
        if len(request.hash_ids) < 2 or request.hash_ids[1] in closed:
            continue
        key = request.hash_ids[1]
        if len(request.hash_ids) > max_blocks:
            closed.add(key)  # NOTE: a later turn must not skip this one: it would lose its prefix
            continue
        by_key.setdefault(key, []).append(request)
    found = [members[: workload.turns] for members in by_key.values() if len(members) >= workload.min_turns]
    if len(found) < workload.families:
        raise ConfigError(
            f"the trace holds {len(found)} families of >= {workload.min_turns} requests within "
            f"{workload.max_prompt_tokens} tokens, the workload asks for {workload.families}"
        )
    return found[: workload.families]


def prompt_tokens(request: TraceRequest, trace_block_tokens: int) -> tuple[int, ...]:
    """The token ids standing for `request`: each hash id's own `trace_block_tokens` ids, cut
    to the trace's length scaled by `trace_block_tokens` / 512 (at least one token). Pure."""
    tokens: list[int] = []
    for block in request.hash_ids:
        tokens += np.random.default_rng(block).integers(*_VOCAB, trace_block_tokens).tolist()
    scaled = round(request.input_length * trace_block_tokens / TRACE_BLOCK_TOKENS)
    return tuple(tokens[: max(1, min(scaled, len(tokens)))])


def pool_requests(trace: Sequence[TraceRequest], workload: PoolWorkload) -> list[PoolRequest]:
    """The workload's requests in send order: round by round, one every 1 / rate s. Pure.

    Raises:
        ConfigError: the trace has too few families (see `families`).
    """
    chosen = families(trace, workload)
    order = sorted(((turn, family) for family, members in enumerate(chosen) for turn in range(len(members))))
    return [
        PoolRequest(
            position / workload.rate,
            family,
            turn,
            prompt_tokens(chosen[family][turn], workload.trace_block_tokens),
            workload.max_tokens,
        )
        for position, (turn, family) in enumerate(order)
    ]


def block_keys(prompt: Sequence[int], block_tokens: int) -> list[bytes]:
    """The chained keys of the prompt's full blocks: equal keys, equal prefixes. Pure."""
    keys: list[bytes] = []
    previous = b""
    for start in range(0, len(prompt) - block_tokens + 1, block_tokens):
        chunk = np.asarray(prompt[start : start + block_tokens], dtype=np.int64).tobytes()
        previous = hashlib.blake2b(previous + chunk, digest_size=16).digest()
        keys.append(previous)
    return keys


def sizing(requests: Sequence[PoolRequest], workload: PoolWorkload, block_tokens: int = 16) -> PoolSizing:
    """The working set of `requests` and each worker's cache (see `PoolSizing`). Pure.

    Raises:
        ConfigError: no requests.
    """
    if not requests:
        raise ConfigError("the pool workload has no requests to size a cache for")
    distinct = {key for r in requests for key in block_keys(r.prompt, block_tokens)}
    largest = max(math.ceil((len(r.prompt) + r.max_tokens) / block_tokens) for r in requests)
    num_blocks = workload.num_blocks or max(math.ceil(len(distinct) * workload.cache_fraction), 2 * largest)
    return PoolSizing(len(distinct), largest, num_blocks, round(num_blocks / max(1, len(distinct)), 4))
