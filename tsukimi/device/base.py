"""What a device is to tsukimi: memory the host cannot address, moved only by its backend.

A `DeviceRange` names bytes on a device ("cuda:0"). A `DeviceBackend` (one per kind of device:
tsukimi/device/cuda.py for NVIDIA GPUs, tsukimi/device/emulated.py for CI) copies between its
memory and host memory or its own memory, exports a range for another process on the same host
(CUDA IPC) and opens what a peer exported, and pins host memory for DMA. Every copy is synchronous
from its caller's view (it returns when the bytes are in place) and releases the GIL while it waits,
so copies on several threads overlap each other and the network.

The ordering contract is Mooncake's: a caller hands device memory to tsukimi only once the work
that wrote it is complete (e.g. `torch.cuda.synchronize()` or its stream's), and reads what
tsukimi wrote after the call that wrote it returned.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tsukimi.errors import InvalidBufferError


@dataclass(frozen=True, slots=True)
class DeviceRange:
    """Bytes [address, address + length) of device `device` ("cuda:0", "emu:1")."""

    device: str
    address: int
    length: int

    def __post_init__(self) -> None:
        kind, _, index = self.device.partition(":")
        if not kind or not index.isdigit():
            raise InvalidBufferError(f"a device is named KIND:INDEX (e.g. cuda:0), got {self.device!r}")
        if self.address <= 0 or self.length <= 0:
            raise InvalidBufferError(f"device range {self.address:#x}+{self.length} is empty or has no address")

    @property
    def kind(self) -> str:
        return self.device.partition(":")[0]

    @property
    def index(self) -> int:
        return int(self.device.partition(":")[2])

    def sub(self, offset: int, length: int) -> DeviceRange:
        """The range [offset, offset + length) of this one. Raises InvalidBufferError outside it."""
        if offset < 0 or length <= 0 or offset + length > self.length:
            raise InvalidBufferError(f"[{offset}, {offset + length}) is outside a device range of {self.length} bytes")
        return DeviceRange(self.device, self.address + offset, length)


@dataclass(frozen=True, slots=True)
class OpenedRange:
    """A peer's exported range, mapped into this process: `address` is its first byte here.
    `close` unmaps it (once every opener of the same export closed it)."""

    device: str
    address: int
    length: int
    close: Callable[[], None]


class DeviceBackend(Protocol):
    """One kind of device. Thread-safe. Every method raises DeviceError when the driver fails."""

    kind: str  # the device names' prefix: "cuda", "emu"

    def available(self) -> bool:
        """Whether this process can use devices of this kind (a driver and a device exist)."""
        ...

    def locate(self, address: int, length: int) -> DeviceRange | None:
        """The device range holding [address, address + length) when it is this backend's
        memory, else None (host memory, or unknown)."""
        ...

    def to_host(self, src: DeviceRange, dst: memoryview) -> None:
        """Copy `src` into host memory `dst` (same length)."""
        ...

    def from_host(self, dst: DeviceRange, src: memoryview) -> None:
        """Copy host memory `src` into `dst` (same length)."""
        ...

    def copy(self, dst: DeviceRange, src: DeviceRange) -> None:
        """Copy device to device (same length; the devices may differ)."""
        ...

    def export(self, memory: DeviceRange) -> bytes:
        """What another process on this host needs to open `memory` (`open`)."""
        ...

    def open(self, exported: bytes, length: int) -> OpenedRange:
        """Map a range another process (or this one) exported. Raises InvalidBufferError when
        `exported` is not this backend's, DeviceError when the driver refuses it."""
        ...

    def pin(self, view: memoryview) -> Callable[[], None]:
        """Pin host memory for DMA (page-locked, e.g. cudaHostRegister) in place; returns the
        call that unpins it. A backend without DMA returns a no-op."""
        ...


def host_address(view: memoryview) -> int:
    """The address of a C-contiguous host memoryview's first byte (read-only views too)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0
