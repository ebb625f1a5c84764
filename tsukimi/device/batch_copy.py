"""Many device ranges moved as one: packing them into one device range and back, and the pinned
host staging those packed bytes cross the host<->device link through.

    gather(packed, [a, b, c])    packed = | a | b | c |      (device -> device, back to back)
    scatter(packed, [a, b, c])   the inverse: a, b, c filled from packed's consecutive bytes

The fewest device operations possible (GPU.md: 4,096 blocks of 32 KiB, a copy each 2.9 GB/s;
one contiguous copy plus one scatter kernel 47.8 GB/s):

- ranges of one size that are rows of one allocation (a paged KV cache's blocks: every
  (address - lowest) % size == 0, and the span from the lowest to the highest inside one
  allocation) move in ONE indexed kernel per allocation: on CUDA a torch `index_select` /
  `index_copy_` over a [rows, size] uint8 view of that span (raw pointers wrapped through
  `__cuda_array_interface__`; torch is imported only then); on the emulated device its own
  "kernel", counted in `EMULATED.stats["gather"]` / `["scatter"]` (+ `_bytes`);
- every other range is a backend copy, neighbours that are adjacent on both sides merged into
  one copy, queued back to back.

`device_scratch(device, nbytes)` lends a temporary device range (the packed side of a batch).
`HostStaging` lends host buffers, pinned (page-locked) with the device's backend on first use
with it, reused and grown as batches need; whoever makes it decides where they live (the store
client allocates them as Transfer Engine memory, so the pool reads and writes them directly).

Same ordering contract as the backends: every call returns when its bytes are in place.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from tsukimi.device.base import DeviceRange
from tsukimi.device.emulated import EMULATED, EmulatedDevice
from tsukimi.device.registry import backend, pin_or_warn
from tsukimi.errors import ClosedError, ConfigError, DeviceError, InvalidBufferError

logger = logging.getLogger(__name__)


# -- the plan: which ranges move as rows of one allocation, which as copies -------------------


@dataclass(frozen=True, slots=True)
class _Rows:
    """Ranges of `row_bytes` each that are rows of `span` (rows[i]) and, in the packed range,
    rows of the view starting at `packed_first` (packed_rows[i])."""

    span: DeviceRange
    row_bytes: int
    rows: list[int]
    packed_first: int
    packed_rows: list[int]

    @property
    def packed_in_order(self) -> bool:
        """Whether the packed side is exactly rows 0, 1, ... (a plain slice, no index)."""
        return self.packed_rows == list(range(len(self.packed_rows)))

    @property
    def consecutive(self) -> bool:
        """Whether both sides are one range, rows in the same order (a copy moves them)."""
        first = self.rows[0]
        return self.packed_in_order and self.rows == list(range(first, first + len(self.rows)))

    def packed_span(self, packed: DeviceRange) -> DeviceRange:
        return packed.sub(self.packed_first, (max(self.packed_rows) + 1) * self.row_bytes)


@dataclass(frozen=True, slots=True)
class _Plan:
    rows: list[_Rows]
    copies: list[tuple[int, DeviceRange]]  # (offset in packed, range), merged where adjacent


def _plan(packed: DeviceRange, ranges: Sequence[DeviceRange], offsets: Sequence[int], kernel: bool) -> _Plan:
    """How to move `ranges` to or from their places `offsets` in `packed`."""
    buckets: dict[tuple[str, int, int, int], list[int]] = defaultdict(list)
    loose: list[int] = []
    for i, memory in enumerate(ranges):
        if kernel and memory.device == packed.device:
            n = memory.length
            buckets[(memory.device, n, memory.address % n, offsets[i] % n)].append(i)
        else:
            loose.append(i)
    groups: list[_Rows] = []
    for (_, row_bytes, _, _), members in buckets.items():
        if len(members) < 2:
            loose += members
            continue
        members.sort(key=lambda i: ranges[i].address)
        for part in _by_allocation(ranges, members, row_bytes):
            rows = _rows_of(ranges, offsets, part, row_bytes) if len(part) > 1 else None
            if rows is None or rows.consecutive:  # NOTE: one range on both sides: one copy beats a kernel
                loose += part
            else:
                groups.append(rows)
    return _Plan(groups, _merged([(offsets[i], ranges[i]) for i in sorted(loose, key=lambda i: offsets[i])]))


def _by_allocation(ranges: Sequence[DeviceRange], members: list[int], row_bytes: int) -> list[list[int]]:
    """`members` (sorted by address) cut into runs whose span lies in one allocation: one
    `locate` per run found, halving where a span crosses allocations."""
    low, high = ranges[members[0]].address, ranges[members[-1]].address + row_bytes
    if len(members) == 1:
        return [members]
    device = ranges[members[0]].device
    try:
        found = backend(device).locate(low, high - low)
    except InvalidBufferError:  # NOTE: runs past the first allocation: cut in two
        found = None
    if found is not None and found.device == device:
        return [members]
    mid = len(members) // 2
    return _by_allocation(ranges, members[:mid], row_bytes) + _by_allocation(ranges, members[mid:], row_bytes)


def _rows_of(ranges: Sequence[DeviceRange], offsets: Sequence[int], members: list[int], row_bytes: int) -> _Rows:
    low = ranges[members[0]].address
    high = ranges[members[-1]].address + row_bytes
    packed_first = min(offsets[i] for i in members)
    return _Rows(
        DeviceRange(ranges[members[0]].device, low, high - low),
        row_bytes,
        [(ranges[i].address - low) // row_bytes for i in members],
        packed_first,
        [(offsets[i] - packed_first) // row_bytes for i in members],
    )


def _merged(pieces: list[tuple[int, DeviceRange]]) -> list[tuple[int, DeviceRange]]:
    """Pieces in packed order, each merged into the one before when both sides are adjacent."""
    out: list[tuple[int, DeviceRange]] = []
    for offset, memory in pieces:
        if out:
            last_offset, last = out[-1]
            if (
                last.device == memory.device
                and last_offset + last.length == offset
                and last.address + last.length == memory.address
            ):
                out[-1] = (last_offset, DeviceRange(last.device, last.address, last.length + memory.length))
                continue
        out.append((offset, memory))
    return out


# -- the kernels: one indexed move of many rows --------------------------------------------


class _RowKernel(Protocol):
    def gather(self, packed: DeviceRange, rows: _Rows) -> None: ...
    def scatter(self, packed: DeviceRange, rows: _Rows) -> None: ...
    def finish(self, device: str) -> None: ...


class _EmulatedKernel:
    """The emulated device's row kernel (its memory is this process's mapping), counted as one
    operation per call, as a GPU runs one kernel."""

    _lock = threading.Lock()

    def gather(self, packed: DeviceRange, rows: _Rows) -> None:
        out = rows.packed_span(packed).address
        for row, packed_row in zip(rows.rows, rows.packed_rows, strict=True):
            ctypes.memmove(out + packed_row * rows.row_bytes, rows.span.address + row * rows.row_bytes, rows.row_bytes)
        self._count("gather", len(rows.rows) * rows.row_bytes)

    def scatter(self, packed: DeviceRange, rows: _Rows) -> None:
        src = rows.packed_span(packed).address
        for row, packed_row in zip(rows.rows, rows.packed_rows, strict=True):
            ctypes.memmove(rows.span.address + row * rows.row_bytes, src + packed_row * rows.row_bytes, rows.row_bytes)
        self._count("scatter", len(rows.rows) * rows.row_bytes)

    def finish(self, device: str) -> None:
        return None

    def _count(self, what: str, nbytes: int) -> None:
        # NOTE: these keys are written here only, under this lock (the backend's own lock
        # guards the keys it writes)
        with self._lock:
            EMULATED.stats[what] += 1
            EMULATED.stats[f"{what}_bytes"] += nbytes


class _CudaArray:
    """Raw device memory as `__cuda_array_interface__` (v3) sees it: a [rows, width] uint8 array."""

    def __init__(self, memory: DeviceRange, width: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (memory.length // width, width),
            "typestr": "|u1",
            "data": (memory.address, False),
            "version": 3,
            "strides": None,
        }


class _TorchKernel:
    """CUDA rows through torch: one `index_select` or `index_copy_` per group of rows."""

    def __init__(self) -> None:
        import torch  # NOTE: only on CUDA: the CPU path never imports torch here

        self._torch = torch

    def _view(self, memory: DeviceRange, width: int):  # type: ignore[no-untyped-def]
        return self._torch.as_tensor(_CudaArray(memory, width), device=memory.device)

    def _index(self, rows: list[int], device: str):  # type: ignore[no-untyped-def]
        return self._torch.from_numpy(np.asarray(rows, dtype=np.int64)).to(device)

    def gather(self, packed: DeviceRange, rows: _Rows) -> None:
        src = self._view(rows.span, rows.row_bytes)
        dst = self._view(rows.packed_span(packed), rows.row_bytes)
        index = self._index(rows.rows, packed.device)
        if rows.packed_in_order:
            self._torch.index_select(src, 0, index, out=dst)
        else:
            dst.index_copy_(0, self._index(rows.packed_rows, packed.device), src.index_select(0, index))

    def scatter(self, packed: DeviceRange, rows: _Rows) -> None:
        src = self._view(rows.packed_span(packed), rows.row_bytes)
        dst = self._view(rows.span, rows.row_bytes)
        if not rows.packed_in_order:
            src = src.index_select(0, self._index(rows.packed_rows, packed.device))
        dst.index_copy_(0, self._index(rows.rows, packed.device), src)

    def finish(self, device: str) -> None:
        # NOTE: this thread's stream only (the kernels ran there), not the whole device: a
        # loader thread must not wait for the model's own work
        self._torch.cuda.current_stream(device).synchronize()


_KERNELS: dict[str, _RowKernel] = {"emu": _EmulatedKernel()}
_kernels_lock = threading.Lock()


def _kernel(kind: str) -> _RowKernel | None:
    """The row kernel of a device kind, or None (copies only)."""
    found = _KERNELS.get(kind)
    if found is None and kind == "cuda":
        with _kernels_lock:
            try:
                found = _KERNELS.setdefault("cuda", _TorchKernel())
            except ImportError:  # NOTE: raw pointers without torch: copies only
                return None
    return found


# -- the calls ------------------------------------------------------------------------------


def gather(dst: DeviceRange, srcs: Sequence[DeviceRange]) -> None:
    """Copy `srcs` back to back into `dst` (see the module for how few operations).

    Args:
        dst: the packed range; its length is the sum of the sources'.
        srcs: device ranges of dst's kind (any device of it; other devices are plain copies).
    Raises:
        InvalidBufferError: the lengths do not add up, or a range of another kind of device.
        DeviceError: the driver failed.
    """
    _move(dst, srcs, _back_to_back(dst, srcs), gathering=True)


def scatter(src: DeviceRange, dsts: Sequence[DeviceRange]) -> None:
    """Fill `dsts` from `src`'s consecutive bytes, in order (the inverse of `gather`). Raises
    as `gather`. Destinations that overlap one another get one of their writers' bytes."""
    _move(src, dsts, _back_to_back(src, dsts), gathering=False)


