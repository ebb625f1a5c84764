"""Tensors stored under a parallel layout, and read back as stored, whole, or as one shard.

This module owns the layout types (`ParallelAxis`, `TensorParallelism`, `WriterPartition`,
`ReadTarget`), the keys each layout stores under, and the reads that put shards back
together. The objects themselves are tensor objects (tensor_format.py) of tensors.py.

How a put is stored (`ParallelPut`):

    parallelism = exactly one "tp" axis   the tensor IS the writer's shard: stored as is under
                                          tp_key(key, rank) = "{key}_tp_{rank}" (as with_tp)
    parallelism = any other axes          the tensor is the whole tensor of the writer's group:
                                          cut by each axis with a split_dim (chunk `rank` of
                                          `size`, evenly) and stored under "{key}#dp1of2#tp0of2s1"
    writer_partition (rank, size, dim)    the tensor is the whole tensor: this writer stores its
                                          chunk under "{key}#w{rank}of{size}s{dim}", and a layout
                                          record "{key}#layout" says how many chunks make it
    neither                               the plain key, as put_tensor

NOTE: the first two rows differ on purpose: that is Mooncake's contract for one TP axis
(each rank passes its own shard) and for multi-axis layouts (each rank passes the whole).

A read (`ReadTarget`): "as_stored" reads the plain key; "full" the plain key, else every
writer partition concatenated; "shard" the object stored for that very layout, else the
writer partition of its one split axis, else the shard cut from the full tensor.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from tsukimi.errors import InvalidArgument, KVFormatError, ObjectExists, TsukimiError
from tsukimi.store.client import StoreClient
from tsukimi.store.tensor_format import WHOLE, ShardPlacement, serialize_into
from tsukimi.store.tensors import (
    PutError,
    PutOptions,
    TensorResult,
    batch_get_tensors,
    decode_result,
    prepare,
    put_prepared,
    split_uniform,
    tp_key,
)
from tsukimi.transfer.segment import byte_view

logger = logging.getLogger(__name__)

AxisKind = Literal["dp", "pp", "ep", "tp"]
ReadMode = Literal["as_stored", "full", "shard"]
_RECORD = struct.Struct("<4sIIi")  # magic, version, number of partitions, split_dim
_RECORD_MAGIC = b"TSKL"


def _check_rank(rank: int, size: int) -> None:
    if size < 1 or not 0 <= rank < size:
        raise InvalidArgument(f"rank {rank} of size {size}: needs size >= 1 and 0 <= rank < size")


@dataclass(frozen=True, slots=True)
class ParallelAxis:
    """One axis of a layout: this writer is `rank` of `size` along `kind`; with a
    `split_dim`, the axis cuts the tensor along that dim. Raises InvalidArgument."""

    kind: AxisKind
    rank: int = 0
    size: int = 1
    split_dim: int | None = None
    expert_id: int | None = None
    stage_id: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in get_args(AxisKind):
            raise InvalidArgument(f"axis kind must be one of {get_args(AxisKind)}, got {self.kind!r}")
        _check_rank(self.rank, self.size)

    @property
    def tag(self) -> str:
        """The axis as it appears in a key, e.g. "tp0of2s1" or "pp0of2st3"."""
        extra = [("s", self.split_dim), ("e", self.expert_id), ("st", self.stage_id)]
        return f"{self.kind}{self.rank}of{self.size}" + "".join(f"{k}{v}" for k, v in extra if v is not None)


@dataclass(frozen=True, slots=True)
class TensorParallelism:
    """A writer's place in a parallel layout: its axes, outermost first."""

    axes: tuple[ParallelAxis, ...]

    @property
    def single_tp(self) -> ParallelAxis | None:
        """The axis when the layout is exactly one "tp" axis (the tensor is then a shard)."""
        return self.axes[0] if len(self.axes) == 1 and self.axes[0].kind == "tp" else None

    @property
    def split_axes(self) -> tuple[ParallelAxis, ...]:
        return tuple(a for a in self.axes if a.split_dim is not None)

    def key(self, key: str) -> str:
        """The key a writer with this layout stores `key` under."""
        tp = self.single_tp
        return tp_key(key, tp.rank) if tp is not None else "#".join([key, *(a.tag for a in self.axes)])

    def cut(self, tensor: torch.Tensor) -> torch.Tensor:
        """This writer's piece of the whole `tensor` (a view). Raises InvalidArgument."""
        for axis in self.split_axes:
            assert axis.split_dim is not None
            tensor = split_uniform(tensor, axis.size, axis.split_dim)[axis.rank]
        return tensor


