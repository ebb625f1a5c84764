"""Device memory as the Transfer Engine meets it: what a registration or a request's local
buffer is (host bytes or a device range), from the objects callers hand over and Mooncake's
location strings.

    register(tensor_on_cuda)               -> DeviceRange (device from the tensor)
    register((ptr, n))                     -> locate(ptr, n): a device range, or host memory
    register((ptr, n), location="cuda:0")  -> forced onto cuda:0 ("cpu" forces host; "*" detects)
    TransferRequest(local=(ptr, n))        -> a device range only inside a registered device
                                              buffer (no driver call per request)

Nothing here addresses device memory: callers move it with its backend (tsukimi/device).
"""

from __future__ import annotations

import logging

from tsukimi.device import DeviceRange, backend, device_range, locate
from tsukimi.errors import ConfigError, DeviceError, InvalidBufferError
from tsukimi.transfer.segment import LocalSegment, RegisteredBuffer

logger = logging.getLogger(__name__)

AUTO_LOCATIONS = ("", "*")
HOST_LOCATIONS = ("cpu",)


def registered_memory(obj: object, location: str | None = None) -> DeviceRange | None:
    """Where `obj` (what `TransferEngine.register` was given) lives: a device range, or None
    for host memory. Never mutates.

    Args:
        obj: a device object (torch CUDA tensor, EmulatedMemory, DeviceRange), an
            (address, length) tuple, or any host buffer.
        location: None / "*" detect; "cpu" (or "cpu:N") host; "KIND:N" (e.g. "cuda:0") device.

    Raises:
        ConfigError: an unknown device kind in `location`.
        InvalidBufferError: `location` contradicts what `obj` is, or a device range that is
            empty, not contiguous or runs past its allocation.
    """
    where = (location or "").strip()
    kind = where.partition(":")[0]
    found = device_range(obj)
    if found is None and isinstance(obj, tuple) and kind not in HOST_LOCATIONS:
        found = _tuple_memory(obj, where)
    if where in AUTO_LOCATIONS:
        return found
    if kind in HOST_LOCATIONS:
        if found is not None:
            raise InvalidBufferError(f"location {where!r} given for memory on {found.device}")
        return None
    backend(where)  # NOTE: raises ConfigError for an unknown kind
    if found is None or found.device != where:
        raise InvalidBufferError(
            f"location {where!r} given for memory {'on ' + found.device if found else 'of the host'}"
        )
    return found


def _tuple_memory(obj: tuple[object, ...], where: str) -> DeviceRange | None:
    if len(obj) != 2 or not all(isinstance(v, int) for v in obj):
        return None  # NOTE: byte_view says what is wrong with it
    address, length = int(obj[0]), int(obj[1])  # type: ignore[call-overload]
    if address <= 0 or length <= 0:
        return None
    # NOTE: a forced device must be one the driver reports (Mooncake trusts the caller; a host
    # pointer registered as GPU memory would fail every later copy, far from its cause)
    return locate(address, length)


def request_memory(obj: object, segment: LocalSegment) -> DeviceRange | None:
    """A request's local buffer as a device range, or None for host memory. (address, length)
    tuples are device memory only inside a device buffer registered in `segment`."""
    if isinstance(obj, tuple):
        if len(obj) == 2 and isinstance(obj[0], int) and isinstance(obj[1], int):
            return segment.device_at(obj[0], obj[1])
        return None
    if isinstance(obj, RegisteredBuffer):
        return obj.device
    return device_range(obj)


def export_of(memory: DeviceRange) -> bytes:
    """What a process on this host opens `memory` by, or b"" when its backend cannot export
    it (peers then reach it through the segment server). Never raises for that."""
    try:
        return backend(memory.device).export(memory)
    except (DeviceError, InvalidBufferError, ConfigError) as exc:
        logger.info(
            "device memory at %#x on %s cannot be exported (%s): peers use tcp", memory.address, memory.device, exc
        )
        return b""
