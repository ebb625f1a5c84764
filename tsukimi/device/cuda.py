"""NVIDIA GPUs through the CUDA driver API (libcuda.so.1, loaded with ctypes).

No torch, cupy or CUDA toolkit is needed: the driver library ships with the GPU driver, and a
host without one simply has no CUDA devices (`available()` is False; nothing here is loaded on
a CPU-only host until something asks). So memory from torch, cupy or any other allocator is
handled the same way, as device pointers.

- Copies: `cuMemcpyAsync` (unified addressing: host<->device and device<->device, pinned or
  pageable host memory) on a non-blocking stream of the calling thread, then a wait for that
  stream; ctypes releases the GIL during both, so threads copy concurrently. Copies from/to
  pinned (page-locked) host memory run at DMA speed; pageable memory is staged by the driver.
- IPC: `cuIpcGetMemHandle` names the cudaMalloc allocation holding a range; the export carries
  the offset inside it, the exporter's pid and the allocation's address there (a range this
  process exported is used by that address: a process cannot open its own handle) and the
  allocation's size. Opened handles are shared and counted per process, closed with the last
  user. Memory from the virtual-memory API (torch's
  `expandable_segments`) has no IPC handle: exporting it raises DeviceError.
- Pinning: `cuMemHostRegister` (portable) in place, e.g. a shared-memory segment, so copies to
  and from it run at DMA speed (GPU.md: 36.5/45 GB/s vs 4.6/10.1 unregistered).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct
import threading
from collections.abc import Callable, Iterator

from tsukimi.device.base import DeviceRange, OpenedRange, host_address
from tsukimi.errors import DeviceError, InvalidBufferError

_MAGIC = b"TCUD"
_EXPORT = struct.Struct("<4sIIQQQ64s")  # magic, pid, device ordinal, allocation base, offset, size, handle

_ATTR_MEMORY_TYPE = 2  # CU_POINTER_ATTRIBUTE_MEMORY_TYPE
_ATTR_DEVICE_ORDINAL = 9  # CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
_MEMORYTYPE_DEVICE = 2  # CU_MEMORYTYPE_DEVICE
_IPC_LAZY_ENABLE_PEER_ACCESS = 1
_STREAM_NON_BLOCKING = 1
_HOST_REGISTER_PORTABLE = 1
_ERROR_ALREADY_REGISTERED = 712  # CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED


class _IpcHandle(ctypes.Structure):
    # NOTE: unsigned bytes, not c_char: a c_char array reads back cut at its first NUL
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


class _Driver:
    """libcuda's functions this backend calls, each checked (a non-zero CUresult raises)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        u64, p = ctypes.c_uint64, ctypes.c_void_p
        signatures: dict[str, list[type]] = {
            "cuInit": [ctypes.c_uint],
            "cuDeviceGetCount": [ctypes.POINTER(ctypes.c_int)],
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(p), ctypes.c_int],
            "cuCtxSetCurrent": [p],
            "cuCtxGetCurrent": [ctypes.POINTER(p)],
            "cuStreamCreate": [ctypes.POINTER(p), ctypes.c_uint],
            "cuStreamSynchronize": [p],
            "cuMemcpyAsync": [u64, u64, ctypes.c_size_t, p],
            "cuPointerGetAttribute": [p, ctypes.c_int, u64],
            "cuMemGetAddressRange_v2": [ctypes.POINTER(u64), ctypes.POINTER(ctypes.c_size_t), u64],
            "cuIpcGetMemHandle": [ctypes.POINTER(_IpcHandle), u64],
            "cuIpcOpenMemHandle_v2": [ctypes.POINTER(u64), _IpcHandle, ctypes.c_uint],
            "cuIpcCloseMemHandle": [u64],
            "cuMemHostRegister_v2": [p, ctypes.c_size_t, ctypes.c_uint],
            "cuMemHostUnregister": [p],
            "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
        }
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int

    def result(self, name: str, *args: object) -> int:
        """Call `name`; its CUresult (0: success)."""
        return int(getattr(self.lib, name)(*args))

    def call(self, name: str, *args: object) -> None:
        """Call `name`. Raises DeviceError with the driver's error name on failure."""
        code = self.result(name, *args)
        if code:
            raise DeviceError(f"{name} failed: {self.error_name(code)}")

    def error_name(self, code: int) -> str:
        text = ctypes.c_char_p()
        if self.lib.cuGetErrorName(code, ctypes.byref(text)) or not text.value:
            return f"CUresult {code}"
        return text.value.decode()