def scatter_at(src: DeviceRange, pieces: Sequence[tuple[int, DeviceRange]]) -> None:
    """Fill each piece's range from `src` at its offset (`scatter` with gaps: what a batch
    of reads of which some failed delivers). Raises InvalidBufferError for a piece outside
    `src`; as `gather`."""
    for offset, memory in pieces:
        src.sub(offset, memory.length)  # NOTE: raises when outside
    _move(src, [m for _, m in pieces], [o for o, _ in pieces], gathering=False)


def _back_to_back(packed: DeviceRange, ranges: Sequence[DeviceRange]) -> list[int]:
    """The offsets of `ranges` packed in order. Raises InvalidBufferError unless they fill `packed`."""
    offsets, total = [], 0
    for memory in ranges:
        offsets.append(total)
        total += memory.length
    if total != packed.length:
        raise InvalidBufferError(f"{len(ranges)} device ranges of {total} bytes packed into {packed.length}")
    return offsets


def _move(packed: DeviceRange, ranges: Sequence[DeviceRange], offsets: Sequence[int], gathering: bool) -> None:
    if any(memory.kind != packed.kind for memory in ranges):
        raise InvalidBufferError(f"cannot pack ranges of another kind of device than {packed.device}")
    be = backend(packed.device)
    kernel = _kernel(packed.kind)
    plan = _plan(packed, ranges, offsets, kernel is not None)
    for offset, memory in plan.copies:
        if gathering:
            be.copy(packed.sub(offset, memory.length), memory)
        else:
            be.copy(memory, packed.sub(offset, memory.length))
    if plan.rows:
        assert kernel is not None
        for rows in plan.rows:
            (kernel.gather if gathering else kernel.scatter)(packed, rows)
        kernel.finish(packed.device)


