"""Column inference of `mooncake.structured_object_store` on tsukimi: exact nodes, leaves and codecs."""

from __future__ import annotations

import pytest
import torch

from tsukimi.compat.mooncake.structured_object_store import (
    MISSING,
    StructureLeaf,
    StructureNode,
    _choose_leaf_codec,
    _escape_key,
    infer_structure,
)


def infer(rows: list[object]) -> tuple[list[StructureLeaf], list[StructureNode]]:
    leaves: list[StructureLeaf] = []
    nodes: list[StructureNode] = []
    infer_structure("r", rows, leaves, nodes)
    return leaves, nodes


@pytest.mark.parametrize(
    ("values", "accepted", "codec"),
    [
        ([torch.ones(2), torch.ones(1, 3)], True, "ragged_tensor"),
        ([torch.ones(2), torch.ones(2, dtype=torch.int64)], False, "ragged_tensor"),
        ([True, 2, 3.5], True, "ndarray"),
        ([b"a", bytearray(b"b"), None], True, "bytes_ragged"),
        (["x", MISSING, "y"], True, "utf8_ragged"),
        ([[1, 2], (3.5,), []], True, "typed_ragged"),
        ([{"a": [1, "x"]}, ["y"]], True, "msgpack_ragged"),
        ([1, "a"], False, "msgpack_ragged"),
        ([{"a": object()}], False, "msgpack_ragged"),
        ([None, MISSING], False, "msgpack_ragged"),
    ],
)
def test_codec_choice(values: list[object], accepted: bool, codec: str) -> None:
    decision = _choose_leaf_codec(values)
    assert (decision.accepted, decision.codec) == (accepted, codec)


def test_scalar_dtypes() -> None:
    assert _choose_leaf_codec([True, False]).metadata == {"dtype": "bool"}
    assert _choose_leaf_codec([1, 2]).metadata == {"dtype": "int64"}
    assert _choose_leaf_codec([1, 2.5]).metadata == {"dtype": "float64"}


def test_lists_of_containers_are_one_column_per_position() -> None:
    leaves, nodes = infer([[{"k": 1}], [{"k": 2}, {"k": 3}], None])
    assert [(n.path, n.node_type, n.children, n.row_mask, n.lengths) for n in nodes] == [
        ("r", "list", [0, 1], [True, True, False], [1, 2, 0]),
        ("r[0]", "dict", ["k"], [True, True, False], None),
        ("r[1]", "dict", ["k"], [False, True, False], None),
    ]
    assert [(leaf.path, leaf.values) for leaf in leaves] == [("r[0].k", [1, 2, None]), ("r[1].k", [MISSING, 3, None])]


def test_dict_keys_keep_first_seen_order_and_are_escaped() -> None:
    leaves, nodes = infer([{"b": 1, "a.x": "s"}, {"c": b"z", "b": 2}])
    assert nodes[0].children == ["b", "a.x", "c"]
    assert [leaf.path for leaf in leaves] == ["r.b", "r.a\\.x", "r.c"]
    assert [leaf.decision.codec for leaf in leaves] == ["ndarray", "utf8_ragged", "bytes_ragged"]
    assert _escape_key("a\\.[b]") == "a\\\\\\.\\[b]"


def test_missing_is_a_falsy_singleton() -> None:
    assert type(MISSING)() is MISSING and not MISSING and repr(MISSING) == "<MISSING>"


def test_depth_limit() -> None:
    row: object = 0
    for _ in range(33):
        row = {"a": row}
    with pytest.raises(ValueError):
        infer([row])
    row = 0
    for _ in range(32):
        row = {"a": row}
    leaves, nodes = infer([row])
    assert len(nodes) == 32 and len(leaves) == 1
