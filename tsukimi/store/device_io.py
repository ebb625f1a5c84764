"""`DeviceIO`: device memory (GPU, emulated) as the sources of puts and the destinations of gets,
a part of client.py's `StoreClient`.

The Transfer Engine moves host memory; device bytes cross to the host through the client's
`HostStaging` (pinned, registered with the client's engine once, reused) in as few copies as
possible, never one per block:

    put:  device sources --gather (1 kernel per allocation)--> device scratch
            --ONE device->host copy--> staging --the ordinary put (TE WRITE)--> replicas
    get:  replicas --the ordinary get (TE READ)--> staging
            --ONE host->device copy--> device scratch --ONE scatter--> device destinations

A batch whose device ranges are one range (a single one, or adjacent ones in order) skips
the scratch: one copy straight to or from it. Host
parts of the same batch ride along untouched, in the same master round trip. A batch larger
than `max_staged_bytes` is cut into consecutive groups, each staged and moved as above (an
object larger than that alone is staged whole).

Bytes reach a device destination only for reads that succeeded (checksum included): a miss, a
destination too small or a failed read leaves it as it was.

`pin_for_gpus` pins a holder's segment when this host has a GPU, so GPU readers' copies from
it run at DMA speed (GPU.md: 36.5/45 GB/s pinned vs 4.6/10.1 unpinned).
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from tsukimi.device import CUDA, DeviceRange, backend, device_range, pin_or_warn
from tsukimi.device.batch_copy import HostStaging, device_scratch, gather, scatter_at
from tsukimi.errors import InvalidBufferError, TsukimiError
from tsukimi.store import protocol as p
from tsukimi.store.replica_io import PutItem
from tsukimi.transfer.segment import HOST_TYPES, byte_view, host_view

logger = logging.getLogger(__name__)

Part = memoryview | DeviceRange  # a host buffer's bytes, or device memory
R = TypeVar("R")
_Place = tuple[int, int, DeviceRange | None]  # a part's length, its offset in the staging, its device range

MAX_STAGED_BYTES = 256 << 20  # NOTE: a paged cache fill of 4,096 x 32 KiB (128 MiB) is one group


@dataclass(frozen=True, slots=True)
class DevicePut:
    """`PutItem` whose parts may be device memory."""

    key: str
    parts: tuple[Part, ...]
    config: p.ReplicaConfig
    upsert: bool


def pin_for_gpus(view: memoryview) -> Callable[[], None]:
    """Pin `view` (page-locked, in place) when a CUDA GPU is present; the call that unpins
    it. A failure is logged and answered with a no-op: pinning is a speed-up, not a need."""
    if not CUDA.available():
        return _nothing
    return pin_or_warn("cuda", view, "the segment")


def _nothing() -> None:
    return None


def as_part(data: object, writable: bool = False) -> Part:
    """`data` as device memory when it is (a CUDA tensor, EmulatedMemory, a DeviceRange),
    else as a host byte view (any buffer `byte_view` takes).

    Raises:
        InvalidBufferError: not a buffer, a str, empty, not contiguous, or read-only when
            `writable`.
    """
    if data.__class__ in HOST_TYPES:  # NOTE: the common case, per buffer of every call: no device lookup
        return host_view(data, writable)
    found = device_range(data)
    if found is not None:
        return found
    if isinstance(data, str):
        raise InvalidBufferError("store values are bytes-like, not str (encode it first)")
    return byte_view(data, writable=writable, with_address=False)[0]


def has_device(parts: Sequence[Part]) -> bool:
    """Whether any part is device memory (the per-request check of the host path)."""
    return any(isinstance(part, DeviceRange) for part in parts)


class DeviceIO:
    """Stages a client's device bytes through `staging`. Keeps no state of its own between
    calls (thread-safe as the staging is)."""

    def __init__(self, staging: HostStaging, max_staged_bytes: int = MAX_STAGED_BYTES) -> None:
        self._staging = staging
        self._max_bytes = max_staged_bytes

    def put(
        self, items: Sequence[DevicePut], put_host: Callable[[list[PutItem]], list[TsukimiError | None]]
    ) -> list[TsukimiError | None]:
        """Put `items` (see the module) through `put_host`, the client's host put path.

        Returns:
            Each item's error or None, as `put_host` answers.
        Raises:
            DeviceError (a device copy failed: nothing of that group was put), and what
            `put_host` raises.
        """
        errors: list[TsukimiError | None] = []
        for group in _groups([item.parts for item in items], self._max_bytes):
            errors += self._put_group([items[i] for i in group], put_host)
        return errors

    def _put_group(
        self, items: list[DevicePut], put_host: Callable[[list[PutItem]], list[TsukimiError | None]]
    ) -> list[TsukimiError | None]:
        sources = [part for item in items for part in item.parts if isinstance(part, DeviceRange)]
        with self._borrow(sources) as staging:
            offsets = _offsets(sources)
            for device, pieces in _by_device(sources, offsets).items():
                _to_host(device, pieces, staging)
            staged = iter(staging[o : o + s.length] for o, s in zip(offsets, sources, strict=True))
            host = [
                PutItem(
                    item.key,
                    tuple(next(staged) if isinstance(part, DeviceRange) else part for part in item.parts),
                    item.config,
                    item.upsert,
                )
                for item in items
            ]
            return put_host(host)

    def _borrow(self, ranges: list[DeviceRange]) -> contextlib.AbstractContextManager[memoryview]:
        """Staging for `ranges`' bytes (none: an empty view, nothing borrowed)."""
        if not ranges:
            return contextlib.nullcontext(memoryview(b""))
        return self._staging.borrow(sum(r.length for r in ranges), ranges[0].device)

    def get(
        self,
        dests: Sequence[tuple[Part, ...]],
        get_host: Callable[[list[int], list[tuple[memoryview, ...]]], list[R]],
        read_bytes: Callable[[R], int | None],
    ) -> list[R]:
        """Read into `dests` (each object's parts, in order) through `get_host`, the client's
        host get path given the indices of a group of objects and their host buffers (a
        group: the objects staged together); `read_bytes(result)` says how many bytes of the
        object a result read (None: nothing usable: a miss or a failure). Mutates the device
        destinations of the objects read, and only those.

        Returns:
            `get_host`'s results, in order; a result's host views of the staging are valid only
            until this returns (callers answer sizes, not those views).
        Raises:
            DeviceError (a device copy failed), and what `get_host` raises.
        """
        results: list[R] = []
        for group in _groups(dests, self._max_bytes):
            results += self._get_group(group, dests, get_host, read_bytes)
        return results

    def _get_group(
        self,
        group: list[int],
        all_dests: Sequence[tuple[Part, ...]],
        get_host: Callable[[list[int], list[tuple[memoryview, ...]]], list[R]],
        read_bytes: Callable[[R], int | None],
    ) -> list[R]:
        dests = [all_dests[i] for i in group]
        targets = [part for parts in dests for part in parts if isinstance(part, DeviceRange)]
        with self._borrow(targets) as staging:
            offsets = iter(_offsets(targets))
            landing: list[tuple[memoryview, ...]] = []
            places: list[list[_Place]] = []  # per object, per part
            for parts in dests:
                views: list[memoryview] = []
                where: list[_Place] = []
                for part in parts:
                    if isinstance(part, DeviceRange):
                        offset = next(offsets)
                        views.append(staging[offset : offset + part.length])
                        where.append((part.length, offset, part))
                    else:
                        views.append(part)
                        where.append((len(part), 0, None))
                landing.append(tuple(views))
                places.append(where)
            results = get_host(group, landing)
            del landing
            moves: list[tuple[int, DeviceRange]] = []
            for where, result in zip(places, results, strict=True):
                moves += _delivered(where, read_bytes(result))
            by_device: dict[str, list[tuple[int, DeviceRange]]] = defaultdict(list)
            for offset, memory in moves:
                by_device[memory.device].append((offset, memory))
            for device, pieces in by_device.items():
                _to_device(device, pieces, staging)
            return results