@contextlib.contextmanager
def device_scratch(device: str, nbytes: int) -> Iterator[DeviceRange]:
    """`nbytes` of temporary memory on `device`, freed when the block ends.

    Raises:
        ConfigError: a kind of device without an allocator here.
        InvalidBufferError: nbytes <= 0.
    """
    if nbytes <= 0:
        raise InvalidBufferError(f"cannot allocate {nbytes} bytes")
    kind, _, index = device.partition(":")
    if kind == "emu":
        with EmulatedDevice(int(index or 0)).alloc(nbytes) as memory:
            yield memory.range
    elif kind == "cuda":
        import torch

        tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        yield DeviceRange(device, int(tensor.data_ptr()), nbytes)
        del tensor
    else:
        raise ConfigError(f"no scratch allocator for {device!r} (known: emu, cuda)")


# -- host staging ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HostBuffer:
    """Host memory lent to `HostStaging`: `view` (writable, C-contiguous) and how to free it."""

    view: memoryview
    release: Callable[[], None]


def anonymous_buffer(nbytes: int) -> HostBuffer:
    """Private anonymous host memory (the default allocator of `HostStaging`)."""
    mm = mmap.mmap(-1, nbytes)
    view = memoryview(mm)

    def release() -> None:
        view.release()
        with contextlib.suppress(BufferError):  # NOTE: a borrower still holds a slice: freed with it
            mm.close()

    return HostBuffer(view, release)


