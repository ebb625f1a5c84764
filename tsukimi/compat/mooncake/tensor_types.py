"""`mooncake.store`'s parallel layout types (`ParallelAxis`, `TensorParallelism`,
`ReadTarget`) and their conversion to tsukimi's frozen ones (tsukimi/store/tensor_parallel.py).

Mooncake's types are built empty and filled attribute by attribute, so these are plain
mutable classes; a method of the facade converts what it is given (these, tsukimi's own
types, or any object with the same attributes, as Mooncake's callers pass for a writer
partition) when it is called. A bad value is an InvalidArgument then, or for
`ReadTarget.mode` as soon as it is set, as in Mooncake.
"""

from __future__ import annotations

import logging
from typing import cast

from tsukimi.errors import InvalidArgument
from tsukimi.store import tensor_parallel as tp

logger = logging.getLogger(__name__)

_MODES = {"as_stored", "full", "shard"}


class ParallelAxis:
    """`mooncake.store.ParallelAxis`: kind ("dp", "pp", "ep", "tp"), rank, size, and
    optionally split_dim, expert_id, stage_id."""

    def __init__(self) -> None:
        self.kind = ""
        self.rank = 0
        self.size = 1
        self.split_dim: int | None = None
        self.expert_id: int | None = None
        self.stage_id: int | None = None

    def __repr__(self) -> str:
        return f"ParallelAxis(kind={self.kind!r}, rank={self.rank}, size={self.size}, split_dim={self.split_dim})"


class TensorParallelism:
    """`mooncake.store.TensorParallelism`: a list of `ParallelAxis`, outermost first."""

    def __init__(self) -> None:
        self.axes: list[ParallelAxis] = []

    def __repr__(self) -> str:
        return f"TensorParallelism(axes={self.axes!r})"


class ReadTarget:
    """`mooncake.store.ReadTarget`: mode "as_stored" (the default), "full" or "shard", and
    the parallelism of the shard. Setting an unknown mode raises InvalidArgument."""

    def __init__(self) -> None:
        self._mode = "as_stored"
        self.parallelism: TensorParallelism | None = None

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        mode = str(value).lower()
        if mode not in _MODES:
            raise InvalidArgument(f"ReadTarget mode must be one of {sorted(_MODES)}, got {value!r}")
        self._mode = mode

    def __repr__(self) -> str:
        return f"ReadTarget(mode={self._mode!r}, parallelism={self.parallelism!r})"


def _int_or_none(value: object, name: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an int or None, got {value!r}")
    return value


def _int(obj: object, name: str) -> int:
    value = _int_or_none(getattr(obj, name, None), name)
    if value is None:
        raise InvalidArgument(f"{type(obj).__name__} has no int {name}")
    return value


def axis_of(obj: object) -> tp.ParallelAxis:
    """tsukimi's axis for a Mooncake (or tsukimi) one. Raises InvalidArgument."""
    if isinstance(obj, tp.ParallelAxis):
        return obj
    kind = str(getattr(obj, "kind", "")).lower()
    return tp.ParallelAxis(
        cast(tp.AxisKind, kind),
        _int(obj, "rank"),
        _int(obj, "size"),
        _int_or_none(getattr(obj, "split_dim", None), "split_dim"),
        _int_or_none(getattr(obj, "expert_id", None), "expert_id"),
        _int_or_none(getattr(obj, "stage_id", None), "stage_id"),
    )


def parallelism_of(obj: object) -> tp.TensorParallelism | None:
    """tsukimi's layout for a Mooncake `TensorParallelism` (None stays None)."""
    if obj is None or isinstance(obj, tp.TensorParallelism):
        return obj
    axes = getattr(obj, "axes", None)
    if not isinstance(axes, list | tuple) or not axes:
        raise InvalidArgument("a TensorParallelism needs at least one axis")
    return tp.TensorParallelism(tuple(axis_of(a) for a in axes))


def partition_of(obj: object) -> tp.WriterPartition | None:
    """A writer partition from any object with int rank, size and split_dim (None stays None)."""
    if obj is None or isinstance(obj, tp.WriterPartition):
        return obj
    return tp.WriterPartition(_int(obj, "rank"), _int(obj, "size"), _int(obj, "split_dim"))


def target_of(obj: object) -> tp.ReadTarget:
    """tsukimi's read target for a Mooncake `ReadTarget` (None reads as stored)."""
    if obj is None:
        return tp.AS_STORED
    if isinstance(obj, tp.ReadTarget):
        return obj
    mode = str(getattr(obj, "mode", "as_stored")).lower()
    if mode not in _MODES:
        raise InvalidArgument(f"ReadTarget mode must be one of {sorted(_MODES)}, got {mode!r}")
    return tp.ReadTarget(cast(tp.ReadMode, mode), parallelism_of(getattr(obj, "parallelism", None)))
