"""The with_parallelism part of `MooncakeDistributedStore` (put / upsert / get a tensor
under a `TensorParallelism` or a writer partition, read back by a `ReadTarget`; from and
into caller buffers) over tsukimi/store/tensor_parallel.py, which says how each layout is
stored and read.

Arguments may be Mooncake's types (tensor_types.py), tsukimi's, or any object with the same
attributes. Giving both a parallelism and a writer partition for a key is -600 for it; a
batch's `parallelisms` / `writer_partitions` / `targets` are None or one per key (anything
else, a single `ReadTarget` too, fails every key, as in Mooncake). A "full" read under a
parallelism puts the tensor back from its TP shards (tsukimi/store/tensor_parallel.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from tsukimi.compat.mooncake.connection import StoreConnection
from tsukimi.compat.mooncake.tensor_calls import ReplicaSettings, address_buffers, get_tensors, put_codes, put_options
from tsukimi.compat.mooncake.tensor_types import parallelism_of, partition_of, target_of
from tsukimi.errors import InvalidArgument
from tsukimi.store import tensor_parallel as tp
from tsukimi.store.client import StoreClient
from tsukimi.store.tensors import PutError, TensorResult, tensor_in

logger = logging.getLogger(__name__)


def _per_key(values: object, count: int, what: str) -> list[object]:
    """None -> [None] * count; else a list of exactly `count` values. Raises InvalidArgument."""
    if values is None:
        return [None] * count
    if not isinstance(values, list | tuple) or len(values) != count:
        raise InvalidArgument(f"{what} must be None or one per key ({count})")
    return list(values)


def _targets(targets: object, count: int) -> list[tp.ReadTarget]:
    """One read target per key (None: as stored). Raises InvalidArgument."""
    return [target_of(x) for x in _per_key(targets, count, "targets")]


class ParallelTensors:
    """Tensors under parallel layouts, per key (each call answers one code or tensor per
    key). `config` may raise InvalidArgument for what tsukimi cannot store (replicate.py)."""

    def __init__(self, connection: StoreConnection) -> None:
        self._connection = connection

    def put(
        self,
        keys: list[str],
        load: Callable[[], Sequence[torch.Tensor]],
        parallelisms: object,
        partitions: object,
        config: ReplicaSettings | None,
        upsert: bool,
    ) -> list[int]:
        """The tensors `load` gives (called once the client is there), each under its layout
        or writer partition: 0 or a negative code per key."""

        def run(client: StoreClient) -> list[PutError]:
            options = put_options(config, upsert, len(keys))
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

        return put_codes(self._connection, "put_tensor_with_parallelism", len(keys), run)

    def put_from(
        self,
        keys: list[str],
        ptrs: list[int],
        sizes: list[int],
        parallelisms: object,
        partitions: object,
        config: ReplicaSettings | None,
        upsert: bool,
    ) -> list[int]:
        """The whole tensors held in `[header][payload]` buffers, put as `put`."""
        return self.put(
            keys, lambda: [tensor_in(b) for b in address_buffers(ptrs, sizes)], parallelisms, partitions, config, upsert
        )

    def get(self, keys: list[str], targets: object) -> list[torch.Tensor | None]:
        """Each key read as its target asks (None: as stored), or None."""
        return get_tensors(
            self._connection,
            "get_tensor_with_parallelism",
            len(keys),
            lambda c: tp.get_with_parallelism(c, keys, _targets(targets, len(keys))),
        )

    def get_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], targets: object
    ) -> list[torch.Tensor | None]:
        """Each key read as its target asks, into its buffer (a view of it), or None."""

        def run(client: StoreClient) -> list[TensorResult]:
            buffers = address_buffers(buffer_ptrs, sizes)
            return tp.get_with_parallelism(client, keys, _targets(targets, len(keys)), buffers)

        return get_tensors(self._connection, "get_tensor_with_parallelism_into", len(keys), run)
