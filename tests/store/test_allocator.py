"""OffsetAllocator: exact offsets for best fit and coalescing, plus a stateful model test."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tsukimi.errors import ConfigError, OutOfBounds
from tsukimi.store.master.allocator import OffsetAllocator


def test_blocks_are_handed_out_back_to_back_with_rounded_sizes() -> None:
    alloc = OffsetAllocator(4096, alignment=64)
    assert [alloc.allocate(n) for n in (100, 200, 50)] == [0, 128, 384]
    assert alloc.used_bytes == 128 + 256 + 64
    assert alloc.free_bytes == 4096 - 448
    assert alloc.largest_free_bytes == 4096 - 448
    assert alloc.num_allocations == 3
    assert alloc.usage == pytest.approx(448 / 4096)
    alloc.check_invariants()


def test_freed_middle_block_is_reused_by_a_smaller_allocation() -> None:
    alloc = OffsetAllocator(4096, alignment=64)
    assert [alloc.allocate(n) for n in (100, 200, 50)] == [0, 128, 384]
    assert alloc.free(128) == 256
    assert alloc.allocate(64) == 128
    assert alloc.allocate(128) == 192  # the rest of the old middle hole, not the tail
    assert alloc.largest_free_bytes == 4096 - 448
    alloc.check_invariants()


def test_best_fit_picks_the_smallest_hole_that_fits() -> None:
    alloc = OffsetAllocator(1024, alignment=64)
    # 0: A (256) | 256: sep (64) | 320: C (128) | 448: sep (64) | 512: free (512)
    assert [alloc.allocate(n) for n in (256, 64, 128, 64)] == [0, 256, 320, 448]
    alloc.free(0)
    alloc.free(320)
    assert alloc.allocate(100) == 320  # holes of 256, 128 and 512: the 128 one
    assert alloc.allocate(200) == 0  # holes of 256 and 512: the 256 one
    assert alloc.allocate(300) == 512  # rounded to 320: the 192-byte tail at 832 stays free
    assert alloc.largest_free_bytes == 192
    alloc.check_invariants()


def test_equal_holes_go_to_the_lowest_offset() -> None:
    alloc = OffsetAllocator(256, alignment=64)
    assert [alloc.allocate(64) for _ in range(4)] == [0, 64, 128, 192]
    alloc.free(128)
    alloc.free(0)
    assert alloc.allocate(1) == 0


def test_freeing_middle_then_left_then_right_coalesces_into_one_block() -> None:
    alloc = OffsetAllocator(192, alignment=64)
    assert [alloc.allocate(64) for _ in range(3)] == [0, 64, 128]
    assert alloc.largest_free_bytes == 0
    alloc.free(64)
    assert alloc.largest_free_bytes == 64
    alloc.free(0)
    assert alloc.largest_free_bytes == 128
    alloc.check_invariants()
    alloc.free(128)
    assert alloc.largest_free_bytes == alloc.capacity == 192
    assert alloc.used_bytes == 0 and alloc.num_allocations == 0
    alloc.check_invariants()
    assert alloc.allocate(192) == 0


def test_a_full_allocator_returns_none() -> None:
    alloc = OffsetAllocator(4096, alignment=64)
    assert alloc.allocate(4096) == 0
    assert alloc.usage == 1.0
    assert alloc.allocate(64) is None
    assert alloc.allocate(1) is None
    alloc.check_invariants()
    assert OffsetAllocator(4096).allocate(4097) is None


def test_capacity_is_rounded_down_to_the_alignment() -> None:
    alloc = OffsetAllocator(1000, alignment=64)
    assert alloc.capacity == 960 and alloc.alignment == 64
    assert alloc.allocate(961) is None
    assert alloc.allocate(900) == 0
    alloc.check_invariants()


@pytest.mark.parametrize(
    ("capacity", "alignment", "message"),
    [
        (0, 64, "capacity"),
        (-64, 64, "capacity"),
        (63, 64, "smaller than the alignment"),
        (4096, 0, "power of two"),
        (4096, -64, "power of two"),
        (4096, 48, "power of two"),
    ],
)
def test_bad_constructor_arguments_raise_config_error(capacity: int, alignment: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        OffsetAllocator(capacity, alignment)


@pytest.mark.parametrize("size", [0, -1])
def test_non_positive_sizes_raise_config_error(size: int) -> None:
    with pytest.raises(ConfigError, match="positive"):
        OffsetAllocator(4096).allocate(size)


def test_double_free_and_unknown_offsets_raise_out_of_bounds() -> None:
    alloc = OffsetAllocator(4096, alignment=64)
    assert alloc.allocate(128) == 0
    with pytest.raises(OutOfBounds, match="offset 64"):
        alloc.free(64)  # inside a live block, but not its start
    assert alloc.free(0) == 128
    with pytest.raises(OutOfBounds, match="double free"):
        alloc.free(0)
    assert alloc.largest_free_bytes == 4096
    alloc.check_invariants()


class AllocatorModel(RuleBasedStateMachine):
    """Drives one allocator against a dict of live blocks; free holes are the gaps between them."""

    capacity = 1000  # rounded down to 992
    alignment = 16

    def __init__(self) -> None:
        super().__init__()
        self.alloc = OffsetAllocator(self.capacity, self.alignment)
        self.live: dict[int, int] = {}  # offset -> rounded size

    def rounded(self, size: int) -> int:
        return -(-size // self.alignment) * self.alignment

    def holes(self) -> list[tuple[int, int]]:
        """(size, offset) of every maximal gap between live blocks."""
        out, cursor = [], 0
        for offset in sorted(self.live):
            if offset > cursor:
                out.append((offset - cursor, cursor))
            cursor = offset + self.live[offset]
        if cursor < self.alloc.capacity:
            out.append((self.alloc.capacity - cursor, cursor))
        return out

    @rule(size=st.integers(1, 400))
    def allocate(self, size: int) -> None:
        rounded = self.rounded(size)
        fitting = [hole for hole in self.holes() if hole[0] >= rounded]
        offset = self.alloc.allocate(size)
        if offset is None:
            assert not fitting
            assert self.alloc.largest_free_bytes < rounded
        else:
            assert offset == min(fitting)[1]  # best fit, lowest offset among equals
            self.live[offset] = rounded

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        offset = data.draw(st.sampled_from(sorted(self.live)))
        assert self.alloc.free(offset) == self.live.pop(offset)

    @rule(offset=st.integers(-16, 1100))
    def free_unknown(self, offset: int) -> None:
        if offset in self.live:
            return
        used = self.alloc.used_bytes
        with pytest.raises(OutOfBounds):
            self.alloc.free(offset)
        assert self.alloc.used_bytes == used

    @invariant()
    def agrees_with_model(self) -> None:
        self.alloc.check_invariants()
        assert self.alloc.used_bytes == sum(self.live.values())
        assert self.alloc.num_allocations == len(self.live)
        holes = self.holes()
        assert self.alloc.largest_free_bytes == max((s for s, _ in holes), default=0)
        blocks = sorted(self.live.items())
        for (a, n), (b, _) in pairwise(blocks):
            assert a + n <= b, f"live blocks at {a} and {b} overlap"
        assert all(o % self.alignment == 0 and o + n <= self.alloc.capacity for o, n in blocks)


class ByteAlignedAllocatorModel(AllocatorModel):
    capacity = 700
    alignment = 1


TestAllocatorModel = AllocatorModel.TestCase
TestAllocatorModel.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestByteAlignedAllocatorModel = ByteAlignedAllocatorModel.TestCase
TestByteAlignedAllocatorModel.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
