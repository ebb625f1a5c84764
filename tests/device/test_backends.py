"""One conformance suite for every device backend: the emulated one and CUDA's over a stand-in
driver (tests/device/fake_cuda: its ctypes layer, contexts, IPC, pinning) always, CUDA on a GPU
(`pytest -m gpu`). Each test gets fresh device memory of the backend under test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.device.conftest import Alloc
from tsukimi.device import CUDA, EMULATED, DeviceBackend, DeviceRange, EmulatedDevice, backend, locate
from tsukimi.errors import ConfigError, DeviceError, InvalidBufferError


def _pattern(n: int, seed: int = 7) -> bytes:
    return bytes((i * 131 + seed) % 251 for i in range(n))


def test_host_round_trip(any_device: tuple[DeviceBackend, Alloc]) -> None:
    be, alloc = any_device
    memory = alloc(1 << 16)
    data = _pattern(1 << 16)
    be.from_host(memory, memoryview(data))  # a read-only source
    out = bytearray(1 << 16)
    be.to_host(memory, memoryview(out))
    assert out == data


def test_sub_ranges_and_device_copies(any_device: tuple[DeviceBackend, Alloc]) -> None:
    be, alloc = any_device
    a, b = alloc(4096), alloc(4096)
    be.from_host(a.sub(100, 1000), memoryview(_pattern(1000)))
    be.copy(b.sub(2000, 1000), a.sub(100, 1000))
    out = bytearray(1000)
    be.to_host(b.sub(2000, 1000), memoryview(out))
    assert out == _pattern(1000)
    with pytest.raises(InvalidBufferError):
        be.copy(b.sub(0, 10), a.sub(0, 11))
    with pytest.raises(InvalidBufferError):
        be.to_host(a.sub(0, 10), memoryview(bytearray(11)))
    with pytest.raises(InvalidBufferError):
        a.sub(4000, 200)


def test_locate_tells_device_memory_from_host_memory(any_device: tuple[DeviceBackend, Alloc]) -> None:
    be, alloc = any_device
    memory = alloc(8192)
    found = be.locate(memory.address + 10, 100)
    assert found == DeviceRange(memory.device, memory.address + 10, 100)
    assert be.locate(memory.address, 8192) == memory
    if be is not CUDA:  # NOTE: CUDA knows driver allocations: torch's 2 MiB block, not the tensor
        with pytest.raises(InvalidBufferError):
            be.locate(memory.address + 8000, 500)  # runs past the allocation
    if be in (CUDA, EMULATED):  # the registry asks them (not a stand-in driver)
        assert locate(memory.address + 10, 100) == found
    host = bytearray(4096)
    from tsukimi.device.base import host_address

    assert be.locate(host_address(memoryview(host)), 4096) is None
    assert locate(host_address(memoryview(host)), 4096) is None


def test_export_opens_in_this_process(any_device: tuple[DeviceBackend, Alloc]) -> None:
    be, alloc = any_device
    memory = alloc(4096)
    opened = be.open(be.export(memory.sub(512, 1024)), 1024)
    assert opened.address == memory.address + 512 and opened.device == memory.device
    opened.close()
    with pytest.raises(InvalidBufferError):
        be.open(b"not an export", 10)


_CHILD = """
import sys
from tsukimi.device import backend, DeviceRange
from tsukimi.device.cuda import CudaBackend
be = CudaBackend(sys.argv[4]) if sys.argv[4] else backend(sys.argv[1])
opened = be.open(bytes.fromhex(sys.argv[2]), int(sys.argv[3]))
out = bytearray(opened.length)
be.to_host(DeviceRange(opened.device, opened.address, opened.length), memoryview(out))
be.from_host(DeviceRange(opened.device, opened.address, opened.length), memoryview(bytes(reversed(out))))
opened.close()
"""


def test_export_opens_in_another_process(any_device: tuple[DeviceBackend, Alloc]) -> None:
    be, alloc = any_device
    memory = alloc(1 << 20)
    data = _pattern(4096, seed=3)
    part = memory.sub(8192, 4096)
    be.from_host(part, memoryview(data))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    library = getattr(be, "_library", "") if be is not CUDA else ""  # a stand-in driver: the child loads it too
    args = [sys.executable, "-c", _CHILD, be.kind, be.export(part).hex(), "4096", library]
    subprocess.run(args, check=True, timeout=60, env=env)
    out = bytearray(4096)
    be.to_host(part, memoryview(out))
    assert out == bytes(reversed(data))


def test_pin_returns_an_unpin(any_device: tuple[DeviceBackend, Alloc]) -> None:
    be, _ = any_device
    import mmap

    mm = mmap.mmap(-1, 1 << 20)
    unpin = be.pin(memoryview(mm))
    unpin()
    mm.close()


def test_unknown_kinds_and_bad_ranges_are_the_callers_error() -> None:
    with pytest.raises(ConfigError):
        backend("tpu:0")
    with pytest.raises(InvalidBufferError):
        DeviceRange("cuda", 1, 1)
    with pytest.raises(InvalidBufferError):
        DeviceRange("cuda:0", 0, 1)
    with pytest.raises(InvalidBufferError):
        EmulatedDevice(0).alloc(0)


def test_without_a_driver_cuda_is_unavailable_and_says_so() -> None:
    if CUDA.available():
        pytest.skip("this host has a GPU")
    assert locate(0x1000, 10) is None
    with pytest.raises(DeviceError, match="no CUDA device"):
        CUDA.to_host(DeviceRange("cuda:0", 0x1000, 4), memoryview(bytearray(4)))


def test_the_emulated_device_counts_its_copies() -> None:
    before = EMULATED.stats["from_host_bytes"]
    with EmulatedDevice(1).alloc(100) as memory:
        memory.write(0, b"x" * 100)
        assert memory.read(0, 100) == b"x" * 100
        assert memory.device == "emu:1"
    assert EMULATED.stats["from_host_bytes"] == before + 100


def test_the_cuda_backend_keeps_the_threads_context_and_pins_once(fake_driver: Path) -> None:
    """Over the stand-in driver: each call makes device 0's context current and puts the
    thread's own back; copies use a stream of the calling thread; pinning twice is a no-op
    the second time (the driver's ALREADY_REGISTERED), unpinning works once."""
    import ctypes
    import mmap
    import threading

    from tsukimi.device.cuda import CudaBackend

    driver = ctypes.CDLL(str(fake_driver))
    driver.fakeMalloc.restype, driver.fakeMalloc.argtypes = ctypes.c_uint64, [ctypes.c_size_t]
    be = CudaBackend(str(fake_driver))
    assert be.available()
    theirs = ctypes.c_void_p(0x9999)  # another library's context, current on this thread
    driver.cuCtxSetCurrent(theirs)
    memory = DeviceRange("cuda:0", int(driver.fakeMalloc(4096)), 4096)
    be.from_host(memory, memoryview(b"z" * 4096))
    now = ctypes.c_void_p()
    driver.cuCtxGetCurrent(ctypes.byref(now))
    assert now.value == 0x9999  # put back
    copies = ctypes.c_long.in_dll(driver, "fakeCopies")
    before = copies.value

    def elsewhere() -> None:  # a thread with no context of its own
        out = bytearray(4096)
        be.to_host(memory, memoryview(out))
        assert out == b"z" * 4096

    worker = threading.Thread(target=elsewhere)
    worker.start()
    worker.join()
    assert copies.value == before + 1
    mm = mmap.mmap(-1, 1 << 16)
    unpin = be.pin(memoryview(mm))
    again = be.pin(memoryview(mm))  # already pinned: nothing to undo
    again()
    unpin()
    with pytest.raises(DeviceError, match="HOST_MEMORY_NOT_REGISTERED"):
        unpin()  # the driver's own error name comes through
    mm.close()
    with pytest.raises(DeviceError, match="no device cuda:1"):
        be.to_host(DeviceRange("cuda:1", memory.address, 16), memoryview(bytearray(16)))