@dataclass(slots=True)
class _Staged:
    buffer: HostBuffer
    unpins: dict[str, Callable[[], None]] = field(default_factory=dict)  # by device kind
    busy: bool = False

    def free(self) -> None:
        for unpin in self.unpins.values():
            try:
                unpin()
            except DeviceError as exc:
                logger.warning("unpinning a staging buffer: %s", exc)
        self.buffer.release()


MIN_STAGING_BYTES = 1 << 20


class HostStaging:
    """Up to `max_buffers` host buffers lent one per caller at a time (`borrow`), pinned for
    the devices they are borrowed for. A borrower that needs more than a free buffer holds gets
    it replaced by a larger one (powers of two, at least 1 MiB); when every buffer is lent, a
    borrower waits. Thread-safe; `close()` frees them (those lent, when given back)."""

    def __init__(self, allocate: Callable[[int], HostBuffer] = anonymous_buffer, max_buffers: int = 2) -> None:
        if max_buffers < 1:
            raise ConfigError(f"max_buffers must be >= 1, got {max_buffers}")
        self._allocate = allocate
        self._max_buffers = max_buffers
        self._buffers: list[_Staged] = []
        self._ready = threading.Condition()
        self._closed = False

    @contextlib.contextmanager
    def borrow(self, nbytes: int, device: str) -> Iterator[memoryview]:
        """A host view of `nbytes` (the first bytes of a buffer), pinned for `device`'s
        backend (a pin failure is logged: pinning is a speed-up), lent until the block ends.
        Raises ClosedError after `close`, and what the allocator raises."""
        staged = self._take(nbytes)
        try:
            self._pin(staged, device)
            yield staged.buffer.view[:nbytes]
        finally:
            with self._ready:
                staged.busy = False
                if self._closed:
                    self._buffers.remove(staged)
                    staged.free()
                self._ready.notify()

    def _take(self, nbytes: int) -> _Staged:
        with self._ready:
            while True:
                if self._closed:
                    raise ClosedError("the host staging is closed")
                free = [s for s in self._buffers if not s.busy]
                fits = [s for s in free if len(s.buffer.view) >= nbytes]
                if fits:
                    staged = min(fits, key=lambda s: len(s.buffer.view))
                    staged.busy = True
                    return staged
                if free or len(self._buffers) < self._max_buffers:
                    if free:  # NOTE: too small: replaced by a larger one
                        self._buffers.remove(free[0])
                        free[0].free()
                    size = max(MIN_STAGING_BYTES, 1 << (nbytes - 1).bit_length())
                    staged = _Staged(self._allocate(size), busy=True)
                    self._buffers.append(staged)
                    return staged
                self._ready.wait()

    @staticmethod
    def _pin(staged: _Staged, device: str) -> None:
        kind = device.partition(":")[0]
        if kind in staged.unpins:
            return
        staged.unpins[kind] = pin_or_warn(device, staged.buffer.view, "host staging")

    @property
    def num_bytes(self) -> int:
        """Host bytes held now."""
        with self._ready:
            return sum(len(s.buffer.view) for s in self._buffers)

    def close(self) -> None:
        """Free every buffer (a lent one when it is given back). Mutates."""
        with self._ready:
            self._closed = True
            for staged in [s for s in self._buffers if not s.busy]:
                self._buffers.remove(staged)
                staged.free()
            self._ready.notify_all()


def _nothing() -> None:
    return None
