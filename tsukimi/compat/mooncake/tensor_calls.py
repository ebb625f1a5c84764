"""The plumbing both tensor parts of the Mooncake facade (tensors.py, tensor_parallel.py)
share: reaching the client through the store's connection, `ReplicateConfig` to
`PutOptions`, Mooncake's return conventions (0 or a negative code per key for puts, a tensor
or None per key for gets) and logging what failed."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from tsukimi.compat.mooncake.codes import INVALID_PARAMS, OK, RPC_FAIL, code_of
from tsukimi.compat.mooncake.connection import StoreConnection
from tsukimi.errors import InvalidArgument, KVFormatError, ObjectExists, TsukimiError
from tsukimi.store import protocol as p
from tsukimi.store.client import StoreClient
from tsukimi.store.tensors import PutError, PutOptions, TensorResult

logger = logging.getLogger(__name__)


class ReplicaSettings(Protocol):
    """What the facade's `ReplicateConfig` offers this module."""

    def per_key(self, num_keys: int, own_segment: str = "") -> list[p.ReplicaConfig]: ...


def put_options(config: ReplicaSettings | None, upsert: bool, num_keys: int) -> PutOptions:
    """The tsukimi put options for a Mooncake `ReplicateConfig` (None: one replica) given to
    a put of `num_keys` keys: each key's own config (its `group_ids` / `session_ids` entry).

    Raises:
        InvalidArgument: what tsukimi cannot store, or per-key ids for another number of keys.
    """
    if config is None:
        return PutOptions(upsert=upsert)
    return PutOptions(upsert=upsert, per_key=tuple(config.per_key(num_keys)))


def address_buffers(ptrs: Sequence[int], sizes: Sequence[int]) -> list[tuple[int, int]]:
    """(address, length) buffers. Raises InvalidArgument if the lists differ in length."""
    if len(ptrs) != len(sizes):
        raise InvalidArgument(f"{len(ptrs)} buffer pointers but {len(sizes)} sizes")
    return list(zip(ptrs, sizes, strict=True))


def tensor_code(error: TsukimiError) -> int:
    """Mooncake's code for a tensor call's error: a buffer or object that holds no tensor
    (KVFormatError) is the caller's invalid argument (-600)."""
    return INVALID_PARAMS if isinstance(error, KVFormatError) else code_of(error)


def put_codes(
    connection: StoreConnection, what: str, count: int, run: Callable[[StoreClient], list[PutError]]
) -> list[int]:
    """Mooncake codes for `count` keys put by `run`: 0 per stored (or already present) key,
    else the error's code; the same code for every key when the call failed (logged)."""
    client = connection.ready()
    if client is None:
        return [RPC_FAIL] * count
    try:
        errors = run(client)
    except TsukimiError as exc:
        logger.error("%s failed: %s", what, exc)
        return [tensor_code(exc)] * count
    codes = []
    for error in errors:
        # NOTE: Mooncake answers a put of an existing key with success and keeps the old value
        if error is None or isinstance(error, ObjectExists):
            codes.append(OK)
            continue
        logger.error("%s failed: %s", what, error)
        codes.append(tensor_code(error))
    return codes


def get_tensors(
    connection: StoreConnection, what: str, count: int, run: Callable[[StoreClient], list[TensorResult]]
) -> list[torch.Tensor | None]:
    """The tensors `run` read for `count` keys, None for a miss or a failure (logged)."""
    client = connection.ready()
    if client is None:
        return [None] * count
    try:
        results = run(client)
    except TsukimiError as exc:
        logger.error("%s failed: %s", what, exc)
        return [None] * count
    for result in results:
        if result.error is not None:
            logger.error("%s failed: %s", what, result.error)
    return [r.tensor for r in results]
