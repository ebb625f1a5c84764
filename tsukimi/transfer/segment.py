"""Segments: the memory a Transfer Engine registers, and the descriptor peers see of it.

A segment's address space is the owner's virtual address space (as in Mooncake): a buffer
registered at address A of length L covers remote offsets [A, A + L). Buffers never overlap,
and a request must fall inside exactly one buffer.

`LocalSegment` is the owner's registry; lookups (`resolve`) are lock-free reads of an
immutable snapshot, registration copies the snapshot under a lock.
"""

from __future__ import annotations

import bisect
import ctypes
import ipaddress
import itertools
import os
import re
import socket
import threading
from dataclasses import dataclass
from typing import Protocol, cast

import msgspec
import numpy as np

from tsukimi.device import DeviceRange
from tsukimi.errors import InvalidBufferError, OutOfBounds


class Endpoint(msgspec.Struct, frozen=True):
    """A TCP address where the segment's server listens."""

    host: str
    port: int


class BufferDescriptor(msgspec.Struct, frozen=True):
    """One registered buffer as peers see it. `shm_name` is set when it lives in shared
    memory (a file under the owner's shm directory, at `shm_offset`). `device` is set
    ("cuda:0") when it is device memory; `device_export` then carries what a process on the
    owner's host needs to open it (the backend's `export`; empty when it cannot be exported,
    e.g. CUDA memory without an IPC handle: peers then reach it over tcp)."""

    base: int
    length: int
    shm_name: str = ""
    shm_offset: int = 0
    device: str = ""
    device_export: bytes = b""


class SegmentDescriptor(msgspec.Struct, frozen=True):
    """What a segment owner publishes: who it is, where to reach it, what it registered."""

    name: str
    host_id: str
    pid: int
    version: int
    endpoints: list[Endpoint]
    buffers: list[BufferDescriptor]
    pid_start: int = 0  # the owner's start time (clock ticks after boot): pid + boot + this = one process
    version_address: int = 0  # where the owner keeps `version` live (a uint64 same-host peers may read)
    transport_info: dict[str, bytes] = {}  # what a transport publishes for peers (e.g. NIXL's agent metadata)

    def find(self, offset: int, length: int) -> BufferDescriptor | None:
        """The buffer that wholly contains [offset, offset + length), if any (O(log n):
        `buffers` is sorted by base, which `decode_descriptor` guarantees)."""
        i = bisect.bisect_right(self.buffers, offset, key=_base) - 1
        if i >= 0:
            buf = self.buffers[i]
            if offset + length <= buf.base + buf.length:
                return buf
        return None


def _base(buf: BufferDescriptor) -> int:
    return buf.base


_descriptor_decoder = msgspec.json.Decoder(SegmentDescriptor)
HOST_TYPES = frozenset({bytes, bytearray, memoryview, np.ndarray})
"""Buffer classes that are never device memory: `host_view` takes them with no device lookup."""
_DEVICE_RE = re.compile(r"^[a-z][a-z0-9_]{0,15}:[0-9]{1,4}$")
MAX_EXPORT_BYTES = 1024


def encode_descriptor(desc: SegmentDescriptor) -> bytes:
    return msgspec.json.encode(desc)


