"""The tensor family of `MooncakeDistributedStore` (put_tensor / get_tensor, batch, upsert,
pub with a ReplicateConfig, from and into caller buffers, with_tp), as a mixin of store.py's
class, over tsukimi's own tensor API (tsukimi/store/tensors.py). The with_parallelism
family comes from tensor_parallel.py's mixin.

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
from tsukimi.compat.mooncake.tensor_calls import ReplicaSettings, address_buffers, put_options
from tsukimi.compat.mooncake.tensor_parallel import ParallelTensorMethods
from tsukimi.errors import InvalidArgument
from tsukimi.store import tensors as t
from tsukimi.store.client import StoreClient

logger = logging.getLogger(__name__)

Config = ReplicaSettings | None


class TensorMethods(ParallelTensorMethods):
    """Mixed into `MooncakeDistributedStore`; uses its `_ready()` (the StoreClient or None)."""

    # -- whole tensors -----------------------------------------------------------------

    def put_tensor(self, key: str, tensor: torch.Tensor) -> int:
        return self.batch_pub_tensor([key], [tensor])[0]

    def upsert_tensor(self, key: str, tensor: torch.Tensor) -> int:
        return self.batch_upsert_pub_tensor([key], [tensor])[0]

    def pub_tensor(self, key: str, tensor: torch.Tensor, config: Config = None) -> int:
        return self.batch_pub_tensor([key], [tensor], config)[0]

    def upsert_pub_tensor(self, key: str, tensor: torch.Tensor, config: Config = None) -> int:
        return self.batch_upsert_pub_tensor([key], [tensor], config)[0]

    def batch_put_tensor(self, keys: list[str], tensors_list: list[torch.Tensor]) -> list[int]:
        return self.batch_pub_tensor(keys, tensors_list)

    def batch_upsert_tensor(self, keys: list[str], tensors_list: list[torch.Tensor]) -> list[int]:
        return self.batch_upsert_pub_tensor(keys, tensors_list)

    def batch_pub_tensor(self, keys: list[str], tensors_list: list[torch.Tensor], config: Config = None) -> list[int]:
        options = put_options(config, upsert=False)
        return self._put_codes("put_tensor", len(keys), lambda c: t.batch_put_tensors(c, keys, tensors_list, options))

    def batch_upsert_pub_tensor(
        self, keys: list[str], tensors_list: list[torch.Tensor], config: Config = None
    ) -> list[int]:
        options = put_options(config, upsert=True)
        return self._put_codes(
            "upsert_tensor", len(keys), lambda c: t.batch_put_tensors(c, keys, tensors_list, options)
        )

    def get_tensor(self, key: str) -> torch.Tensor | None:
        return self.batch_get_tensor([key])[0]

    def batch_get_tensor(self, keys: list[str]) -> list[torch.Tensor | None]:
        return self._get_tensors("get_tensor", len(keys), lambda c: t.batch_get_tensors(c, keys))

    # -- caller buffers ----------------------------------------------------------------

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> torch.Tensor | None:
        got = self.batch_get_tensor_into([key], [buffer_ptr], [size])[0]
        return None if isinstance(got, int) else got

    def batch_get_tensor_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[torch.Tensor | None] | list[int]:
        """Each tensor read into its buffer (a view of it), or None (miss, too small, ...);
        as Mooncake, a negative code per key when the lists differ in length."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            logger.error("get_tensor_into: %d keys, %d buffers, %d sizes", len(keys), len(buffer_ptrs), len(sizes))
            return [INVALID_PARAMS] * len(keys)
        return self._get_tensors(
            "get_tensor_into", len(keys), lambda c: t.batch_get_tensors(c, keys, address_buffers(buffer_ptrs, sizes))
        )

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self.batch_put_tensor_from([key], [buffer_ptr], [size])[0]

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self.batch_upsert_tensor_from([key], [buffer_ptr], [size])[0]

    def batch_put_tensor_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        return self._put_from(keys, buffer_ptrs, sizes, upsert=False)

    def batch_upsert_tensor_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        return self._put_from(keys, buffer_ptrs, sizes, upsert=True)

    def _put_from(self, keys: list[str], ptrs: list[int], sizes: list[int], upsert: bool) -> list[int]:
        """Store `[header][payload]` buffers as they are (zero-copy)."""
        options = put_options(None, upsert)
        return self._put_codes(
            "put_tensor_from",
            len(keys),
            lambda c: t.batch_put_serialized(c, keys, address_buffers(ptrs, sizes), options),
        )

    # -- tensor parallelism ------------------------------------------------------------

    def put_tensor_with_tp(
        self, key: str, tensor: torch.Tensor, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> int:
        return self.batch_pub_tensor_with_tp([key], [tensor], None, tp_rank, tp_size, split_dim)[0]

    def pub_tensor_with_tp(
        self,
        key: str,
        tensor: torch.Tensor,
        config: Config = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> int:
        return self.batch_pub_tensor_with_tp([key], [tensor], config, tp_rank, tp_size, split_dim)[0]

    def batch_put_tensor_with_tp(
        self,
        base_keys: list[str],
        tensors_list: list[torch.Tensor],
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:
        return self.batch_pub_tensor_with_tp(base_keys, tensors_list, None, tp_rank, tp_size, split_dim)

    def batch_pub_tensor_with_tp(
        self,
        base_keys: list[str],
        tensors_list: list[torch.Tensor],
        config: Config = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:
        """Every shard of every tensor; -600 for a tensor that does not split evenly."""
        options = put_options(config, upsert=False)

        def run(client: StoreClient) -> list[t.PutError]:
            _check_tp(tp_rank, tp_size)
            return t.batch_put_tensors_with_tp(client, base_keys, tensors_list, tp_size, split_dim, options)

        return self._put_codes("put_tensor_with_tp", len(base_keys), run)

    def put_tensor_with_tp_from(
        self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> int:
        return self.batch_put_tensor_with_tp_from([key], [buffer_ptr], [size], tp_rank, tp_size, split_dim)[0]

    def batch_put_tensor_with_tp_from(
        self,
        base_keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:
        """The whole tensors held in `[header][payload]` buffers, cut and stored as with_tp."""

        def run(client: StoreClient) -> list[t.PutError]:
            _check_tp(tp_rank, tp_size)
            tensors = [t.tensor_in(b) for b in address_buffers(buffer_ptrs, sizes)]
            return t.batch_put_tensors_with_tp(client, base_keys, tensors, tp_size, split_dim)

        return self._put_codes("put_tensor_with_tp_from", len(base_keys), run)

    def get_tensor_with_tp(
        self, key: str, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> torch.Tensor | None:
        return self.batch_get_tensor_with_tp([key], tp_rank, tp_size)[0]

    def batch_get_tensor_with_tp(
        self, base_keys: list[str], tp_rank: int = 0, tp_size: int = 1
    ) -> list[torch.Tensor | None]:
        return self._get_tensors(
            "get_tensor_with_tp", len(base_keys), lambda c: t.batch_get_tensors_with_tp(c, base_keys, tp_rank, tp_size)
        )

    def get_tensor_with_tp_into(
        self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> torch.Tensor | None:
        return self.batch_get_tensor_with_tp_into([key], [buffer_ptr], [size], tp_rank, tp_size)[0]

    def batch_get_tensor_with_tp_into(
        self, base_keys: list[str], buffer_ptrs: list[int], sizes: list[int], tp_rank: int = 0, tp_size: int = 1
    ) -> list[torch.Tensor | None]:
        def run(client: StoreClient) -> list[t.TensorResult]:
            buffers = address_buffers(buffer_ptrs, sizes)
            return t.batch_get_tensors_with_tp(client, base_keys, tp_rank, tp_size, buffers)

        return self._get_tensors("get_tensor_with_tp_into", len(base_keys), run)


def _check_tp(tp_rank: int, tp_size: int) -> None:
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise InvalidArgument(f"tp_rank {tp_rank} / tp_size {tp_size}: needs tp_size >= 1, 0 <= tp_rank < tp_size")
