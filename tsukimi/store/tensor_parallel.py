"""Tensors stored under a parallel layout, and read back as stored, whole, or as one shard.

This module owns the layout types (`ParallelAxis`, `TensorParallelism`, `WriterPartition`,
`ReadTarget`), the keys each layout stores under (Mooncake's names), the manifests that say
how many shards make a whole tensor, and the reads that put shards back together. The
objects themselves are tensor objects (tensor_format.py) of tensors.py.

How a put is stored (`ParallelPut`):

    parallelism = exactly one "tp" axis   the tensor IS the writer's shard: stored as is under
                                          "{key}_tp_{rank}" (as with_tp)
    parallelism = any other axes          the tensor is the whole tensor of the writer's group:
                                          cut by each axis with a split_dim (chunk `rank` of
                                          `size`, evenly) and stored under the axes in
                                          Mooncake's order dp, tp, ep, pp:
                                          "{key}__dp_1of2__tp_0of2_sd1"
    writer_partition (rank, size, dim)    the tensor is the whole tensor: this writer stores its
                                          chunk under "{key}__writer_{rank}of{size}_sd{dim}", and
                                          a manifest "{key}__writer_manifest" says how many
                                          chunks make it
    neither                               the plain key, as put_tensor

A put under a "tp" axis with a split_dim also writes "{key}__parallelism_manifest" (the TP
size, split_dim and whole shape) and marks each shard object with its TP rank, size and dim.

NOTE: the first two rows differ on purpose: that is Mooncake's contract for one TP axis
(each rank passes its own shard) and for multi-axis layouts (each rank passes the whole).

A read (`ReadTarget`), as Mooncake's store_py.cpp does it:

    as_stored                 the plain key
    full, no parallelism      the plain key, else every writer partition concatenated
    full, a parallelism       the TP shards r = 0..n-1 of the layout concatenated: the key of
                              the layout with the TP rank varied (other axes, e.g. the DP
                              rank, kept); n is the manifest's TP size when there is one (so
                              a reader may ask with another TP size: a re-shard), else the
                              stored size (one TP axis) or the asked one. Each shard's rank,
                              size and split_dim must match and the shards be equal: anything
                              else is a KVFormatError. No TP axis with a split_dim: a miss.
    shard                     the object stored for that very layout; else (a TP axis with a
                              split_dim) its TP chunk cut from the whole tensor put back as
                              "full, a parallelism" does (so a shard of another TP size is
                              re-cut, as Mooncake does); else the writer partition of its one
                              split axis; else the shard cut from the full tensor (the plain
                              key or writer partitions: tsukimi's, the wheel answers None)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from tsukimi.errors import InvalidArgument, KVFormatError, ObjectExists, TsukimiError
from tsukimi.store.client import StoreClient
from tsukimi.store.replica_io import GetResult
from tsukimi.store.shard_rebuild import Manifest, assemble, stored_count
from tsukimi.store.tensor_format import WHOLE, ShardPlacement, deserialize, serialize_into
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
_KIND_ORDER = {"dp": 0, "tp": 1, "ep": 2, "pp": 3}  # NOTE: Mooncake's canonical axis order in keys


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
        """The axis as it appears in a key, e.g. "tp_0of2_sd1" or "pp_0of2_sid3" (Mooncake's)."""
        extra = [("sd", self.split_dim), ("eid", self.expert_id), ("sid", self.stage_id)]
        return f"{self.kind}_{self.rank}of{self.size}" + "".join(f"_{k}{v}" for k, v in extra if v is not None)


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

    @property
    def tp(self) -> ParallelAxis | None:
        """The layout's first "tp" axis, if it has one."""
        return next((a for a in self.axes if a.kind == "tp"), None)

    def key(self, key: str) -> str:
        """The key a writer with this layout stores `key` under."""
        tp = self.single_tp
        if tp is not None:
            return tp_key(key, tp.rank)
        ordered = sorted(self.axes, key=lambda a: _KIND_ORDER[a.kind])
        return "".join([key, *(f"__{a.tag}" for a in ordered)])

    def with_tp(self, rank: int, size: int) -> TensorParallelism:
        """This layout with its TP axis at `rank` of `size` (the other axes kept).
        Raises InvalidArgument (no TP axis, or a bad rank)."""
        tp = self.tp
        if tp is None:
            raise InvalidArgument("the layout has no tp axis")
        axis = ParallelAxis("tp", rank, size, tp.split_dim, tp.expert_id, tp.stage_id)
        return TensorParallelism(tuple(axis if a is tp else a for a in self.axes))

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
        return f"{key}__writer_{self.rank}of{self.size}_sd{self.split_dim}"

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
    """The writer-partition manifest of `key`."""
    return f"{key}__writer_manifest"


def parallelism_manifest_key(key: str) -> str:
    """The TP manifest of `key`, shared by every layout it is stored under."""
    return f"{key}__parallelism_manifest"


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
    keys = [i for i, _ in owners]
    for (i, counts), error in zip(owners, put_prepared(client, prepared, options, keys), strict=True):
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
            dim = part.split_dim % item.tensor.dim()
            return [
                (prepare(part.key(item.key), chunk, ShardPlacement(part.rank, part.size, dim)), True),
                ((layout_record_key(item.key), Manifest.of(chunk, part.size, dim).pack()), False),
            ]
        if parallelism is None:
            return [(prepare(item.key, item.tensor), True)]
        shard = item.tensor if parallelism.single_tp is not None else parallelism.cut(item.tensor)
        tp, single = parallelism.tp, parallelism.single_tp
        if tp is None or tp.split_dim is None or shard.dim() == 0:
            placement = ShardPlacement(single.rank, single.size, 0) if single else WHOLE
            return [(prepare(parallelism.key(item.key), shard, placement), True)]
        dim = tp.split_dim % shard.dim()
        return [
            (prepare(parallelism.key(item.key), shard, ShardPlacement(tp.rank, tp.size, dim)), True),
            ((parallelism_manifest_key(item.key), Manifest.of(shard, tp.size, dim).pack()), False),
        ]
    except InvalidArgument as exc:
        return [(exc, True)]


def get_with_parallelism(
    client: StoreClient, keys: Sequence[str], targets: Sequence[ReadTarget], into: Sequence[object] | None = None
) -> list[TensorResult]:
    """Each key read as its target asks (module docstring), into `into[i]` when given.
    A key nothing can be read for is a miss. Raises InvalidArgument (lengths differ)."""
    if len(keys) != len(targets):
        raise InvalidArgument(f"{len(keys)} keys but {len(targets)} read targets")
    if into is not None and len(into) != len(keys):
        raise InvalidArgument(f"{len(keys)} keys but {len(into)} buffers")
    results = [TensorResult()] * len(keys)
    # NOTE: a full read under a layout never reads the plain key (Mooncake's rule)
    direct = [i for i, t in enumerate(targets) if not (t.mode == "full" and t.parallelism is not None)]
    buffers = None if into is None else [into[i] for i in direct]
    found = client.batch_get([targets[i].first_key(keys[i]) for i in direct], buffers) if direct else []
    for i, r in zip(direct, found, strict=True):
        results[i] = decode_result(r.data, r.error, targets[i].tp_size)
    todo = [i for i, r in enumerate(results) if _retry(r, targets[i])]
    if todo:
        rebuilt = _rebuild(client, [keys[i] for i in todo], [targets[i] for i in todo])
        for i, result in zip(todo, rebuilt, strict=True):
            if result.found or result.error is not None or results[i].error is None:
                results[i] = result if into is None else _placed(result, into[i])
    return results


def _retry(result: TensorResult, target: ReadTarget) -> bool:
    """Whether a key's first read leaves more to try: a miss of a full or shard read, or a
    shard stored for another TP size (re-cut from the shards put back whole, as Mooncake)."""
    if target.mode == "as_stored" or result.found:
        return False
    return result.error is None or (isinstance(result.error, KVFormatError) and _tp_split(target) is not None)


def _rebuild(client: StoreClient, keys: list[str], targets: list[ReadTarget]) -> list[TensorResult]:
    """Full tensors from the TP shards of their layout, or from writer partitions; shards cut
    from the TP shards put back whole, else writer partitions, else cut from the full tensor."""
    results = [TensorResult()] * len(keys)
    by_layout = [
        (i, layout)
        for i, t in enumerate(targets)
        if (layout := t.parallelism) is not None and (t.mode == "full" or _tp_split(t) is not None)
    ]
    rebuilt = _read_tp_full(client, [keys[i] for i, _ in by_layout], [layout for _, layout in by_layout])
    for (i, _), whole in zip(by_layout, rebuilt, strict=True):
        tp = _tp_split(targets[i])
        if tp is None:
            results[i] = whole
        elif whole.tensor is not None:  # NOTE: a shard's other fallbacks run when this one fails
            assert tp.split_dim is not None
            results[i] = TensorResult(split_uniform(whole.tensor, tp.size, tp.split_dim)[tp.rank])
    done = {i for i, _ in by_layout if targets[i].mode == "full" or results[i].found}
    probes = [(i, part) for i, t in enumerate(targets) if i not in done and (part := _as_partition(t)) is not None]
    if probes:
        found = batch_get_tensors(client, [part.key(keys[i]) for i, part in probes])
        for (i, _), result in zip(probes, found, strict=True):
            results[i] = result
    rest = [i for i, r in enumerate(results) if not r.found and r.error is None and i not in done]
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


def _tp_split(target: ReadTarget) -> ParallelAxis | None:
    """The TP axis of a shard target, when it has a split_dim (the shard can then be cut
    from the TP shards put back whole)."""
    tp = target.parallelism.tp if target.mode == "shard" and target.parallelism is not None else None
    return tp if tp is not None and tp.split_dim is not None else None


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
    plans: list[tuple[int, Manifest, list[str]]] = []
    for i, key in enumerate(keys):
        plain, record = firsts[i], firsts[len(keys) + i]
        results.append(decode_result(plain.data, plain.error))
        if not results[i].found and results[i].error is None and record.data is not None:
            manifest = Manifest.parse(bytes(record.data))
            if manifest is not None:
                plans.append((i, manifest, WriterPartition(0, manifest.count, manifest.split_dim).all_keys(key)))
    found = client.batch_get([k for _, _, ks in plans for k in ks])
    offset = 0
    for i, manifest, part_keys in plans:
        mine, offset = found[offset : offset + len(part_keys)], offset + len(part_keys)
        results[i] = assemble(keys[i], mine, manifest.split_dim, manifest)
    return results


def _read_tp_full(client: StoreClient, keys: Sequence[str], layouts: Sequence[TensorParallelism]) -> list[TensorResult]:
    """Each key's whole tensor put back from the TP shards of its layout (module docstring:
    "full, a parallelism"), in at most three batches: the manifests, the shards, and the
    shards again for a one-TP-axis key stored for another TP size without a manifest."""
    asked = [(i, tp) for i, layout in enumerate(layouts) if (tp := layout.tp) is not None and tp.split_dim is not None]
    results = [TensorResult()] * len(keys)
    if len(asked) < len(keys):
        logger.warning("a full read under a layout needs a tp axis with a split_dim; read as a miss")
    records = client.batch_get([parallelism_manifest_key(keys[i]) for i, _ in asked])
    manifests = [Manifest.parse(bytes(r.data)) if r.data is not None else None for r in records]
    plans = [(i, tp.size if m is None else m.count, m) for (i, tp), m in zip(asked, manifests, strict=True)]
    shards = _read_shards(client, keys, layouts, [(i, count) for i, count, _ in plans])
    again = [
        (i, count)
        for (i, asked_size, m), found in zip(plans, shards, strict=True)
        if m is None and layouts[i].single_tp is not None
        if (count := stored_count(found[0])) not in (0, asked_size)
    ]
    restored = dict(zip([i for i, _ in again], _read_shards(client, keys, layouts, again), strict=True))
    for (i, tp), (_, _, manifest), found in zip(asked, plans, shards, strict=True):
        dim = tp.split_dim
        assert dim is not None
        found = restored.get(i, found)
        ndim = len(manifest.shape) if manifest else _ndim(found[0])
        if manifest is not None and dim % max(ndim, 1) != manifest.split_dim:
            results[i] = TensorResult(
                error=KVFormatError(f"{keys[i]!r} is split along {manifest.split_dim}, not {dim}")
            )
            continue
        results[i] = assemble(keys[i], found, dim % max(ndim, 1), manifest, tp.size)
    return results


def _read_shards(
    client: StoreClient, keys: Sequence[str], layouts: Sequence[TensorParallelism], plans: Sequence[tuple[int, int]]
) -> list[list[GetResult]]:
    """For each (index, count): shards 0..count-1 of keys[index] under its layout, one batch."""
    wanted = [layouts[i].with_tp(r, count).key(keys[i]) for i, count in plans for r in range(count)]
    found = client.batch_get(wanted) if wanted else []
    out, offset = [], 0
    for _, count in plans:
        out.append(found[offset : offset + count])
        offset += count
    return out


def _ndim(shard: GetResult) -> int:
    """The rank of the tensor in a shard object (0 when it holds none)."""
    if shard.data is None:
        return 0
    try:
        return len(deserialize(shard.data)[0].shape)
    except KVFormatError:
        return 0


def _placed(result: TensorResult, buffer: object) -> TensorResult:
    """A rebuilt tensor written as an object into the caller's buffer (a copy)."""
    if result.tensor is None:
        return result
    try:
        return TensorResult(serialize_into(result.tensor, byte_view(buffer, with_address=False)[0], WHOLE))
    except TsukimiError as exc:
        return TensorResult(error=exc)