def decode_descriptor(data: bytes | memoryview) -> SegmentDescriptor:
    """Decode a peer's descriptor; its buffers come back sorted by base.

    Raises msgspec.ValidationError / DecodeError on malformed input, including buffers that
    are empty, negative or overlapping, and strings that are not UTF-8.
    """
    try:
        desc = _descriptor_decoder.decode(data)
    except (UnicodeDecodeError, RecursionError) as exc:
        # NOTE: msgspec raises these itself (invalid UTF-8 in a string, deep nesting); callers
        # catch msgspec's errors only (found by tests/fuzz: it killed a server thread).
        raise msgspec.DecodeError(f"malformed descriptor: {exc}") from exc
    for endpoint in desc.endpoints:
        if not 0 < endpoint.port < 65536 or not _valid_host(endpoint.host):
            raise msgspec.ValidationError(f"bad endpoint {endpoint.host!r}:{endpoint.port}")
    buffers = sorted(desc.buffers, key=_base)
    for prev, buf in zip([None, *buffers], buffers, strict=False):
        bad = buf.base < 0 or buf.length <= 0 or buf.base + buf.length >= 1 << 64 or buf.shm_offset < 0
        if bad or (prev is not None and prev.base + prev.length > buf.base):
            raise msgspec.ValidationError(f"buffer at {buf.base:#x}+{buf.length} is empty, out of range or overlaps")
        if buf.device or buf.device_export:
            _check_device(buf)
    return desc if buffers == desc.buffers else msgspec.structs.replace(desc, buffers=buffers)


def _check_device(buf: BufferDescriptor) -> None:
    """A device buffer names its device as KIND:INDEX, lives in no shm file, and its export
    is bounded. Raises msgspec.ValidationError."""
    if not _DEVICE_RE.match(buf.device):
        raise msgspec.ValidationError(f"buffer at {buf.base:#x} names a bad device {buf.device!r}")
    if buf.shm_name or len(buf.device_export) > MAX_EXPORT_BYTES:
        raise msgspec.ValidationError(f"device buffer at {buf.base:#x} has a shm file or an oversized export")


def _valid_host(host: str) -> bool:
    """An IP address or a DNS name whose labels fit (an over-long label made connect() raise
    UnicodeError inside a transport thread)."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    labels = host.split(".")
    return 0 < len(host) <= 253 and all(0 < len(label) <= 63 and label.isascii() for label in labels)


HOST_ID_ENV = "TSUKIMI_HOST_ID"


def host_id() -> str:
    """Identity of this host (hostname + kernel boot id): equal ids can share memory. The
    environment variable TSUKIMI_HOST_ID, when set and not empty, replaces it: the lab
    (tsukimi/lab/lab.py) gives each emulated host its own, so that processes in two network
    namespaces of one machine use tcp between them, never shm, CMA or device IPC."""
    override = os.environ.get(HOST_ID_ENV, "")
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown"
    return f"{socket.gethostname()}/{boot}"


def process_start_time(pid: int) -> int:
    """When process `pid` started, in clock ticks after boot (0 when unknown): with the boot id
    of `host_id`, a pid and its start time name one process, whatever pid reuse does.

    Raises:
        ProcessLookupError: no such process.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        raise ProcessLookupError(f"no process {pid}") from None
    except OSError:
        return 0
    # NOTE: field 2 (the command) may hold spaces and parentheses: split after the last ")"
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[19]) if len(fields) > 19 else 0


def byte_view(obj: object, writable: bool = True, with_address: bool = True) -> tuple[memoryview, int]:
    """A flat byte memoryview over `obj` and its address (0 unless `with_address`).

    Accepts bytes-like objects (bytearray, mmap, memoryview, numpy arrays), torch CPU
    tensors, `RegisteredBuffer`s (what `TransferEngine.allocate` returns), and
    `(address, length)` tuples (the caller keeps that memory alive).

    Raises:
        InvalidBufferError: not a buffer, not C-contiguous, empty, or read-only when
            `writable` is required.
    """
    if isinstance(obj, tuple):
        if len(obj) != 2 or not all(isinstance(v, int) for v in obj) or obj[0] <= 0 or obj[1] <= 0:
            raise InvalidBufferError("an address buffer must be (address > 0, length > 0)")
        array = (ctypes.c_ubyte * obj[1]).from_address(obj[0])
        return memoryview(array).cast("B"), obj[0]
    if isinstance(obj, RegisteredBuffer):
        return obj.view, obj.base if with_address else 0
    if hasattr(obj, "data_ptr") and hasattr(obj, "untyped_storage"):  # a torch tensor
        return _tensor_view(obj)
    view = host_view(obj, writable)
    if not with_address:  # NOTE: the per-request path only needs the view
        return view, 0
    return view, int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def host_view(obj: object, writable: bool = True) -> memoryview:
    """A flat byte memoryview over a bytes-like object (bytearray, memoryview, mmap, numpy
    array): `byte_view` without its other kinds of buffer, for callers that know the class.

    Raises:
        InvalidBufferError: not a buffer, not C-contiguous, empty, or read-only when
            `writable` is required.
    """
    try:
        view = memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidBufferError(f"cannot use a {type(obj).__name__} as a buffer") from None
    if not view.c_contiguous:
        raise InvalidBufferError("buffer must be C-contiguous")
    if writable and view.readonly:
        raise InvalidBufferError("buffer must be writable")
    if view.nbytes == 0:
        raise InvalidBufferError("buffer must not be empty")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def view_address(view: memoryview) -> int:
    """Where the bytes of a flat byte view start in this process's memory."""
    if view.readonly:  # NOTE: ctypes maps only writable buffers; numpy reads any (slower)
        return int(np.frombuffer(view, np.uint8).ctypes.data)
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class _Device(Protocol):
    type: str


