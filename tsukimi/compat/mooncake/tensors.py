"""The tensor part of `MooncakeDistributedStore` (put_tensor / get_tensor, batch, upsert, pub
with a ReplicateConfig, from and into caller buffers, with_tp) over tsukimi's own tensor API
(tsukimi/store/tensors.py). The with_parallelism family is tensor_parallel.py's part.

Conventions, as Mooncake's: puts return 0 (also for a key that already exists: the old
value stays) or a negative code, per key for batches; gets return a tensor or None. A
tensor read into a caller's buffer is a view of that buffer (`[header][payload]`, the
layout the `*_from` puts take back). `*_with_tp` puts cut the tensor into tp_size shards
stored under `{key}_tp_{rank}`, whatever tp_rank says (every rank is written).
"""

from __future__ import annotations

import logging

import torch

from tsukimi.compat.mooncake.codes import INVALID_PARAMS
from tsukimi.compat.mooncake.connection import StoreConnection
from tsukimi.compat.mooncake.tensor_calls import ReplicaSettings, address_buffers, get_tensors, put_codes, put_options
from tsukimi.errors import InvalidArgument
from tsukimi.store import tensors as t
from tsukimi.store.client import StoreClient

logger = logging.getLogger(__name__)


class Tensors:
    """Whole tensors and TP shards, per key (each call answers one code or tensor per key).
    `config` may raise InvalidArgument for what tsukimi cannot store (replicate.py)."""

    def __init__(self, connection: StoreConnection) -> None:
        self._connection = connection

    # -- whole tensors -----------------------------------------------------------------

    def put(
        self, keys: list[str], tensors_list: list[torch.Tensor], config: ReplicaSettings | None, upsert: bool
    ) -> list[int]:
        """Each tensor under its key: 0 or a negative code per key."""
        what = "upsert_tensor" if upsert else "put_tensor"
        return put_codes(
            self._connection,
            what,
            len(keys),
            lambda c: t.batch_put_tensors(c, keys, tensors_list, put_options(config, upsert, len(keys))),
        )

    def get(self, keys: list[str]) -> list[torch.Tensor | None]:
        """Each key's tensor, or None."""
        return get_tensors(self._connection, "get_tensor", len(keys), lambda c: t.batch_get_tensors(c, keys))

    def get_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[torch.Tensor | None] | list[int]:
        """Each tensor read into its buffer (a view of it), or None (miss, too small, ...);
        as Mooncake, a negative code per key when the lists differ in length."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            logger.error("get_tensor_into: %d keys, %d buffers, %d sizes", len(keys), len(buffer_ptrs), len(sizes))
            return [INVALID_PARAMS] * len(keys)
        return get_tensors(
            self._connection,
            "get_tensor_into",
            len(keys),
            lambda c: t.batch_get_tensors(c, keys, address_buffers(buffer_ptrs, sizes)),
        )

    def put_from(self, keys: list[str], ptrs: list[int], sizes: list[int], upsert: bool) -> list[int]:
        """Store `[header][payload]` buffers as they are (zero-copy)."""
        options = put_options(None, upsert, len(keys))
        return put_codes(
            self._connection,
            "put_tensor_from",
            len(keys),
            lambda c: t.batch_put_serialized(c, keys, address_buffers(ptrs, sizes), options),
        )

    # -- tensor parallelism ------------------------------------------------------------

    def put_with_tp(
        self,
        base_keys: list[str],
        tensors_list: list[torch.Tensor],
        config: ReplicaSettings | None,
        tp_rank: int,
        tp_size: int,
        split_dim: int,
    ) -> list[int]:
        """Every shard of every tensor; -600 for a tensor that does not split evenly."""

        def run(client: StoreClient) -> list[t.PutError]:
            _check_tp(tp_rank, tp_size)
            options = put_options(config, False, len(base_keys))
            return t.batch_put_tensors_with_tp(client, base_keys, tensors_list, tp_size, split_dim, options)

        return put_codes(self._connection, "put_tensor_with_tp", len(base_keys), run)

    def put_with_tp_from(
        self, base_keys: list[str], buffer_ptrs: list[int], sizes: list[int], tp_rank: int, tp_size: int, split_dim: int
    ) -> list[int]:
        """The whole tensors held in `[header][payload]` buffers, cut and stored as with_tp."""

        def run(client: StoreClient) -> list[t.PutError]:
            _check_tp(tp_rank, tp_size)
            tensors = [t.tensor_in(b) for b in address_buffers(buffer_ptrs, sizes)]
            return t.batch_put_tensors_with_tp(client, base_keys, tensors, tp_size, split_dim)

        return put_codes(self._connection, "put_tensor_with_tp_from", len(base_keys), run)

    def get_with_tp(self, base_keys: list[str], tp_rank: int, tp_size: int) -> list[torch.Tensor | None]:
        """Rank `tp_rank`'s shard of each tensor, or None."""
        return get_tensors(
            self._connection,
            "get_tensor_with_tp",
            len(base_keys),
            lambda c: t.batch_get_tensors_with_tp(c, base_keys, tp_rank, tp_size),
        )

    def get_with_tp_into(
        self, base_keys: list[str], buffer_ptrs: list[int], sizes: list[int], tp_rank: int, tp_size: int
    ) -> list[torch.Tensor | None]:
        """Rank `tp_rank`'s shard of each tensor read into its buffer (a view of it), or None."""

        def run(client: StoreClient) -> list[t.TensorResult]:
            buffers = address_buffers(buffer_ptrs, sizes)
            return t.batch_get_tensors_with_tp(client, base_keys, tp_rank, tp_size, buffers)

        return get_tensors(self._connection, "get_tensor_with_tp_into", len(base_keys), run)


def _check_tp(tp_rank: int, tp_size: int) -> None:
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise InvalidArgument(f"tp_rank {tp_rank} / tp_size {tp_size}: needs tp_size >= 1, 0 <= tp_rank < tp_size")
