"""batch_copy.py: gather/scatter byte-exact in few operations (counted on the emulated device; on
CUDA with `pytest -m gpu`), device scratch, and the host staging's lending, growth and pinning."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import pytest

from tests.device.conftest import Alloc
from tsukimi.device import EMULATED, DeviceBackend, DeviceRange
from tsukimi.device.batch_copy import (
    HostBuffer,
    HostStaging,
    anonymous_buffer,
    device_scratch,
    gather,
    scatter,
    scatter_at,
)
from tsukimi.errors import ClosedError, InvalidBufferError


def _pattern(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _read(be: DeviceBackend, memory: DeviceRange) -> bytes:
    out = bytearray(memory.length)
    be.to_host(memory, memoryview(out))
    return bytes(out)


def _counts() -> dict[str, int]:
    return {k: EMULATED.stats[k] for k in ("copy", "gather", "scatter", "to_host", "from_host")}


def _delta(before: dict[str, int]) -> dict[str, int]:
    return {k: v - before[k] for k, v in _counts().items() if v != before[k]}


def test_rows_of_one_allocation_move_in_one_operation(device: tuple[DeviceBackend, Alloc]) -> None:
    be, alloc = device
    row, rows = 4096, 64
    cache = alloc(rows * row)
    data = _pattern(rows * row, 1)
    be.from_host(cache, memoryview(data))
    picked = random.Random(2).sample(range(rows), 40)
    srcs = [cache.sub(r * row, row) for r in picked]
    packed = alloc(len(picked) * row)
    before = _counts()
    gather(packed, srcs)
    if be is EMULATED:
        assert _delta(before) == {"gather": 1}
    assert _read(be, packed) == b"".join(data[r * row : (r + 1) * row] for r in picked)
    other = alloc(rows * row)
    dsts = [other.sub(r * row, row) for r in picked]
    before = _counts()
    scatter(packed, dsts)
    if be is EMULATED:
        assert _delta(before) == {"scatter": 1}
    got = _read(be, other)
    for r in range(rows):
        want = data[r * row : (r + 1) * row] if r in picked else bytes(row)
        assert got[r * row : (r + 1) * row] == want


def test_rows_of_two_allocations_and_odd_ranges(device: tuple[DeviceBackend, Alloc]) -> None:
    be, alloc = device
    row = 1000
    a, b, odd = alloc(10 * row), alloc(10 * row), alloc(5000)
    be.from_host(a, memoryview(_pattern(10 * row, 3)))
    be.from_host(b, memoryview(_pattern(10 * row, 4)))
    be.from_host(odd, memoryview(_pattern(5000, 5)))
    # interleaved: the packed side of each allocation's rows is not in order (but row-aligned)
    srcs = [a.sub(7 * row, row), odd.sub(10, 2 * row), b.sub(2 * row, row), a.sub(1 * row, row), b.sub(9 * row, row)]
    srcs += [odd.sub(2100, 7), odd.sub(2107, 93)]  # adjacent on both sides: one copy
    packed = alloc(sum(s.length for s in srcs))
    before = _counts()
    gather(packed, srcs)
    if be is EMULATED:
        assert _delta(before) == {"gather": 2, "copy": 2}
    expected = b"".join(_read(be, s) for s in srcs)
    assert _read(be, packed) == expected
    dsts = [alloc(s.length) for s in srcs]
    scatter(packed, dsts)
    assert [_read(be, d) for d in dsts] == [_read(be, s) for s in srcs]


def test_one_range_and_lengths_that_do_not_add_up(device: tuple[DeviceBackend, Alloc]) -> None:
    be, alloc = device
    src, packed = alloc(100), alloc(100)
    be.from_host(src, memoryview(_pattern(100, 6)))
    gather(packed, [src])
    assert _read(be, packed) == _read(be, src)
    with pytest.raises(InvalidBufferError):
        gather(packed, [])
    with pytest.raises(InvalidBufferError):
        gather(packed, [src.sub(0, 50)])
    with pytest.raises(InvalidBufferError):
        scatter(packed, [src, src])


def test_scatter_at_leaves_the_gaps_unread(device: tuple[DeviceBackend, Alloc]) -> None:
    be, alloc = device
    row = 512
    packed, cache = alloc(8 * row), alloc(16 * row)
    data = _pattern(8 * row, 8)
    be.from_host(packed, memoryview(data))
    pieces = [(0, cache.sub(3 * row, row)), (5 * row, cache.sub(9 * row, row)), (2 * row, cache.sub(0, 100))]
    before = _counts()
    scatter_at(packed, pieces)
    if be is EMULATED:
        assert _delta(before) == {"scatter": 1, "copy": 1}
    got = _read(be, cache)
    assert got[3 * row : 4 * row] == data[:row]
    assert got[9 * row : 10 * row] == data[5 * row : 6 * row]
    assert got[:100] == data[2 * row : 2 * row + 100]
    with pytest.raises(InvalidBufferError):
        scatter_at(packed, [(8 * row - 10, cache.sub(0, 20))])


def test_device_scratch_is_device_memory() -> None:
    with device_scratch("emu:0", 4096) as scratch:
        assert scratch.device == "emu:0" and scratch.length == 4096
        assert EMULATED.locate(scratch.address, 4096) == scratch
    assert EMULATED.locate(scratch.address, 1) is None
    with pytest.raises(InvalidBufferError), device_scratch("emu:0", 0):
        pass


def test_host_staging_reuses_grows_and_waits() -> None:
    allocated: list[int] = []
    freed: list[int] = []

    def allocate(n: int) -> HostBuffer:
        allocated.append(n)
        buffer = anonymous_buffer(n)

        def release() -> None:
            freed.append(n)
            buffer.release()

        return HostBuffer(buffer.view, release)

    staging = HostStaging(allocate, max_buffers=1)
    with staging.borrow(100, "emu:0") as view:
        assert len(view) == 100 and not view.readonly
        view[:3] = b"abc"
    with staging.borrow(1 << 20, "emu:0") as view:
        assert bytes(view[:3]) == b"abc"  # the same buffer, lent again
    assert allocated == [1 << 20]
    with staging.borrow((3 << 20) + 1, "emu:0") as view:
        assert len(view) == (3 << 20) + 1
    assert allocated == [1 << 20, 4 << 20] and freed == [1 << 20]
    assert staging.num_bytes == 4 << 20
    order: list[str] = []
    with staging.borrow(10, "emu:0"):
        waiter = threading.Thread(target=lambda: _borrow_once(staging, order))
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive()  # every buffer is lent: it waits
        order.append("returned")
    waiter.join(5)
    assert order == ["returned", "borrowed"]
    staging.close()
    assert freed == [1 << 20, 4 << 20]
    with pytest.raises(ClosedError), staging.borrow(1, "emu:0"):
        pass


def _borrow_once(staging: HostStaging, order: list[str]) -> None:
    with staging.borrow(10, "emu:0"):
        order.append("borrowed")


def test_host_staging_pins_once_per_kind_and_survives_a_pin_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    from tsukimi.errors import DeviceError

    calls: list[str] = []

    def pin(view: memoryview) -> Callable[[], None]:
        calls.append("pin")
        raise DeviceError("cuMemHostRegister failed: CUDA_ERROR_NOT_PERMITTED")

    monkeypatch.setattr(EMULATED, "pin", pin)
    staging = HostStaging()
    for _ in range(3):
        with staging.borrow(64, "emu:0") as view:
            view[:1] = b"x"
    assert calls == ["pin"]
    staging.close()
