"""An emulated device ("emu:N") for hosts without a GPU: CI runs every device code path on it.

Its memory is a shared-memory file mapped in the allocating process (so other processes on the
host can open an export of it, as CUDA IPC allows), but tsukimi treats it exactly as GPU memory:
nothing addresses it as host memory; every byte moves through this backend's copies, which are
counted (`EmulatedBackend.stats`) so tests can prove the device path ran. The allocation API
stands in for `torch.empty(..., device="cuda")`:

    with EmulatedDevice(0).alloc(1 << 20) as memory:   # memory.range: a DeviceRange on "emu:0"
        engine.register(memory)                        # as a CUDA tensor would be
        memory.write(0, b"...") / memory.read(0, n)    # the test's own host<->device copies

Files are named `tsukimi-emu-<pid>-<hex>` under the shm directory; those of dead processes are
reaped when a device is created.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import mmap
import os
import re
import secrets
import struct
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from tsukimi.device.base import DeviceRange, OpenedRange, host_address
from tsukimi.errors import InvalidBufferError
from tsukimi.owners import reap_dead_owners

_MAGIC = b"TEMU"
_HEADER = struct.Struct("<4sIIQ")  # magic, pid, device index, offset; then the file name
_NAME_RE = re.compile(r"^tsukimi-emu-(\d+)-[0-9a-f]{16}$")


@dataclass(slots=True)
class _Allocation:
    name: str
    device: str
    address: int
    length: int
    mm: mmap.mmap


@dataclass(slots=True)
class _Opened:
    """Another process's allocation mapped here, and how many opened it."""

    mm: mmap.mmap
    address: int
    users: int = 0


class EmulatedBackend:
    """The emulated devices of this process. Thread-safe."""

    kind = "emu"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bases: list[int] = []
        self._allocations: list[_Allocation] = []  # sorted by address, as _bases
        self._by_name: dict[str, _Allocation] = {}
        self._opened: dict[str, _Opened] = {}  # by file name
        self.stats: Counter[str] = Counter()  # "to_host", "from_host", "copy" (+ "_bytes")

    def available(self) -> bool:
        return True

    # -- allocations (EmulatedDevice) ------------------------------------------------------

    def _add(self, allocation: _Allocation) -> None:
        with self._lock:
            i = bisect.bisect_left(self._bases, allocation.address)
            self._bases.insert(i, allocation.address)
            self._allocations.insert(i, allocation)
            self._by_name[allocation.name] = allocation

    def _remove(self, allocation: _Allocation) -> None:
        with self._lock:
            i = self._allocations.index(allocation)
            del self._bases[i], self._allocations[i]
            del self._by_name[allocation.name]

    # -- the backend -----------------------------------------------------------------------

    def locate(self, address: int, length: int) -> DeviceRange | None:
        with self._lock:
            i = bisect.bisect_right(self._bases, address) - 1
            if i < 0:
                return None
            found = self._allocations[i]
        if address >= found.address + found.length:
            return None
        if address + length > found.address + found.length:
            raise InvalidBufferError(f"device range {address:#x}+{length} runs past its allocation")
        return DeviceRange(found.device, address, length)

    def to_host(self, src: DeviceRange, dst: memoryview) -> None:
        _same_length(src, dst)
        ctypes.memmove(host_address(dst), src.address, src.length)
        self._count("to_host", src.length)

    def from_host(self, dst: DeviceRange, src: memoryview) -> None:
        _same_length(dst, src)
        ctypes.memmove(dst.address, host_address(src), dst.length)
        self._count("from_host", dst.length)

    def copy(self, dst: DeviceRange, src: DeviceRange) -> None:
        if dst.length != src.length:
            raise InvalidBufferError(f"device copy of {src.length} bytes into {dst.length}")
        ctypes.memmove(dst.address, src.address, src.length)
        self._count("copy", src.length)

    def _count(self, what: str, nbytes: int) -> None:
        with self._lock:
            self.stats[what] += 1
            self.stats[f"{what}_bytes"] += nbytes

    def export(self, memory: DeviceRange) -> bytes:
        with self._lock:
            i = bisect.bisect_right(self._bases, memory.address) - 1
            found = self._allocations[i] if i >= 0 else None
        if found is None or memory.address + memory.length > found.address + found.length:
            raise InvalidBufferError(f"{memory.device} range {memory.address:#x} is not emulated device memory")
        header = _HEADER.pack(_MAGIC, os.getpid(), memory.index, memory.address - found.address)
        return header + found.name.encode()

    def open(self, exported: bytes, length: int) -> OpenedRange:
        if len(exported) <= _HEADER.size or exported[:4] != _MAGIC:
            raise InvalidBufferError("not an emulated-device export")
        _, pid, index, offset = _HEADER.unpack_from(exported)
        name = exported[_HEADER.size :].decode(errors="replace")
        if not _NAME_RE.match(name):
            raise InvalidBufferError(f"refusing to open {name!r}: not an emulated-device file")
        device = f"emu:{index}"
        if pid == os.getpid():
            with self._lock:
                own = self._by_name.get(name)
            if own is None or offset + length > own.length:
                raise InvalidBufferError(f"{name} is not (or no longer) allocated here")
            return OpenedRange(device, own.address + offset, length, _nothing)
        with self._lock:
            found = self._opened.get(name)
            if found is None:
                mm = _map(os.path.join(_shm_dir(), name))
                found = self._opened[name] = _Opened(mm, _mapping_address(mm))
            if length <= 0 or offset + length > len(found.mm):
                raise InvalidBufferError(f"[{offset}, {offset}+{length}) is outside {name}")
            found.users += 1
        return OpenedRange(device, found.address + offset, length, lambda: self._release(name))

    def _release(self, name: str) -> None:
        with self._lock:
            found = self._opened.get(name)
            if found is None:
                return
            found.users -= 1
            if found.users > 0:
                return
            del self._opened[name]
        with contextlib.suppress(BufferError):
            found.mm.close()

    def pin(self, view: memoryview) -> Callable[[], None]:
        return _nothing  # NOTE: no DMA engine to pin for