class CudaBackend:
    """CUDA devices ("cuda:N"). Thread-safe; the driver is loaded on first use."""

    kind = "cuda"

    def __init__(self, library: str = "libcuda.so.1") -> None:
        self._library = library  # NOTE: tests load a stand-in driver (tests/device/fake_cuda)
        self._lock = threading.Lock()
        self._driver: _Driver | None = None
        self._count = -1  # devices seen by the driver; -1: not probed yet
        self._contexts: dict[int, int] = {}
        self._local = threading.local()  # per thread: {ordinal: stream}
        self._opened: dict[bytes, list[int]] = {}  # export -> [address, users]

    # -- the driver ------------------------------------------------------------------------

    def available(self) -> bool:
        if self._count < 0:
            with self._lock:
                if self._count < 0:
                    self._count = self._probe()
        return self._count > 0

    def _probe(self) -> int:
        """Load libcuda and count devices (0 when there is no driver or no device)."""
        try:
            lib = ctypes.CDLL(self._library)
        except OSError:
            return 0
        try:
            driver = _Driver(lib)
        except AttributeError:  # a driver too old for the functions used here
            return 0
        count = ctypes.c_int(0)
        if driver.result("cuInit", 0) or driver.result("cuDeviceGetCount", ctypes.byref(count)):
            return 0
        self._driver = driver
        return count.value

    @contextlib.contextmanager
    def _on(self, ordinal: int) -> Iterator[_Driver]:
        """The driver, with device `ordinal`'s primary context current on this thread while the
        block runs; the thread's own current context (torch's, cupy's) is put back after it, so
        a library working on another device here is never redirected.
        Raises DeviceError when there is no such device."""
        if not self.available() or self._driver is None:
            raise DeviceError("no CUDA device: the CUDA driver (libcuda.so.1) or a GPU is missing")
        driver = self._driver
        if not 0 <= ordinal < self._count:
            raise DeviceError(f"no device cuda:{ordinal} (this host has {self._count})")
        context = self._contexts.get(ordinal)
        if context is None:
            with self._lock:
                context = self._contexts.get(ordinal)
                if context is None:
                    device, ctx = ctypes.c_int(0), ctypes.c_void_p()
                    driver.call("cuDeviceGet", ctypes.byref(device), ordinal)
                    driver.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), device.value)
                    context = self._contexts[ordinal] = int(ctx.value or 0)
        previous = ctypes.c_void_p()
        driver.call("cuCtxGetCurrent", ctypes.byref(previous))
        switch = int(previous.value or 0) != context
        if switch:
            driver.call("cuCtxSetCurrent", ctypes.c_void_p(context))
        try:
            yield driver
        finally:
            if switch:
                driver.call("cuCtxSetCurrent", previous)

    def _stream(self, driver: _Driver, ordinal: int) -> ctypes.c_void_p:
        streams: dict[int, ctypes.c_void_p] | None = getattr(self._local, "streams", None)
        if streams is None:
            streams = self._local.streams = {}
        stream = streams.get(ordinal)
        if stream is None:
            stream = ctypes.c_void_p()
            driver.call("cuStreamCreate", ctypes.byref(stream), _STREAM_NON_BLOCKING)
            streams[ordinal] = stream
        return stream

    def _copy(self, ordinal: int, dst: int, src: int, length: int) -> None:
        with self._on(ordinal) as driver:
            stream = self._stream(driver, ordinal)
            driver.call("cuMemcpyAsync", dst, src, length, stream)
            driver.call("cuStreamSynchronize", stream)

    # -- the backend -----------------------------------------------------------------------

    def locate(self, address: int, length: int) -> DeviceRange | None:
        if address <= 0 or length <= 0 or not self.available():
            return None
        with self._on(0) as driver:
            kind = ctypes.c_uint(0)
            if driver.result("cuPointerGetAttribute", ctypes.byref(kind), _ATTR_MEMORY_TYPE, address):
                return None  # pageable host memory, or not CUDA's at all
            if kind.value != _MEMORYTYPE_DEVICE:
                return None  # pinned host memory: the host addresses it
            ordinal = ctypes.c_int(0)
            driver.call("cuPointerGetAttribute", ctypes.byref(ordinal), _ATTR_DEVICE_ORDINAL, address)
            base, size = self._allocation(driver, address)
        if address + length > base + size:
            raise InvalidBufferError(f"device range {address:#x}+{length} runs past its allocation ({base:#x}+{size})")
        return DeviceRange(f"cuda:{ordinal.value}", address, length)

    @staticmethod
    def _allocation(driver: _Driver, address: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
        driver.call("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), address)
        return base.value, size.value

    def to_host(self, src: DeviceRange, dst: memoryview) -> None:
        _same_length(src, dst)
        self._copy(src.index, host_address(dst), src.address, src.length)

    def from_host(self, dst: DeviceRange, src: memoryview) -> None:
        _same_length(dst, src)
        self._copy(dst.index, dst.address, host_address(src), dst.length)

    def copy(self, dst: DeviceRange, src: DeviceRange) -> None:
        if dst.length != src.length:
            raise InvalidBufferError(f"device copy of {src.length} bytes into {dst.length}")
        self._copy(dst.index, dst.address, src.address, src.length)

    def export(self, memory: DeviceRange) -> bytes:
        handle = _IpcHandle()
        with self._on(memory.index) as driver:
            base, size = self._allocation(driver, memory.address)
            driver.call("cuIpcGetMemHandle", ctypes.byref(handle), base)
        return _EXPORT.pack(
            _MAGIC, os.getpid(), memory.index, base, memory.address - base, size, bytes(handle.reserved)
        )

    def open(self, exported: bytes, length: int) -> OpenedRange:
        if len(exported) != _EXPORT.size or exported[:4] != _MAGIC:
            raise InvalidBufferError("not a CUDA memory export")
        _, pid, ordinal, base, offset, size, raw = _EXPORT.unpack(exported)
        if length <= 0 or offset + length > size:
            raise InvalidBufferError(f"[{offset}, {offset}+{length}) is outside the exported allocation of {size}")
        device = f"cuda:{ordinal}"
        if pid == os.getpid():  # NOTE: a process cannot open its own handle; the address is ours
            return OpenedRange(device, base + offset, length, _nothing)
        key = bytes(raw)
        # NOTE: the context first: taking it may take the lock itself
        with self._on(ordinal) as driver, self._lock:
            found = self._opened.get(key)
            if found is None:
                address = ctypes.c_uint64(0)
                handle = _IpcHandle()
                ctypes.memmove(ctypes.addressof(handle), raw, ctypes.sizeof(handle))
                driver.call("cuIpcOpenMemHandle_v2", ctypes.byref(address), handle, _IPC_LAZY_ENABLE_PEER_ACCESS)
                found = self._opened[key] = [address.value, 0]
            found[1] += 1
        return OpenedRange(device, found[0] + offset, length, lambda: self._release(key, ordinal))

    def _release(self, key: bytes, ordinal: int) -> None:
        with self._lock:
            found = self._opened.get(key)
            if found is None:
                return
            found[1] -= 1
            if found[1] > 0:
                return
            del self._opened[key]
        with self._on(ordinal) as driver:
            driver.call("cuIpcCloseMemHandle", found[0])

    def pin(self, view: memoryview) -> Callable[[], None]:
        if not self.available() or not len(view):
            return _nothing
        address = ctypes.c_void_p(host_address(view))
        with self._on(0) as driver:
            code = driver.result("cuMemHostRegister_v2", address, len(view), _HOST_REGISTER_PORTABLE)
        if code == _ERROR_ALREADY_REGISTERED:
            return _nothing  # someone pinned it already; they unpin it
        if code:
            raise DeviceError(f"cuMemHostRegister failed: {driver.error_name(code)}")

        def unpin() -> None:
            with self._on(0) as driver:
                driver.call("cuMemHostUnregister", address)

        return unpin


def _same_length(memory: DeviceRange, view: memoryview) -> None:
    if memory.length != len(view):
        raise InvalidBufferError(f"copy between {memory.length} device bytes and {len(view)} host bytes")


def _nothing() -> None:
    return None
