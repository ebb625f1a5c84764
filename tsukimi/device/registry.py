"""Which backend owns a piece of memory, and device ranges from what callers hand tsukimi.

`device_range(obj)` turns the objects the Transfer Engine, the store and the P2P store accept
into a DeviceRange when they live on a device: torch tensors on "cuda" (duck-typed: torch is
not imported here), emulated memory, DeviceRanges themselves. `locate(address, length)` says
whether a raw pointer (Mooncake's `register_memory(addr, len)`) is device memory.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Protocol, cast

from tsukimi.device.base import DeviceBackend, DeviceRange
from tsukimi.device.cuda import CudaBackend
from tsukimi.device.emulated import EMULATED, EmulatedMemory
from tsukimi.errors import ConfigError, DeviceError, InvalidBufferError

logger = logging.getLogger(__name__)

# NOTE: TSUKIMI_LIBCUDA names another driver library (tests run processes over a stand-in)
CUDA = CudaBackend(os.environ.get("TSUKIMI_LIBCUDA") or "libcuda.so.1")
_BACKENDS: dict[str, DeviceBackend] = {"cuda": CUDA, "emu": EMULATED}


def backend(device: str) -> DeviceBackend:
    """The backend of `device` ("cuda:0", or just its kind "cuda").

    Raises:
        ConfigError: no backend of that kind.
    """
    kind = device.partition(":")[0]
    found = _BACKENDS.get(kind)
    if found is None:
        raise ConfigError(f"unknown device kind {kind!r} (known: {', '.join(_BACKENDS)})")
    return found


def locate(address: int, length: int) -> DeviceRange | None:
    """The device range [address, address + length) is on, or None for host memory.
    Raises InvalidBufferError when it starts in a device allocation and runs past it."""
    for kind in ("emu", "cuda"):  # NOTE: the emulated registry first: a dict lookup, no driver
        found = _BACKENDS[kind].locate(address, length)
        if found is not None:
            return found
    return None


class _TorchDevice(Protocol):
    type: str
    index: int | None


class _DeviceTensor(Protocol):
    device: _TorchDevice

    def is_contiguous(self) -> bool: ...
    def numel(self) -> int: ...
    def element_size(self) -> int: ...
    def data_ptr(self) -> int: ...


def device_range(obj: object) -> DeviceRange | None:
    """`obj` as a device range when it is device memory (a torch tensor on cuda, emulated
    memory, a DeviceRange), else None.

    Raises:
        InvalidBufferError: a device tensor that is not contiguous or is empty.
    """
    if isinstance(obj, DeviceRange):
        return obj
    if isinstance(obj, EmulatedMemory):
        return obj.range
    if hasattr(obj, "data_ptr") and hasattr(obj, "device") and hasattr(obj, "is_contiguous"):
        tensor = cast(_DeviceTensor, obj)
        if tensor.device.type != "cuda":
            return None
        if not tensor.is_contiguous():
            raise InvalidBufferError("a device tensor must be contiguous")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            raise InvalidBufferError("a device tensor must not be empty")
        return DeviceRange(f"cuda:{tensor.device.index or 0}", int(tensor.data_ptr()), nbytes)
    return None


def pin_or_warn(device: str, view: memoryview, what: str) -> Callable[[], None]:
    """Pin host memory `view` for devices of `device`'s kind (`DeviceBackend.pin`); the call
    that unpins it. Pinning is a speed-up, never a need: a failure (the driver refused, e.g. a
    read-only mapping or a locked-memory limit) is logged, naming `what`, and answered with a
    no-op, and so is a failing unpin."""
    try:
        unpin = backend(device).pin(view)
    except DeviceError as exc:
        logger.warning("cannot pin %s (%d bytes) for %s: copies run slower: %s", what, len(view), device, exc)
        return _nothing

    def unpin_logged() -> None:
        try:
            unpin()
        except DeviceError as exc:
            logger.warning("cannot unpin %s: %s", what, exc)

    return unpin_logged


def _nothing() -> None:
    return None