class _TensorLike(Protocol):
    """The part of torch.Tensor we use (duck-typed: torch is not imported here)."""

    device: _Device

    def is_contiguous(self) -> bool: ...
    def numel(self) -> int: ...
    def element_size(self) -> int: ...
    def data_ptr(self) -> int: ...


def _tensor_view(tensor: object) -> tuple[memoryview, int]:
    t = cast(_TensorLike, tensor)
    if t.device.type != "cpu":
        raise InvalidBufferError(f"a {t.device.type} tensor is device memory: the host cannot address it")
    if not t.is_contiguous():
        raise InvalidBufferError("tensor must be contiguous")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        raise InvalidBufferError("tensor must not be empty")
    address = int(t.data_ptr())
    array = (ctypes.c_ubyte * nbytes).from_address(address)
    return memoryview(array).cast("B"), address


NO_VIEW = memoryview(b"")  # the `view` of device memory: the host cannot address it


@dataclass(frozen=True, slots=True)
class RegisteredBuffer:
    """A buffer in a local segment. `owner` keeps the registered object alive. Device memory
    has `device` (its range) and an empty `view`; `device_export` is what peers on this host
    open it by (empty: it cannot be exported)."""

    base: int
    length: int
    view: memoryview
    owner: object
    shm_name: str = ""
    shm_offset: int = 0
    device: DeviceRange | None = None
    device_export: bytes = b""

    def describe(self) -> BufferDescriptor:
        if self.device is not None:
            return BufferDescriptor(self.base, self.length, device=self.device.device, device_export=self.device_export)
        return BufferDescriptor(self.base, self.length, self.shm_name, self.shm_offset)


