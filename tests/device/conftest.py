"""The device under test: each test using `device` runs on the emulated device and, with
`pytest -m gpu` on a GPU, on CUDA; it gets (the backend, an allocator of fresh zeroed memory
that stays alive until the test ends)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tsukimi.device import EMULATED, DeviceBackend, DeviceRange, EmulatedDevice, backend
from tsukimi.device.registry import device_range

Alloc = Callable[[int], DeviceRange]


@pytest.fixture(params=["emu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> Iterator[tuple[DeviceBackend, Alloc]]:
    keep: list[object] = []
    if request.param == "emu":
        emu = EmulatedDevice(0)

        def alloc(n: int) -> DeviceRange:
            memory = emu.alloc(n)
            keep.append(memory)
            return memory.range

        yield EMULATED, alloc
        for memory in keep:
            memory.close()  # type: ignore[attr-defined]
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