def _groups(items: Sequence[Sequence[Part]], max_bytes: int) -> list[list[int]]:
    """Consecutive groups of item indices whose device bytes fit `max_bytes` (an item alone
    may exceed it); a new group starts only at an item with device bytes."""
    groups: list[list[int]] = [[]]
    size = 0
    for i, parts in enumerate(items):
        nbytes = sum(part.length for part in parts if isinstance(part, DeviceRange))
        if size and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
    return groups if items else []


def _offsets(ranges: Sequence[DeviceRange]) -> list[int]:
    """Each range's offset in the staging: those of one device back to back (so that each
    device's bytes cross in one copy), devices in order of first appearance."""
    order = sorted(range(len(ranges)), key=lambda i: ranges[i].device)
    offsets, total = [0] * len(ranges), 0
    for i in order:
        offsets[i] = total
        total += ranges[i].length
    return offsets


def _by_device(ranges: Sequence[DeviceRange], offsets: Sequence[int]) -> dict[str, list[tuple[int, DeviceRange]]]:
    out: dict[str, list[tuple[int, DeviceRange]]] = defaultdict(list)
    for offset, memory in zip(offsets, ranges, strict=True):
        out[memory.device].append((offset, memory))
    return out


def _delivered(where: list[_Place], nbytes: int | None) -> list[tuple[int, DeviceRange]]:
    """The device pieces of one object that its first `nbytes` read bytes cover (a part read
    in part: its first bytes), as (offset in the staging, range)."""
    if nbytes is None:
        return []
    out: list[tuple[int, DeviceRange]] = []
    start = 0
    for length, offset, memory in where:
        covered = min(length, nbytes - start)
        if memory is not None and covered > 0:
            out.append((offset, memory if covered == length else memory.sub(0, covered)))
        start += length
    return out


