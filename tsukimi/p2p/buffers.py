"""The caller's buffers as extents of this engine's segment: checked, registered if needed,
and their crc32c. A buffer may be device memory (a torch CUDA tensor, or anything
`tsukimi.device.device_range` takes): it is registered as such, and its bytes are checksummed
through the host in chunks (the host cannot address them)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import crc32c

from tsukimi.device import DeviceRange, backend, device_range
from tsukimi.errors import InvalidArgument, OutOfBounds, OverlappingBuffers, TsukimiError
from tsukimi.p2p.records import Extent
from tsukimi.transfer import TransferEngine
from tsukimi.transfer.segment import byte_view

logger = logging.getLogger(__name__)
CRC_CHUNK_BYTES = 16 << 20  # device memory is checksummed through a host chunk this large


def claim_buffers(
    engine: TransferEngine, buffers: Sequence[object], taken: Sequence[Extent] = ()
) -> tuple[tuple[Extent, ...], tuple[int, ...]]:
    """The extents of `buffers` (in order) and the bases of those this call registered with
    `engine` (the rest were registered already). Mutates the engine's segment.

    Raises:
        InvalidArgument: no buffers. InvalidBufferError: one is not a usable buffer.
        OverlappingBuffers: two share memory, or one overlaps `taken` (another payload's).
    """
    if isinstance(buffers, (bytes, bytearray, memoryview)) or not isinstance(buffers, Sequence) or not buffers:
        raise InvalidArgument("buffers must be a non-empty sequence of buffers")
    extents = tuple(_extent(b) for b in buffers)
    check_disjoint(extents, taken)
    registered: list[int] = []
    try:
        for buffer, extent in zip(buffers, extents, strict=True):
            try:
                engine.local_memory(extent.address, extent.length)
                continue  # registered already (by the caller): theirs to unregister
            except OutOfBounds:
                pass
            registered.append(engine.register(buffer))
    except BaseException:
        release(engine, tuple(registered))
        raise
    return extents, tuple(registered)


def _extent(buffer: object) -> Extent:
    """Where `buffer` lies (device memory or host). Raises InvalidBufferError: not a buffer."""
    found = device_range(buffer)
    if found is not None:
        return Extent(found.address, found.length)
    view, address = byte_view(buffer, writable=True)
    return Extent(address, len(view))


def crc32c_of(engine: TransferEngine, extents: Sequence[Extent]) -> int:
    """The crc32c of the registered bytes of `extents`, in order (device memory copied to the
    host a chunk at a time). Raises OutOfBounds: an extent is not registered here."""
    crc = 0
    chunk: bytearray | None = None
    for extent in extents:
        memory = engine.local_memory(extent.address, extent.length)
        if not isinstance(memory, DeviceRange):
            crc = crc32c.crc32c(memory, value=crc)
            continue
        chunk = chunk if chunk is not None else bytearray(min(CRC_CHUNK_BYTES, memory.length))
        for start in range(0, memory.length, CRC_CHUNK_BYTES):
            n = min(CRC_CHUNK_BYTES, memory.length - start)
            if len(chunk) < n:
                chunk = bytearray(n)
            view = memoryview(chunk)[:n]
            backend(memory.device).to_host(memory.sub(start, n), view)
            crc = crc32c.crc32c(view, value=crc)
    return crc


def check_disjoint(extents: Sequence[Extent], taken: Sequence[Extent] = ()) -> None:
    """Raises OverlappingBuffers: two of `extents` overlap, or one overlaps `taken`."""
    ordered = sorted([(e.address, e.length, True) for e in extents] + [(e.address, e.length, False) for e in taken])
    for (a_addr, a_len, a_new), (b_addr, _, b_new) in itertools.pairwise(ordered):
        if b_addr < a_addr + a_len and (a_new or b_new):
            whose = "each other" if a_new and b_new else "a buffer of another payload open here"
            raise OverlappingBuffers(f"buffers at {a_addr:#x} and {b_addr:#x} overlap ({whose})")


def release(engine: TransferEngine, registered: tuple[int, ...]) -> None:
    """Unregister the buffers at `registered` (best effort: logged)."""
    for base in registered:
        try:
            engine.unregister(base)
        except TsukimiError as exc:
            logger.warning("could not unregister P2P buffer at %#x: %s", base, exc)