EMULATED = EmulatedBackend()


class EmulatedMemory:
    """One allocation on an emulated device. Close it (or use it as a context manager)."""

    def __init__(self, allocation: _Allocation) -> None:
        self._allocation = allocation
        self.range = DeviceRange(allocation.device, allocation.address, allocation.length)
        self._closed = False

    @property
    def device(self) -> str:
        return self.range.device

    def __len__(self) -> int:
        return self.range.length

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Copy host bytes in at `offset` (the test's own host->device copy)."""
        view = memoryview(data).cast("B")
        EMULATED.from_host(self.range.sub(offset, len(view)), view)

    def read(self, offset: int, length: int) -> bytes:
        """Copy `length` bytes out from `offset` (the test's own device->host copy)."""
        out = bytearray(length)
        EMULATED.to_host(self.range.sub(offset, length), memoryview(out))
        return bytes(out)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        EMULATED._remove(self._allocation)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(_shm_dir(), self._allocation.name))
        with contextlib.suppress(BufferError):
            self._allocation.mm.close()

    def __enter__(self) -> EmulatedMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EmulatedDevice:
    """Allocates memory on emulated device `index` (in the shm directory: TSUKIMI_EMU_SHM_DIR,
    default /dev/shm)."""

    def __init__(self, index: int = 0) -> None:
        if index < 0:
            raise InvalidBufferError(f"a device index is >= 0, got {index}")
        self.name = f"emu:{index}"
        _reap(_shm_dir())

    def alloc(self, nbytes: int) -> EmulatedMemory:
        """`nbytes` of zeroed device memory. Raises InvalidBufferError when nbytes <= 0."""
        if nbytes <= 0:
            raise InvalidBufferError(f"cannot allocate {nbytes} bytes")
        name = f"tsukimi-emu-{os.getpid()}-{secrets.token_hex(8)}"
        path = os.path.join(_shm_dir(), name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        allocation = _Allocation(name, self.name, _mapping_address(mm), nbytes, mm)
        EMULATED._add(allocation)
        return EmulatedMemory(allocation)


def _shm_dir() -> str:
    return os.environ.get("TSUKIMI_EMU_SHM_DIR", "/dev/shm")


def _map(path: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _mapping_address(mm: mmap.mmap) -> int:
    # NOTE: the address of an mmap without holding an export of it (so it can still be closed)
    probe = ctypes.c_char.from_buffer(mm)
    address = ctypes.addressof(probe)
    del probe
    return address


def _reap(shm_dir: str) -> None:
    """Unlink emulated-device files whose process is gone."""
    reap_dead_owners(shm_dir, _NAME_RE)


def _same_length(memory: DeviceRange, view: memoryview) -> None:
    if memory.length != len(view):
        raise InvalidBufferError(f"copy between {memory.length} device bytes and {len(view)} host bytes")


def _nothing() -> None:
    return None
