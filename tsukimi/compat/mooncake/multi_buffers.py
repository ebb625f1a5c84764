"""`MooncakeDistributedStore.batch_put_from_multi_buffers` / `batch_get_into_multi_buffers`
(`MultiBufferCalls`), on tsukimi's `StoreClient.batch_put_parts` / `batch_get_parts`:
each key's value is the concatenation of several buffers, given as parallel lists of
addresses and sizes, moved straight from and into those buffers (what vLLM's
MooncakeStoreConnector does with one KV block of every layer under one key).

    keys      = ["k1",             "k2"]
    all_ptrs  = [[a0, a1],         [b0]]
    all_sizes = [[100, 50],        [64]]      -> k1 is a0[0:100] + a1[0:50], k2 is b0[0:64]

Return conventions (Mooncake 0.3.x, checked against its wheel): per key, a put gives 0 or a
negative code; a get gives the bytes read or a negative code. Lists of keys, buffers and sizes
of different lengths fail every key with -600; a key whose address and size lists differ in
length fails with -600; -704 for a missing key. Where tsukimi is stricter than the wheel:
a get whose sizes add up to more than the object is -600 (the wheel answers -800 after trying
the transfer), and a get key with more addresses than sizes is -600 (the wheel ignores the
extra addresses). Buffers need not be registered, as in Mooncake's zero-copy calls.
"""

from __future__ import annotations

import logging

from tsukimi.compat.mooncake.buffers import memory_at
from tsukimi.compat.mooncake.codes import INVALID_PARAMS, OBJECT_NOT_FOUND, OK, RPC_FAIL, code_of
from tsukimi.compat.mooncake.connection import StoreConnection
from tsukimi.compat.mooncake.replicate import ReplicateConfig
from tsukimi.device import DeviceRange
from tsukimi.errors import InvalidBufferError, ObjectExists, TsukimiError

logger = logging.getLogger(__name__)

Buffers = list[DeviceRange | tuple[int, int]]  # each part of one key: device memory, or (address, size)


class MultiBufferCalls:
    """Puts and gets of objects made of several caller buffers (zero-copy)."""

    def __init__(self, connection: StoreConnection) -> None:
        self._connection = connection

    def put(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        config: ReplicateConfig | None,
    ) -> list[int]:
        """Put each key from its buffers (zero-copy): 0 or a negative code per key (an
        existing key answers 0 and keeps its value, as Mooncake's puts do; per-key ids in
        `config` of another length than `keys`: -600 for every key, nothing stored)."""
        if config is not None and not isinstance(config, ReplicateConfig):
            raise TypeError(f"config must be a ReplicateConfig, got {type(config).__name__}")
        plan = _plan(keys, all_buffer_ptrs, all_sizes, "put")
        client = self._connection.ready()
        if client is None:
            return [RPC_FAIL] * len(keys)
        codes, slots, parts = _split(plan)
        try:
            replicas = (config or ReplicateConfig()).per_key(len(keys), self._connection.hostname)
            items = [(keys[i], p) for i, p in zip(slots, parts, strict=True)]
            errors = client.batch_put_parts(items, configs=[replicas[i] for i in slots])
        except TsukimiError as exc:
            logger.error("batch_put_from_multi_buffers failed: %s", exc)
            return [code_of(exc)] * len(keys)
        for i, error in zip(slots, errors, strict=True):
            if error is not None and not isinstance(error, ObjectExists):
                logger.error("put %r: %s", keys[i], error)
            codes[i] = OK if isinstance(error, ObjectExists) else code_of(error)
        return codes

    def get(self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]]) -> list[int]:
        """Read each key into its buffers, in order: the bytes read, or a negative code per
        key (-704 missing, -600 buffers that do not add up to the object, -800 unreadable)."""
        plan = _plan(keys, all_buffer_ptrs, all_sizes, "get")
        client = self._connection.ready()
        if client is None:
            return [RPC_FAIL] * len(keys)
        codes, slots, parts = _split(plan)
        try:
            results = client.batch_get_parts([keys[i] for i in slots], parts)
        except TsukimiError as exc:
            logger.error("batch_get_into_multi_buffers failed: %s", exc)
            return [code_of(exc)] * len(keys)
        for i, result in zip(slots, results, strict=True):
            if result.error is not None:
                logger.error("get %r: %s", keys[i], result.error)
                codes[i] = code_of(result.error)
            else:
                codes[i] = result.size if result.found else OBJECT_NOT_FOUND
        return codes


def _plan(keys: list[str], ptrs: list[list[int]], sizes: list[list[int]], what: str) -> list[Buffers | int]:
    """Each key's (address, size) parts, or INVALID_PARAMS for a key whose lists are unusable."""
    if not len(keys) == len(ptrs) == len(sizes):
        logger.error("%s: %d keys, %d buffer lists, %d size lists", what, len(keys), len(ptrs), len(sizes))
        return [INVALID_PARAMS] * len(keys)
    plan: list[Buffers | int] = []
    for key, key_ptrs, key_sizes in zip(keys, ptrs, sizes, strict=True):
        try:
            plan.append(_parts(key, key_ptrs, key_sizes))
        except InvalidBufferError as exc:
            logger.error("%s %r: %s", what, key, exc)
            plan.append(INVALID_PARAMS)
    return plan


def _split(plan: list[Buffers | int]) -> tuple[list[int], list[int], list[Buffers]]:
    """The codes so far (OK where there is something to move), the places of the keys to
    move, and their parts."""
    codes = [OK] * len(plan)
    slots: list[int] = []
    parts: list[Buffers] = []
    for i, planned in enumerate(plan):
        if isinstance(planned, int):
            codes[i] = planned
        else:
            slots.append(i)
            parts.append(planned)
    return codes, slots, parts


def _parts(key: str, ptrs: list[int], sizes: list[int]) -> Buffers:
    """Raises InvalidBufferError: lists of different lengths, none, a null or empty part, or
    device memory past its allocation."""
    if len(ptrs) != len(sizes) or not ptrs:
        raise InvalidBufferError(f"{len(ptrs)} buffers but {len(sizes)} sizes")
    for ptr, size in zip(ptrs, sizes, strict=True):
        if not isinstance(ptr, int) or not isinstance(size, int) or ptr <= 0 or size <= 0:
            raise InvalidBufferError(f"cannot use {size!r} bytes at {ptr!r} for {key!r}")
    return [memory_at(ptr, size) for ptr, size in zip(ptrs, sizes, strict=True)]
