"""The local segment registry: buffer conversion, and a Hypothesis stateful model."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tsukimi.errors import InvalidBufferError, OutOfBounds
from tsukimi.transfer.segment import LocalSegment, byte_view


def test_byte_view_accepts_the_documented_buffer_kinds() -> None:
    arr = np.arange(16, dtype=np.uint32)
    tensor = torch.arange(8, dtype=torch.bfloat16)
    raw = ctypes.create_string_buffer(64)
    mm = mmap.mmap(-1, 4096)
    cases = [
        (bytearray(10), 10),
        (mm, 4096),
        (arr, 64),
        (tensor, 16),
        ((ctypes.addressof(raw), 64), 64),
        (memoryview(bytearray(8)), 8),
    ]
    for obj, nbytes in cases:
        view, address = byte_view(obj)
        assert len(view) == nbytes and view.format == "B" and address > 0
    view, address = byte_view(arr)
    assert address == arr.ctypes.data
    assert byte_view(tensor)[1] == tensor.data_ptr()
    view[0] = 255  # a view writes through to the array
    assert arr[0] == 255


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (b"read only", "writable"),
        (np.arange(10)[::2], "contiguous"),
        (bytearray(), "empty"),
        (12345, "cannot use"),
        ((0, 10), "address"),
        (torch.arange(10)[::2], "contiguous"),
    ],
)
def test_byte_view_rejects_what_cannot_be_registered(obj: object, message: str) -> None:
    with pytest.raises(InvalidBufferError, match=message):
        byte_view(obj)


def test_read_only_sources_are_fine_for_writes() -> None:
    view, _ = byte_view(b"abc", writable=False)
    assert bytes(view) == b"abc"


class SegmentModel(RuleBasedStateMachine):
    """Registers and removes fake address ranges; resolve must agree with a plain model."""

    def __init__(self) -> None:
        super().__init__()
        self.segment = LocalSegment("model")
        self.model: dict[int, int] = {}  # base -> length
        self.backing = bytearray(1 << 16)

    @rule(base=st.integers(0, 60).map(lambda i: 4096 + i * 1000), length=st.integers(1, 3000))
    def add(self, base: int, length: int) -> None:
        view = memoryview(self.backing)[:length]
        overlaps = any(b < base + length and base < b + n for b, n in self.model.items())
        if overlaps:
            with pytest.raises(InvalidBufferError):
                self.segment.add(view, base, None)
        else:
            self.segment.add(view, base, None)
            self.model[base] = length

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        base = data.draw(st.sampled_from(sorted(self.model)))
        assert self.segment.remove(base).length == self.model.pop(base)

    @rule(offset=st.integers(0, 70000), length=st.integers(-1, 4000))
    def resolve(self, offset: int, length: int) -> None:
        inside = length > 0 and any(b <= offset and offset + length <= b + n for b, n in self.model.items())
        if inside:
            assert len(self.segment.resolve(offset, length)) == length
        else:
            with pytest.raises(OutOfBounds):
                self.segment.resolve(offset, length)

    @rule(base=st.integers(0, 70000))
    def remove_unknown(self, base: int) -> None:
        if base not in self.model:
            with pytest.raises(OutOfBounds):
                self.segment.remove(base)

    @invariant()
    def consistent(self) -> None:
        self.segment.check_invariants()
        assert sorted(self.model) == [b.base for b in self.segment.buffers()]


TestSegmentModel = SegmentModel.TestCase


def _desc(buffers: list[tuple[int, int]]) -> bytes:
    from tsukimi.transfer.segment import BufferDescriptor, SegmentDescriptor, encode_descriptor

    return encode_descriptor(SegmentDescriptor("s", "h", 1, 1, [], [BufferDescriptor(b, n) for b, n in buffers]))


def test_descriptors_are_sorted_on_decode_and_found_by_bisection() -> None:
    from tsukimi.transfer.segment import decode_descriptor

    desc = decode_descriptor(_desc([(3000, 100), (1000, 500), (2000, 10)]))
    assert [b.base for b in desc.buffers] == [1000, 2000, 3000]
    assert desc.find(1000, 500) == desc.buffers[0]
    assert desc.find(2005, 5) == desc.buffers[1]
    assert desc.find(2005, 6) is None  # runs past the end of its buffer
    assert desc.find(999, 1) is None and desc.find(3100, 1) is None and desc.find(1500, 1) is None


@pytest.mark.parametrize("buffers", [[(1000, 500), (1400, 10)], [(1000, 0)], [(-5, 10)]])
def test_malformed_descriptors_are_rejected(buffers: list[tuple[int, int]]) -> None:
    import msgspec

    from tsukimi.transfer.segment import decode_descriptor

    with pytest.raises(msgspec.ValidationError):
        decode_descriptor(_desc(buffers))
