"""The with_parallelism family of `MooncakeDistributedStore` (put / upsert / get a tensor
under a `TensorParallelism` or a writer partition, read back by a `ReadTarget`; from and
into caller buffers), as a mixin over tsukimi/store/tensor_parallel.py, which says how each
layout is stored and read.

Arguments may be Mooncake's types (tensor_types.py), tsukimi's, or any object with the same
attributes. Giving both a parallelism and a writer partition for a key is -600 for it; a
batch's `parallelisms` / `writer_partitions` / `targets` are None or one per key (a single
`ReadTarget` applies to every key).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from tsukimi.compat.mooncake.tensor_calls import ReplicaSettings, TensorCalls, address_buffers, put_options
from tsukimi.compat.mooncake.tensor_types import parallelism_of, partition_of, target_of
from tsukimi.errors import InvalidArgument
from tsukimi.store import tensor_parallel as tp
from tsukimi.store.client import StoreClient
from tsukimi.store.tensors import PutError, TensorResult, tensor_in

logger = logging.getLogger(__name__)

Config = ReplicaSettings | None


def _per_key(values: object, count: int, what: str) -> list[object]:
    """None -> [None] * count; else a list of exactly `count` values. Raises InvalidArgument."""
    if values is None:
        return [None] * count
    if not isinstance(values, list | tuple) or len(values) != count:
        raise InvalidArgument(f"{what} must be None or one per key ({count})")
    return list(values)


def _targets(targets: object, count: int) -> list[tp.ReadTarget]:
    if targets is not None and not isinstance(targets, list | tuple):
        return [target_of(targets)] * count
    return [target_of(x) for x in _per_key(targets, count, "targets")]


class ParallelTensorMethods(TensorCalls):
    """The with_parallelism methods; mixed into `MooncakeDistributedStore` with TensorMethods."""

    def put_tensor_with_parallelism(
        self,
        key: str,
        tensor: torch.Tensor,
        parallelism: object = None,
        config: Config = None,
        writer_partition: object = None,
    ) -> int:
        return self._put_parallel([key], lambda: [tensor], [parallelism], [writer_partition], config, upsert=False)[0]

    def upsert_tensor_with_parallelism(
        self,
        key: str,
        tensor: torch.Tensor,
        parallelism: object = None,
        config: Config = None,
        writer_partition: object = None,
    ) -> int:
        return self._put_parallel([key], lambda: [tensor], [parallelism], [writer_partition], config, upsert=True)[0]

    def batch_put_tensor_with_parallelism(
        self,
        keys: list[str],
        tensors_list: list[torch.Tensor],
        parallelisms: object = None,
        config: Config = None,
        writer_partitions: object = None,
    ) -> list[int]:
        return self._put_parallel(keys, lambda: tensors_list, parallelisms, writer_partitions, config, upsert=False)

    def batch_upsert_tensor_with_parallelism(
        self,
        keys: list[str],
        tensors_list: list[torch.Tensor],
        parallelisms: object = None,
        config: Config = None,
        writer_partitions: object = None,
    ) -> list[int]:
        return self._put_parallel(keys, lambda: tensors_list, parallelisms, writer_partitions, config, upsert=True)

    def put_tensor_with_parallelism_from(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        parallelism: object = None,
        config: Config = None,
        writer_partition: object = None,
    ) -> int:
        return self._put_parallel_from([key], [buffer_ptr], [size], [parallelism], [writer_partition], config, False)[0]

    def upsert_tensor_with_parallelism_from(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        parallelism: object = None,
        config: Config = None,
        writer_partition: object = None,
    ) -> int:
        return self._put_parallel_from([key], [buffer_ptr], [size], [parallelism], [writer_partition], config, True)[0]

    def batch_put_tensor_with_parallelism_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        parallelisms: object = None,
        config: Config = None,
        writer_partitions: object = None,
    ) -> list[int]:
        return self._put_parallel_from(keys, buffer_ptrs, sizes, parallelisms, writer_partitions, config, False)

    def batch_upsert_tensor_with_parallelism_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        parallelisms: object = None,
        config: Config = None,
        writer_partitions: object = None,
    ) -> list[int]:
        return self._put_parallel_from(keys, buffer_ptrs, sizes, parallelisms, writer_partitions, config, True)

    def _put_parallel_from(
        self,
        keys: list[str],
        ptrs: list[int],
        sizes: list[int],
        parallelisms: object,
        partitions: object,
        config: Config,
        upsert: bool,
    ) -> list[int]:
        """The whole tensors held in `[header][payload]` buffers, put as `_put_parallel`."""
        return self._put_parallel(
            keys, lambda: [tensor_in(b) for b in address_buffers(ptrs, sizes)], parallelisms, partitions, config, upsert
        )

    def _put_parallel(
        self,
        keys: list[str],
        load: Callable[[], Sequence[torch.Tensor]],
        parallelisms: object,
        partitions: object,
        config: Config,
        upsert: bool,
    ) -> list[int]:
        options = put_options(config, upsert)

        def run(client: StoreClient) -> list[PutError]:
            tensors = load()
            if len(tensors) != len(keys):
                raise InvalidArgument(f"{len(keys)} keys but {len(tensors)} tensors")
            layouts = _per_key(parallelisms, len(keys), "parallelisms")
            parts = _per_key(partitions, len(keys), "writer_partitions")
            items = [
                tp.ParallelPut(key, tensor, parallelism_of(layout), partition_of(part))
                for key, tensor, layout, part in zip(keys, tensors, layouts, parts, strict=True)
            ]
            return tp.put_with_parallelism(client, items, options)

        return self._put_codes("put_tensor_with_parallelism", len(keys), run)

    # -- reads -------------------------------------------------------------------------

    def get_tensor_with_parallelism(self, key: str, target: object = None) -> torch.Tensor | None:
        return self.batch_get_tensor_with_parallelism([key], None if target is None else [target])[0]

    def batch_get_tensor_with_parallelism(self, keys: list[str], targets: object = None) -> list[torch.Tensor | None]:
        return self._get_tensors(
            "get_tensor_with_parallelism",
            len(keys),
            lambda c: tp.get_with_parallelism(c, keys, _targets(targets, len(keys))),
        )

    def get_tensor_with_parallelism_into(
        self, key: str, buffer_ptr: int, size: int, target: object = None
    ) -> torch.Tensor | None:
        targets = None if target is None else [target]
        return self.batch_get_tensor_with_parallelism_into([key], [buffer_ptr], [size], targets)[0]

    def batch_get_tensor_with_parallelism_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], targets: object = None
    ) -> list[torch.Tensor | None]:
        """Each key read as its target asks, into its buffer (a view of it)."""

        def run(client: StoreClient) -> list[TensorResult]:
            buffers = address_buffers(buffer_ptrs, sizes)
            return tp.get_with_parallelism(client, keys, _targets(targets, len(keys)), buffers)

        return self._get_tensors("get_tensor_with_parallelism_into", len(keys), run)