@dataclass(frozen=True, slots=True)
class WriterPartition:
    """This writer stores chunk `rank` of `size` of the whole tensor along `split_dim`."""

    rank: int
    size: int
    split_dim: int

    def __post_init__(self) -> None:
        _check_rank(self.rank, self.size)

    def key(self, key: str) -> str:
        return f"{key}#w{self.rank}of{self.size}s{self.split_dim}"

    def all_keys(self, key: str) -> list[str]:
        """The keys of every partition of `key` (all ranks)."""
        return [WriterPartition(r, self.size, self.split_dim).key(key) for r in range(self.size)]


@dataclass(frozen=True, slots=True)
class ReadTarget:
    """What a read returns: the object "as_stored", the "full" tensor, or one "shard" of
    `parallelism` (which "shard" needs). Raises InvalidArgument."""

    mode: ReadMode = "as_stored"
    parallelism: TensorParallelism | None = None

    def __post_init__(self) -> None:
        if self.mode not in get_args(ReadMode):
            raise InvalidArgument(f"read mode must be one of {get_args(ReadMode)}, got {self.mode!r}")
        if self.mode == "shard" and self.parallelism is None:
            raise InvalidArgument("a shard read needs the parallelism of the shard")

    def first_key(self, key: str) -> str:
        """The key read first: the layout's own key for a shard, else the plain key."""
        return self.parallelism.key(key) if self.mode == "shard" and self.parallelism else key

    @property
    def tp_size(self) -> int:
        """The TP size a one-tp-axis shard read expects the object it reads to be cut for
        (0: nothing to check). NOTE: a shard of another size is refused, never returned."""
        tp = self.parallelism.single_tp if self.mode == "shard" and self.parallelism else None
        return tp.size if tp else 0


AS_STORED = ReadTarget()


@dataclass(frozen=True, slots=True)
class ParallelPut:
    """One tensor to put under a layout: `parallelism` or `writer_partition`, not both."""

    key: str
    tensor: torch.Tensor
    parallelism: TensorParallelism | None = None
    writer_partition: WriterPartition | None = None


def layout_record_key(key: str) -> str:
    return f"{key}#layout"


def put_with_parallelism(client: StoreClient, items: Sequence[ParallelPut], options: PutOptions) -> list[PutError]:
    """Store each item under its layout, all in one batch; each item's first error or None
    (InvalidArgument: both layouts given, or a tensor that does not cut evenly)."""
    prepared: list[tuple[str, object] | TsukimiError] = []
    owners: list[tuple[int, bool]] = []  # (item, whether ObjectExists counts)
    for i, item in enumerate(items):
        for entry, counts in _plan(item):
            prepared.append(entry)
            owners.append((i, counts))
    errors: list[PutError] = [None] * len(items)
    for (i, counts), error in zip(owners, put_prepared(client, prepared, options), strict=True):
        if counts or not isinstance(error, ObjectExists):
            errors[i] = errors[i] or error
    return errors


def _plan(item: ParallelPut) -> list[tuple[tuple[str, object] | TsukimiError, bool]]:
    """The objects of one put, each with whether its ObjectExists is the put's error."""
    part, parallelism = item.writer_partition, item.parallelism
    if part is not None and parallelism is not None:
        return [(InvalidArgument("give a parallelism or a writer_partition, not both"), True)]
    if not isinstance(item.tensor, torch.Tensor):
        return [(InvalidArgument(f"expected a torch.Tensor, got {type(item.tensor).__name__}"), True)]
    try:
        if part is not None:
            chunk = split_uniform(item.tensor, part.size, part.split_dim)[part.rank]
            record = _RECORD.pack(_RECORD_MAGIC, 1, part.size, part.split_dim)
            placement = ShardPlacement(part.rank, part.size, part.split_dim % item.tensor.dim())
            return [
                (prepare(part.key(item.key), chunk, placement), True),
                ((layout_record_key(item.key), record), False),
            ]
        if parallelism is None:
            return [(prepare(item.key, item.tensor), True)]
        tp = parallelism.single_tp
        if tp is not None:
            placement = ShardPlacement(tp.rank, tp.size, tp.split_dim or 0)
            return [(prepare(parallelism.key(item.key), item.tensor, placement), True)]
        return [(prepare(parallelism.key(item.key), parallelism.cut(item.tensor)), True)]
    except InvalidArgument as exc:
        return [(exc, True)]