def _to_host(device: str, pieces: list[tuple[int, DeviceRange]], staging: memoryview) -> None:
    """Copy one device's `pieces` to their offsets in `staging`: one copy when they are one
    range, else a gather into scratch and one copy of it (the pieces' offsets are consecutive)."""
    be = backend(device)
    first = pieces[0][0]
    total = sum(memory.length for _, memory in pieces)
    whole = _one_range(pieces)
    if whole is not None:
        be.to_host(whole, staging[first : first + total])
        return
    with device_scratch(device, total) as scratch:
        gather(scratch, [memory for _, memory in pieces])
        be.to_host(scratch, staging[first : first + total])


def _to_device(device: str, pieces: list[tuple[int, DeviceRange]], staging: memoryview) -> None:
    """Copy `pieces` from their offsets in `staging` to one device: one copy for one piece,
    else one copy of their span into scratch and one scatter."""
    be = backend(device)
    whole = _one_range(pieces)
    if whole is not None:
        offset = pieces[0][0]
        be.from_host(whole, staging[offset : offset + whole.length])
        return
    low = min(offset for offset, _ in pieces)
    high = max(offset + memory.length for offset, memory in pieces)
    with device_scratch(device, high - low) as scratch:
        be.from_host(scratch, staging[low:high])
        scatter_at(scratch, [(offset - low, memory) for offset, memory in pieces])


def _one_range(pieces: list[tuple[int, DeviceRange]]) -> DeviceRange | None:
    """The one device range `pieces` make when they are adjacent in order on both sides
    (staging offsets and device addresses), else None."""
    offset, first = pieces[0]
    end_offset, end = offset + first.length, first.address + first.length
    for piece_offset, memory in pieces[1:]:
        if piece_offset != end_offset or memory.address != end or memory.device != first.device:
            return None
        end_offset, end = end_offset + memory.length, end + memory.length
    return DeviceRange(first.device, first.address, end - first.address)
