"""The `tsukimi sim cache` experiment: the prefix-cache hit ratio of a trace under one global
pool of KV-cache blocks, per eviction policy and capacity (the paper's Table 1 setting).

This module owns the replay semantics; every other detail of the cluster is left out:

- requests are replayed in file order (timestamps are ignored);
- a request's hit is the longest prefix of its ``hash_ids`` resident when it arrives;
- then every block of the request is accessed, last to first (block k with ``position=k``):
  resident blocks are touched, missing ones inserted. Under LRU the first block thus ends up
  most recently used and a chain is evicted from its tail;
- the blocks of the request being inserted are never evicted to make room for it;
- a request longer than the cache keeps its first C blocks (C = capacity): only
  ``hash_ids[:C]`` are accessed; whatever else is resident is evicted as needed;
- block k holds ``min(512, input_length - 512 k)`` tokens (`tsukimi.sim.trace.block_tokens`);
- token hit ratio = hit tokens / all input tokens, block hit ratio = hit blocks / all blocks.

With an infinite capacity nothing is ever evicted, so the result does not depend on the
policy and a plain set replaces it.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from tsukimi.errors import ConfigError
from tsukimi.eviction import EvictionPolicy, make_policy
from tsukimi.sim.trace import BLOCK_SIZE_TOKENS, TraceRequest, load_trace

CACHE_POLICIES: tuple[str, ...] = ("lru", "lfu", "length-aware")
"""Policy names as the CLI spells them (``length_aware`` is accepted too)."""


@dataclass(frozen=True, slots=True)
class CacheResult:
    """Hit ratios of one replay. `capacity_blocks` None means an infinite pool."""

    policy: str
    capacity_blocks: int | None
    token_hit_ratio: float
    block_hit_ratio: float


def canonical_policy(name: str) -> str:
    """The CLI spelling of a policy name ("length_aware" -> "length-aware").

    Raises:
        ConfigError: an unknown name (the message lists the valid ones).
    """
    canonical = name.replace("_", "-")
    if canonical not in CACHE_POLICIES:
        raise ConfigError(f"unknown cache policy {name!r}: expected one of {', '.join(CACHE_POLICIES)}")
    return canonical


def parse_capacities(text: str) -> list[int | None]:
    """Parse a comma-separated list of capacities in blocks, e.g. ``"1000,5000,inf"``.

    Args:
        text: positive integers or ``inf`` (any case), separated by commas.

    Returns:
        One entry per item, in order; None for ``inf``.

    Raises:
        ConfigError: an empty list or item, a non-integer, zero or a negative number.
    """
    capacities: list[int | None] = []
    for item in text.split(","):
        item = item.strip()
        if item.lower() == "inf":
            capacities.append(None)
            continue
        try:
            value = int(item)
        except ValueError:
            raise ConfigError(
                f"bad cache capacity {item!r} in {text!r}: expected a positive integer or 'inf'"
            ) from None
        if value <= 0:
            raise ConfigError(f"cache capacity must be positive, got {value} in {text!r}")
        capacities.append(value)
    return capacities


def replay_cache(requests: Sequence[TraceRequest], policy: str, capacity_blocks: int | None) -> CacheResult:
    """Replay `requests` through one pool of `capacity_blocks` blocks (see the module docstring).

    Args:
        requests: the trace, in order.
        policy: "lru", "lfu" or "length-aware" ("length_aware").
        capacity_blocks: pool size in blocks; None for an infinite pool.

    Returns:
        The hit ratios (0.0 for an empty trace); `policy` in its CLI spelling.

    Raises:
        ConfigError: an unknown policy or a capacity that is not positive.
    """
    name = canonical_policy(policy)
    if capacity_blocks is not None and capacity_blocks <= 0:
        raise ConfigError(f"cache capacity must be positive, got {capacity_blocks}")
    if capacity_blocks is None:
        hit_blocks, hit_tokens = _replay_infinite(requests)
    else:
        hit_blocks, hit_tokens = _replay_bounded(requests, make_policy(name), capacity_blocks)
    total_blocks = sum(len(r.hash_ids) for r in requests)
    total_tokens = sum(r.input_length for r in requests)
    return CacheResult(
        policy=name,
        capacity_blocks=capacity_blocks,
        token_hit_ratio=hit_tokens / total_tokens if total_tokens else 0.0,
        block_hit_ratio=hit_blocks / total_blocks if total_blocks else 0.0,
    )


def _replay_infinite(requests: Sequence[TraceRequest]) -> tuple[int, int]:
    """(hit blocks, hit tokens) with an infinite pool: a set of every id seen so far."""
    resident: set[int] = set()
    hit_blocks = hit_tokens = 0
    for request in requests:
        hit = 0
        for key in request.hash_ids:
            if key not in resident:
                break
            hit += 1
        hit_blocks += hit
        # NOTE: the first `hit` blocks hold min(input_length, 512 * hit) tokens together.
        hit_tokens += min(request.input_length, BLOCK_SIZE_TOKENS * hit)
        resident.update(request.hash_ids)
    return hit_blocks, hit_tokens


def _replay_bounded(requests: Sequence[TraceRequest], pool: EvictionPolicy[int], capacity: int) -> tuple[int, int]:
    """(hit blocks, hit tokens) with a pool of `capacity` blocks ordered by `pool`.

    NOTE: all the room a request needs is made before its blocks are accessed. That evicts
    exactly the keys that evicting one key before each insertion would: the request's own
    blocks are kept either way, and touching or inserting a kept key never changes the order
    of the others. It is much faster for LFU-like heaps, which would otherwise pop and push
    back the request's freshly inserted blocks on every eviction.
    """
    # NOTE: `resident` mirrors the policy's keys so that membership is a C-level set lookup;
    # the policy methods are bound once because this loop runs per block.
    resident: set[int] = set()
    add, discard = resident.add, resident.discard
    touch, insert, pop_victim = pool.touch, pool.insert, pool.pop_victim
    hit_blocks = hit_tokens = 0
    for request in requests:
        blocks = request.hash_ids
        if len(blocks) > capacity:
            blocks = blocks[:capacity]
        hit = 0
        for key in blocks:
            if key not in resident:
                break
            hit += 1
        hit_blocks += hit
        hit_tokens += min(request.input_length, BLOCK_SIZE_TOKENS * hit)
        if hit < len(blocks):
            keep = frozenset(blocks)
            for _ in range(len(resident) + len(keep - resident) - capacity):
                victim = pop_victim(keep)
                # At most len(keep) - 1 < capacity kept keys are resident, so one is not.
                assert victim is not None
                discard(victim)
        for position in range(len(blocks) - 1, -1, -1):
            key = blocks[position]
            if key in resident:
                touch(key, position)
            else:
                insert(key, position)
                add(key)
    return hit_blocks, hit_tokens


def sweep_cache(
    requests: Sequence[TraceRequest], policies: Sequence[str], capacities: Sequence[int | None]
) -> list[CacheResult]:
    """Replay every (policy, capacity) pair, policies outer, capacities inner.

    Raises:
        ConfigError: an unknown policy or a capacity that is not positive.
    """
    return [replay_cache(requests, policy, capacity) for policy in policies for capacity in capacities]


def cache_report(
    trace_name: str, requests: Sequence[TraceRequest], policies: Sequence[str], capacities: Sequence[int | None]
) -> dict[str, object]:
    """`sweep_cache` as one JSON-ready object.

    Returns:
        ``{"trace": trace_name, "results": [{"policy", "capacity_blocks" (None = inf),
        "token_hit_ratio", "block_hit_ratio"}, ...]}``, policies outer, capacities inner.

    Raises:
        ConfigError: an unknown policy or a capacity that is not positive.
    """
    return _report(trace_name, sweep_cache(requests, policies, capacities))


def _report(trace_name: str, results: list[CacheResult]) -> dict[str, object]:
    rows = [
        {
            "policy": r.policy,
            "capacity_blocks": r.capacity_blocks,
            "token_hit_ratio": r.token_hit_ratio,
            "block_hit_ratio": r.block_hit_ratio,
        }
        for r in results
    ]
    return {"trace": trace_name, "results": rows}


def run_cache_command(trace_path: str, policies: list[str], capacities: list[int | None], as_json: bool) -> str:
    """What `tsukimi sim cache` prints: one JSON object, or a table.

    Args:
        trace_path: the JSONL trace; the report names it by its file name only, so the output
            does not depend on the directory it was run from.
        policies: policy names (see `replay_cache`).
        capacities: pool sizes in blocks, None for infinite (see `parse_capacities`).
        as_json: print `cache_report` as JSON (byte-identical for identical inputs).

    Returns:
        The text to print, without a trailing newline.

    Raises:
        ConfigError: an unknown policy or a capacity that is not positive (checked before the
            trace is read).
        InvalidArgument: the trace cannot be read or is invalid.
    """
    for policy in policies:
        canonical_policy(policy)
    for capacity in capacities:
        if capacity is not None and capacity <= 0:
            raise ConfigError(f"cache capacity must be positive, got {capacity}")
    trace_name = os.path.basename(trace_path)
    results = sweep_cache(load_trace(trace_path), policies, capacities)
    if as_json:
        return json.dumps(_report(trace_name, results), sort_keys=False)
    return _render_table(trace_name, results)


def _render_table(trace_name: str, results: list[CacheResult]) -> str:
    table = Table(title=f"Prefix-cache hit ratio: {trace_name}")
    table.add_column("policy")
    table.add_column("capacity (blocks)", justify="right")
    table.add_column("token hit ratio", justify="right")
    table.add_column("block hit ratio", justify="right")
    for r in results:
        capacity = "inf" if r.capacity_blocks is None else f"{r.capacity_blocks:,}"
        table.add_row(r.policy, capacity, f"{r.token_hit_ratio:.4f}", f"{r.block_hit_ratio:.4f}")
    buffer = io.StringIO()
    Console(file=buffer, width=100, color_system=None, force_terminal=False).print(table)
    return buffer.getvalue().rstrip("\n")
