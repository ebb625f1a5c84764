"""The tensor object format: exact round trips, zero-copy views, and every malformed header refused."""

from __future__ import annotations

import struct

import pytest
import torch

from tsukimi.errors import InvalidArgument, InvalidBufferError, KVFormatError
from tsukimi.store.tensor_format import (
    HEADER_BYTES,
    ShardPlacement,
    TensorHeader,
    deserialize,
    serialize,
    serialize_into,
    serialized_size,
)

CASES = [
    torch.arange(12, dtype=torch.float32).reshape(3, 4),
    torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
    torch.tensor([[1.5, -2.25]], dtype=torch.float16),
    torch.tensor([True, False, True]),
    torch.arange(-4, 4, dtype=torch.int8),
    torch.arange(24, dtype=torch.int64).reshape(2, 3, 4),
    torch.tensor(3.25, dtype=torch.float64),  # 0-dim
    torch.empty((2, 0, 3), dtype=torch.float32),
    torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64),
    torch.arange(8, dtype=torch.uint8).reshape(2, 4).t(),  # not contiguous
]


@pytest.mark.parametrize("tensor", CASES, ids=lambda t: f"{t.dtype}-{tuple(t.shape)}")
def test_round_trip_is_exact(tensor: torch.Tensor) -> None:
    data = serialize(tensor)
    assert len(data) == serialized_size(tensor) == HEADER_BYTES + tensor.numel() * tensor.element_size()
    header, back = deserialize(data)
    assert header.dtype == tensor.dtype and header.shape == tuple(tensor.shape) and header.shard == ShardPlacement()
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(back, tensor)


def test_deserialize_views_the_bytes_without_copying() -> None:
    data = serialize(torch.zeros(4, dtype=torch.int32))
    _, view = deserialize(data)
    view[2] = 7
    assert struct.unpack_from("<4i", data, HEADER_BYTES) == (0, 0, 7, 0)


def test_serialize_into_a_larger_buffer_returns_a_view_of_it() -> None:
    buffer = bytearray(HEADER_BYTES + 64)
    stored = serialize_into(torch.arange(4, dtype=torch.int64), memoryview(buffer), ShardPlacement(1, 2, 0))
    stored.fill_(9)
    header, again = deserialize(buffer, exact=False)
    assert header.shard == ShardPlacement(1, 2, 0) and again.tolist() == [9, 9, 9, 9]
    with pytest.raises(KVFormatError):
        deserialize(buffer)  # exact: 32 bytes too many


def test_too_small_buffer_is_refused() -> None:
    with pytest.raises(InvalidBufferError):
        serialize_into(torch.zeros(4), memoryview(bytearray(HEADER_BYTES + 15)))


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda b: b.__setitem__(slice(0, 4), b"NOPE"),  # magic
        lambda b: struct.pack_into("<H", b, 4, 99),  # version
        lambda b: struct.pack_into("<H", b, 6, 999),  # dtype code
        lambda b: struct.pack_into("<I", b, 8, 33),  # ndim
        lambda b: struct.pack_into("<Q", b, 16, 8),  # payload size vs shape
        lambda b: struct.pack_into("<Q", b, 24 + 8 * 5, 3),  # a size past the last dim
    ],
    ids=["magic", "version", "dtype", "ndim", "payload", "stray-dim"],
)
def test_a_wrong_header_is_refused(corrupt: object) -> None:
    data = serialize(torch.arange(6, dtype=torch.float32).reshape(2, 3))
    corrupt(data)  # type: ignore[operator]
    with pytest.raises(KVFormatError):
        deserialize(data)


def test_short_or_foreign_bytes_are_refused() -> None:
    with pytest.raises(KVFormatError):
        deserialize(bytearray(b"hello world"))
    with pytest.raises(KVFormatError):
        deserialize(bytearray(HEADER_BYTES))  # zeros: no magic
    with pytest.raises(KVFormatError):
        deserialize(serialize(torch.zeros(4))[:-1])  # payload cut short


def test_what_cannot_be_stored_is_an_invalid_argument() -> None:
    with pytest.raises(InvalidArgument):
        serialize([1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        TensorHeader.of(torch.zeros([1] * 33))
    with pytest.raises(InvalidArgument):
        serialize(torch.zeros(2).to(torch.float8_e4m3fnuz))  # not in the format's dtype table