def get_with_parallelism(
    client: StoreClient, keys: Sequence[str], targets: Sequence[ReadTarget], into: Sequence[object] | None = None
) -> list[TensorResult]:
    """Each key read as its target asks (module docstring), into `into[i]` when given.
    A key nothing can be read for is a miss. Raises InvalidArgument (lengths differ)."""
    if len(keys) != len(targets):
        raise InvalidArgument(f"{len(keys)} keys but {len(targets)} read targets")
    found = client.batch_get([t.first_key(k) for k, t in zip(keys, targets, strict=True)], into)
    results = [decode_result(r.data, r.error, t.tp_size) for r, t in zip(found, targets, strict=True)]
    todo = [i for i, r in enumerate(results) if not r.found and r.error is None and targets[i].mode != "as_stored"]
    if todo:
        rebuilt = _rebuild(client, [keys[i] for i in todo], [targets[i] for i in todo])
        for i, result in zip(todo, rebuilt, strict=True):
            results[i] = result if into is None else _placed(result, into[i])
    return results


def _rebuild(client: StoreClient, keys: list[str], targets: list[ReadTarget]) -> list[TensorResult]:
    """Shards from writer partitions or cut from the full tensor; full tensors from partitions."""
    results = [TensorResult()] * len(keys)
    probes = [(i, part) for i, t in enumerate(targets) if (part := _as_partition(t)) is not None]
    if probes:
        found = batch_get_tensors(client, [part.key(keys[i]) for i, part in probes])
        for (i, _), result in zip(probes, found, strict=True):
            results[i] = result
    rest = [i for i, r in enumerate(results) if not r.found and r.error is None]
    for i, full in zip(rest, _read_full(client, [keys[i] for i in rest]), strict=True):
        parallelism = targets[i].parallelism
        if full.tensor is None or targets[i].mode == "full" or parallelism is None:
            results[i] = full
            continue
        try:
            results[i] = TensorResult(parallelism.cut(full.tensor))
        except InvalidArgument as exc:
            results[i] = TensorResult(error=KVFormatError(f"{keys[i]!r} does not cut into that shard: {exc}"))
    return results


def _as_partition(target: ReadTarget) -> WriterPartition | None:
    """The writer partition a shard target with one split axis is (None for others)."""
    if target.mode != "shard" or target.parallelism is None or len(target.parallelism.split_axes) != 1:
        return None
    axis = target.parallelism.split_axes[0]
    assert axis.split_dim is not None
    return WriterPartition(axis.rank, axis.size, axis.split_dim)


def _read_full(client: StoreClient, keys: list[str]) -> list[TensorResult]:
    """The plain object of each key, else its writer partitions concatenated."""
    if not keys:
        return []
    firsts = client.batch_get([*keys, *map(layout_record_key, keys)])
    results: list[TensorResult] = []
    plans: list[tuple[int, WriterPartition, list[str]]] = []
    for i, key in enumerate(keys):
        plain, record = firsts[i], firsts[len(keys) + i]
        results.append(decode_result(plain.data, plain.error))
        if not results[i].found and results[i].error is None and record.data is not None:
            part = _parse_record(bytes(record.data))
            if part is not None:
                plans.append((i, part, part.all_keys(key)))
    chunks = batch_get_tensors(client, [k for _, _, ks in plans for k in ks])
    offset = 0
    for i, part, part_keys in plans:
        mine, offset = chunks[offset : offset + len(part_keys)], offset + len(part_keys)
        if all(c.tensor is not None for c in mine):
            results[i] = TensorResult(torch.cat([c.tensor for c in mine if c.tensor is not None], part.split_dim))
        else:
            results[i] = next((TensorResult(error=c.error) for c in mine if c.error is not None), TensorResult())
    return results


def _parse_record(raw: bytes) -> WriterPartition | None:
    if len(raw) != _RECORD.size:
        return None
    magic, version, size, split_dim = _RECORD.unpack(raw)
    if magic != _RECORD_MAGIC or version != 1 or size < 1:
        logger.warning("ignoring a malformed layout record")
        return None
    return WriterPartition(0, size, split_dim)


def _placed(result: TensorResult, buffer: object) -> TensorResult:
    """A rebuilt tensor written as an object into the caller's buffer (a copy)."""
    if result.tensor is None:
        return result
    try:
        return TensorResult(serialize_into(result.tensor, byte_view(buffer, with_address=False)[0], WHOLE))
    except TsukimiError as exc:
        return TensorResult(error=exc)
