"""The device under test. `device` runs a test on the emulated device and, with `pytest -m gpu`
on a GPU, on CUDA; `any_device` adds CUDA's backend over a stand-in driver (tests/device/fake_cuda,
built by the `fake_driver` fixture of tests/conftest.py), so CI runs tsukimi/device/cuda.py's
ctypes layer too. Each gives (the backend, an allocator of fresh zeroed memory that stays alive
until the test ends)."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator

import pytest

from tsukimi.device import EMULATED, DeviceBackend, DeviceRange, EmulatedDevice, backend
from tsukimi.device.cuda import CudaBackend
from tsukimi.device.registry import device_range

Alloc = Callable[[int], DeviceRange]


@contextlib.contextmanager
def _device(kind: str, request: pytest.FixtureRequest) -> Iterator[tuple[DeviceBackend, Alloc]]:
    keep: list[object] = []
    if kind == "emu":
        emu = EmulatedDevice(0)

        def alloc(n: int) -> DeviceRange:
            memory = emu.alloc(n)
            keep.append(memory)
            return memory.range

        yield EMULATED, alloc
        for memory in keep:
            memory.close()  # type: ignore[attr-defined]
        return
    if kind == "fake-cuda":
        library = request.getfixturevalue("fake_driver")
        driver = ctypes.CDLL(str(library))
        driver.fakeMalloc.restype, driver.fakeMalloc.argtypes = ctypes.c_uint64, [ctypes.c_size_t]
        driver.fakeFree.argtypes = [ctypes.c_uint64]
        fake = CudaBackend(str(library))

        def alloc_fake(n: int) -> DeviceRange:
            address = int(driver.fakeMalloc(n))
            assert address, "the stand-in driver is out of allocations"
            keep.append(address)
            return DeviceRange("cuda:0", address, n)

        yield fake, alloc_fake
        for address in keep:
            driver.fakeFree(address)
        return
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")

    def alloc_cuda(n: int) -> DeviceRange:
        tensor = torch.zeros(n, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()  # NOTE: the backend's copies are not ordered after torch's kernels
        keep.append(tensor)
        found = device_range(tensor)
        assert found is not None
        return found

    yield backend("cuda"), alloc_cuda


@pytest.fixture(params=["emu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> Iterator[tuple[DeviceBackend, Alloc]]:
    with _device(request.param, request) as found:
        yield found


@pytest.fixture(params=["emu", "fake-cuda", pytest.param("cuda", marks=pytest.mark.gpu)])
def any_device(request: pytest.FixtureRequest) -> Iterator[tuple[DeviceBackend, Alloc]]:
    with _device(request.param, request) as found:
        yield found