class LocalSegment:
    """The buffers this process registered, found by offset. Thread-safe."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pid = os.getpid()
        self.version = 0
        # NOTE: the version, also in memory that same-host peers read directly (the cma
        # transport): they see a registration change before they touch a released range
        self._version_word = ctypes.c_uint64(0)
        self.version_address = ctypes.addressof(self._version_word)
        self._lock = threading.Lock()
        # NOTE: one tuple swapped atomically, so lock-free readers see a consistent pair.
        self._snapshot: tuple[list[int], list[RegisteredBuffer]] = ([], [])
        self.num_device = 0  # device buffers registered (requests look for local ones only then)

    def add(self, view: memoryview, base: int, owner: object, shm_name: str = "") -> RegisteredBuffer:
        """Register `view` at `base` (mutates). Raises InvalidBufferError when it overlaps."""
        return self._insert(RegisteredBuffer(base, len(view), view, owner, shm_name))

    def add_device(self, memory: DeviceRange, owner: object, export: bytes = b"") -> RegisteredBuffer:
        """Register device memory at its address (mutates). Raises InvalidBufferError when it
        overlaps."""
        return self._insert(
            RegisteredBuffer(memory.address, memory.length, NO_VIEW, owner, device=memory, device_export=export)
        )

    def _insert(self, buf: RegisteredBuffer) -> RegisteredBuffer:
        base = buf.base
        with self._lock:
            bases, buffers = self._snapshot
            i = bisect.bisect_left(bases, base)
            prev_end = buffers[i - 1].base + buffers[i - 1].length if i else 0
            next_base = bases[i] if i < len(bases) else 1 << 64
            if prev_end > base or base + buf.length > next_base:
                raise InvalidBufferError(f"buffer at {base:#x}+{buf.length} overlaps a registered one")
            self._snapshot = ([*bases[:i], base, *bases[i:]], [*buffers[:i], buf, *buffers[i:]])
            self.num_device += buf.device is not None
            self._bump()
        return buf

    def remove(self, base: int) -> RegisteredBuffer:
        """Unregister the buffer starting at `base` (mutates). Raises OutOfBounds if none."""
        with self._lock:
            bases, buffers = self._snapshot
            i = bisect.bisect_left(bases, base)
            if i == len(bases) or bases[i] != base:
                raise OutOfBounds(f"no buffer registered at {base:#x}")
            buf = buffers[i]
            self._snapshot = (bases[:i] + bases[i + 1 :], buffers[:i] + buffers[i + 1 :])
            self.num_device -= buf.device is not None
            self._bump()
        return buf

    def _bump(self) -> None:
        """A registration changed (caller holds the lock)."""
        self.version += 1
        self._version_word.value = self.version

    def resolve(self, offset: int, length: int) -> memoryview:
        """The registered host bytes [offset, offset + length); never mutates.

        Raises:
            OutOfBounds: the range is empty or not inside one registered buffer.
            InvalidBufferError: it is device memory (the host cannot address it).
        """
        found = self.resolve_any(offset, length)
        if isinstance(found, DeviceRange):
            raise InvalidBufferError(
                f"[{offset:#x}, +{length}) is device memory on {found.device}: the host cannot address it"
            )
        return found

    def resolve_any(self, offset: int, length: int) -> memoryview | DeviceRange:
        """The registered bytes [offset, offset + length): a view of host memory, or the
        device range (what the segment server serves); never mutates.

        Raises:
            OutOfBounds: the range is empty or not inside one registered buffer.
        """
        bases, buffers = self._snapshot
        i = bisect.bisect_right(bases, offset) - 1
        if length <= 0 or i < 0 or offset + length > buffers[i].base + buffers[i].length:
            raise OutOfBounds(
                f"[{offset:#x}, {offset:#x}+{length}) is not inside a registered buffer of segment {self.name}"
            )
        buf = buffers[i]
        start = offset - buf.base
        if buf.device is not None:
            return buf.device.sub(start, length)
        return buf.view[start : start + length]

    def device_at(self, address: int, length: int) -> DeviceRange | None:
        """The registered device range [address, address + length), or None when it is not
        inside one registered device buffer (host memory, as far as this segment knows)."""
        if not self.num_device:
            return None
        bases, buffers = self._snapshot
        i = bisect.bisect_right(bases, address) - 1
        memory = buffers[i].device if i >= 0 else None
        if memory is None or length <= 0 or address + length > memory.address + memory.length:
            return None
        return memory.sub(address - memory.address, length)

    def buffers(self) -> list[RegisteredBuffer]:
        return list(self._snapshot[1])

    def check_invariants(self) -> None:
        """Bases sorted and matching the buffers; buffers non-empty and disjoint."""
        bases, buffers = self._snapshot
        assert bases == [b.base for b in buffers]
        assert all(b.length > 0 and len(b.view) == (b.length if b.device is None else 0) for b in buffers)
        assert all(b.device is None or (b.device.address, b.device.length) == (b.base, b.length) for b in buffers)
        assert self.num_device == sum(b.device is not None for b in buffers)
        assert all(a.base + a.length <= b.base for a, b in itertools.pairwise(buffers))
