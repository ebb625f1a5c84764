"""`mooncake.structured_object_store`, the part tsukimi provides: inferring the column
structure of a batch of Python rows and choosing a codec for each leaf column.

`infer_structure(path, rows, leaves, nodes)` walks rows (dicts, lists, scalars, tensors, any
of them None) into `StructureNode`s (a "dict" node per mapping column, a "list" node per
column of lists of containers, one child per position) and `StructureLeaf`s (one value per
row, `MISSING` where the row has no such key or position, None where it is null), each with
the `CodecDecision` `_choose_leaf_codec` makes for its values:

    ragged_tensor   torch tensors (accepted only if of one dtype)
    ndarray         numeric scalars (bool, int, float)
    bytes_ragged    bytes-like          utf8_ragged   str
    typed_ragged    lists / tuples of numeric scalars
    msgpack_ragged  other containers msgpack can encode; refused for anything else

Paths name columns: `root.key` for a dict key (with `.`, `[` and `\\` escaped by a
backslash), `root[i]` for list position i. The store operations of Mooncake's module are
not provided.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from numbers import Real

import msgspec
import torch

logger = logging.getLogger(__name__)

MAX_DEPTH = 32  # nesting levels infer_structure follows before refusing the rows


class _Missing:
    """The value of a column in a row that lacks it (unlike None, a present null)."""

    _instance: _Missing | None = None

    def __new__(cls) -> _Missing:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<MISSING>"

    def __bool__(self) -> bool:
        return False


MISSING = _Missing()


@dataclass(frozen=True, slots=True)
class CodecDecision:
    """How a leaf column would be encoded, and whether that codec takes every value."""

    accepted: bool
    codec: str
    reason: str
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class StructureLeaf:
    """A column of plain values: one per row (None for null, MISSING for absent)."""

    path: str
    values: list[object]
    decision: CodecDecision


@dataclass(slots=True)
class StructureNode:
    """A container column: "dict" (children are keys) or "list" (children are positions,
    `lengths` the length of each row's list). `row_mask[i]`: row i holds a container."""

    path: str
    node_type: str
    children: list[object]
    row_mask: list[bool]
    lengths: list[int] | None = None


def _escape_key(key: str) -> str:
    """A dict key as one path segment: `\\`, `.` and `[` escaped with a backslash."""
    return key.replace("\\", "\\\\").replace(".", "\\.").replace("[", "\\[")


def _absent(value: object) -> bool:
    return value is None or value is MISSING


def _numeric(value: object) -> bool:
    return isinstance(value, bool | Real) and not isinstance(value, torch.Tensor)


def _scalar_dtype(values: Sequence[object]) -> str:
    if all(isinstance(v, bool) for v in values):
        return "bool"
    return "int64" if all(isinstance(v, int) for v in values) else "float64"


def _msgpack_ok(value: object) -> bool:
    try:
        msgspec.msgpack.encode(value)
    except (TypeError, ValueError, OverflowError):
        return False
    return True


def _choose_leaf_codec(values: Sequence[object]) -> CodecDecision:
    """The codec for a leaf column (None and MISSING values are skipped; every other value
    is checked, not a sample)."""
    present = [v for v in values if not _absent(v)]
    if not present:
        return CodecDecision(False, "msgpack_ragged", "all rows are null")
    if all(isinstance(v, torch.Tensor) for v in present):
        dtypes = {v.dtype for v in present if isinstance(v, torch.Tensor)}
        reason = "all rows are tensors" if len(dtypes) == 1 else f"tensors of {len(dtypes)} dtypes"
        return CodecDecision(len(dtypes) == 1, "ragged_tensor", reason, {"dtype": str(dtypes.pop())[6:]})
    if all(_numeric(v) for v in present):
        return CodecDecision(True, "ndarray", "all rows are numeric scalars", {"dtype": _scalar_dtype(present)})
    if all(isinstance(v, bytes | bytearray | memoryview) for v in present):
        return CodecDecision(True, "bytes_ragged", "all rows are bytes-like")
    if all(isinstance(v, str) for v in present):
        return CodecDecision(True, "utf8_ragged", "all rows are str")
    items = _items(present)
    if items is not None and all(_numeric(x) for x in items):
        meta = {"dtype": _scalar_dtype(items)} if items else {}
        return CodecDecision(True, "typed_ragged", "all rows are numeric sequences", meta)
    if all(isinstance(v, dict | list | tuple) for v in present) and all(_msgpack_ok(v) for v in present):
        return CodecDecision(True, "msgpack_ragged", "all rows are msgpack-encodable containers")
    return CodecDecision(False, "msgpack_ragged", "no codec takes every row")


def _items(rows: Sequence[object]) -> list[object] | None:
    """The items of every row when every row is a list or tuple, else None."""
    items: list[object] = []
    for row in rows:
        if not isinstance(row, list | tuple):
            return None
        items.extend(row)
    return items


def infer_structure(
    path: str,
    values: Sequence[object],
    leaves: list[StructureLeaf],
    nodes: list[StructureNode],
    *,
    _depth: int = 0,
) -> None:
    """Append the nodes and leaves of the column `values` under `path` (mutates `leaves`
    and `nodes`; a node comes before its children). `_depth`, the nesting level of `path`,
    is the recursion's own (keyword-only and private, as in the wheel). Raises ValueError
    past MAX_DEPTH."""
    if _depth > MAX_DEPTH:
        raise ValueError(f"{path!r} nests deeper than {MAX_DEPTH} levels")
    present = [v for v in values if not _absent(v)]
    if present and all(isinstance(v, dict) for v in present):
        _infer_dict(path, values, leaves, nodes, _depth)
    elif present and any(isinstance(x, dict | list | tuple) for x in _items(present) or ()):
        _infer_list(path, values, leaves, nodes, _depth)
    else:
        leaves.append(StructureLeaf(path, list(values), _choose_leaf_codec(values)))


def _infer_dict(
    path: str, values: Sequence[object], leaves: list[StructureLeaf], nodes: list[StructureNode], depth: int
) -> None:
    keys: dict[object, None] = {}  # NOTE: a dict keeps first-seen order
    for row in values:
        if isinstance(row, dict):
            keys.update(dict.fromkeys(row))
    nodes.append(StructureNode(path, "dict", list(keys), [isinstance(v, dict) for v in values]))
    for key in keys:
        column = [row.get(key, MISSING) if isinstance(row, dict) else row for row in values]
        infer_structure(f"{path}.{_escape_key(str(key))}", column, leaves, nodes, _depth=depth + 1)


def _infer_list(
    path: str, values: Sequence[object], leaves: list[StructureLeaf], nodes: list[StructureNode], depth: int
) -> None:
    lengths = [len(v) if isinstance(v, list | tuple) else 0 for v in values]
    width = max(lengths, default=0)
    nodes.append(
        StructureNode(path, "list", list(range(width)), [isinstance(v, list | tuple) for v in values], lengths)
    )
    for i in range(width):
        column = [(row[i] if i < len(row) else MISSING) if isinstance(row, list | tuple) else row for row in values]
        infer_structure(f"{path}[{i}]", column, leaves, nodes, _depth=depth + 1)
