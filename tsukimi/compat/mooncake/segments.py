"""Segments a `MooncakeDistributedStore` mounts after setup: `mount_segment` (a range of a
file, e.g. one in /dev/shm, mapped), `allocate_and_mount_segment` (memory the facade
allocates), their unmounts, and `unmount_local_disk_segment` (the holder's disk tier).

`MountedSegments` owns the memory of those segments and the records of which id is which.
A segment's memory is registered with the client's Transfer Engine and announced to the master
(`StoreClient.mount`); an unmount withdraws it from the master first (its replicas are dropped:
new readers get a miss, and no new replica lands there), then gives the memory back after the
grace period, so a read granted before the unmount finishes on live memory. The call itself
returns at once, as the wheel's does.

Semantics probed on the real wheel (0.3.13.post1) against `mooncake_master`:
- the two kinds are kept apart: `unmount_segment` takes only ids of `mount_segment`,
  `unmount_and_free_segment` only those of `allocate_and_mount_segment` (else -1);
- every id of a call is tried; the answer is the first failure (-1 unknown, -600 repeated), or 0;
- `mount_segment` with size 0 answers ret 0 and no ids; a missing file, a range past its end or
  an offset not page-aligned: ret -1; `allocate_and_mount_segment` rounds up to 16 MiB, and
  size 0 is ret -1; negative sizes are TypeErrors (the binding's unsigned ints);
- `unmount_local_disk_segment` without an SSD tier answers 0 (the wheel logs a warning).

Differences: the wheel still reports objects that lived on an unmounted segment until it next
touches them; tsukimi's master drops them at the unmount. `protocol` and `location` are taken
and logged: tsukimi's engine picks its transports itself. tsukimi's master takes no segment
under 4096 bytes (the wheel took a 100-byte one): -600.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from tsukimi.compat.mooncake.codes import INVALID_PARAMS, OK, code_of
from tsukimi.compat.mooncake.connection import StoreConnection
from tsukimi.errors import TsukimiError
from tsukimi.transfer import TransferEngine

logger = logging.getLogger(__name__)

FAILED = -1  # NOTE: the wheel's answer for a bad path/range or an unknown segment id (not an ErrorCode)
ALLOCATION_UNIT = 16 << 20  # NOTE: the wheel rounds allocate_and_mount_segment up to this
MountResult = dict[str, int | list[str]]


@dataclass(frozen=True, slots=True)
class _Segment:
    """A mounted segment's memory: `release` unregisters it from the engine and frees it."""

    segment_id: str
    base: int
    size: int
    release: Callable[[], None]


def _once(release: Callable[[], None]) -> Callable[[], None]:
    """`release`, run at most once (a grace timer and `clear` may both call it)."""
    done = threading.Event()
    lock = threading.Lock()

    def run() -> None:
        with lock:
            if done.is_set():
                return
            done.set()
        release()

    return run


def _release_all(lock: threading.Lock, *tables: dict[str, _Segment]) -> None:
    """Release every segment of `tables` (a MountedSegments collected without clear())."""
    with lock:
        segments = [segment for table in tables for segment in table.values()]
        for table in tables:
            table.clear()
    for segment in segments:
        segment.release()


def _unregister(engine: TransferEngine, base: int) -> None:
    """Withdraw a buffer from the engine; nothing when the engine is closed or forgot it."""
    try:
        engine.unregister(base)
    except TsukimiError as exc:
        logger.debug("unregistering %#x: %s", base, exc)


def _sizes(**values: object) -> None:
    """TypeError unless each value is an int >= 0 (the wheel's unsigned binding arguments)."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise TypeError(f"{name} must be a non-negative int, got {value!r}")


def _strings(**values: object) -> None:
    for name, value in values.items():
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str, got {type(value).__name__}")


def _ids(segment_ids: object, grace_period_seconds: object) -> list[str]:
    """The ids, checked as the binding does (TypeError)."""
    if not isinstance(segment_ids, list) or not all(isinstance(s, str) for s in segment_ids):
        raise TypeError("segment_ids must be a list of str")
    _sizes(grace_period_seconds=grace_period_seconds)
    return list(segment_ids)


class MountedSegments:
    """The segments one facade store mounted after setup (see the module). Thread-safe."""

    def __init__(self, connection: StoreConnection) -> None:
        self._connection = connection
        self._lock = threading.Lock()
        self._mapped: dict[str, _Segment] = {}  # mount_segment's
        self._allocated: dict[str, _Segment] = {}  # allocate_and_mount_segment's
        self._timers: list[threading.Timer] = []
        # NOTE: a store dropped without close() still frees them (its connection's finalizer
        # unmounts them; release unregisters before it unmaps, so no peer writes into freed memory)
        weakref.finalize(self, _release_all, self._lock, self._mapped, self._allocated)

    def mount(self, path: str, size: int, offset: int, protocol: str, location: str) -> MountResult:
        """Map [offset, offset + size) of the file at `path`, register and mount it."""
        _strings(path=path, protocol=protocol, location=location)
        _sizes(size=size, offset=offset)
        if size == 0:
            return {"ret": OK, "segment_ids": []}
        client = self._connection.ready()
        if client is None:
            return {"ret": FAILED, "segment_ids": []}
        if offset % mmap.ALLOCATIONGRANULARITY:
            logger.error("mount_segment: offset %d is not page-aligned (%d)", offset, mmap.ALLOCATIONGRANULARITY)
            return {"ret": FAILED, "segment_ids": []}
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                if offset + size > os.fstat(fd).st_size:
                    logger.error("mount_segment: [%d, %d) is past the end of %s", offset, offset + size, path)
                    return {"ret": FAILED, "segment_ids": []}
                mapping = mmap.mmap(fd, size, offset=offset)
            finally:
                os.close(fd)
        except OSError as exc:
            logger.error("mount_segment: %s: %s", path, exc)
            return {"ret": FAILED, "segment_ids": []}
        logger.debug("mount_segment %s (protocol %r, location %r)", path, protocol, location)

        def release() -> None:
            _unregister(client.engine, base)
            try:
                mapping.close()
            except BufferError:  # NOTE: a view the engine handed out lives on; the GC unmaps it
                logger.debug("mount_segment %s: mapping still viewed; left to the GC", path)

        try:
            base = client.engine.register(mapping, "cpu")
        except TsukimiError as exc:
            mapping.close()
            logger.error("mount_segment: %s", exc)
            return {"ret": code_of(exc), "segment_ids": []}
        return self._announce(self._mapped, base, size, release, {})

    def allocate(self, size: int, protocol: str, location: str) -> MountResult:
        """Allocate `size` bytes (rounded up to 16 MiB) of shared memory, register and mount it."""
        _strings(protocol=protocol, location=location)
        _sizes(size=size)
        client = self._connection.ready()
        if client is None or size == 0:
            logger.error("allocate_and_mount_segment: no client, or size 0")
            return {"ret": FAILED, "segment_ids": [], "allocated_size": 0}
        allocated = -(-size // ALLOCATION_UNIT) * ALLOCATION_UNIT
        logger.debug("allocate_and_mount_segment %d (protocol %r, location %r)", allocated, protocol, location)
        try:
            buf = client.engine.allocate(allocated)
        except (TsukimiError, OSError) as exc:
            logger.error("allocate_and_mount_segment: %s", exc)
            return {"ret": FAILED, "segment_ids": [], "allocated_size": 0}

        def release() -> None:
            _unregister(client.engine, buf.base)

        return self._announce(self._allocated, buf.base, allocated, release, {"allocated_size": allocated})

    def _announce(
        self,
        records: dict[str, _Segment],
        base: int,
        size: int,
        release: Callable[[], None],
        extra: MountResult,
    ) -> MountResult:
        """Mount registered memory at the master and record it; released again on failure."""
        client = self._connection.client
        try:
            assert client is not None
            segment_id = client.mount(base, size)
        except TsukimiError as exc:
            release()
            logger.error("mounting %d bytes: %s", size, exc)
            return {"ret": code_of(exc), "segment_ids": [], **{k: 0 for k in extra}}
        with self._lock:
            records[segment_id] = _Segment(segment_id, base, size, _once(release))
        return {"ret": OK, "segment_ids": [segment_id], **extra}

    def unmount(self, segment_ids: list[str], grace_period_seconds: int, *, allocated: bool) -> int:
        """Unmount each id (of `allocate` when `allocated`, else of `mount`); its memory goes
        after the grace period. 0, or the first failure's code (every id is tried)."""
        ids = _ids(segment_ids, grace_period_seconds)
        records = self._allocated if allocated else self._mapped
        first = OK
        seen: set[str] = set()
        for segment_id in ids:
            code = self._unmount_one(records, segment_id, grace_period_seconds, segment_id in seen)
            seen.add(segment_id)
            first = first or code
        return first

    def _unmount_one(self, records: dict[str, _Segment], segment_id: str, grace_s: int, repeated: bool) -> int:
        with self._lock:
            segment = records.pop(segment_id, None)
        if segment is None:
            logger.error("segment %r: %s", segment_id, "named twice" if repeated else "not mounted by this call's kind")
            return INVALID_PARAMS if repeated else FAILED
        client = self._connection.client
        try:
            if client is not None:
                client.unmount(segment_id)
        except TsukimiError as exc:
            logger.error("unmounting %s: %s", segment_id, exc)
            with self._lock:
                records[segment_id] = segment
            return code_of(exc)
        self._release_later(segment, grace_s)
        return OK

    def _release_later(self, segment: _Segment, grace_s: int) -> None:
        """Free the memory after `grace_s` seconds: a read granted before the unmount may
        still be moving its bytes (now when no grace is asked for)."""
        if not grace_s:
            segment.release()
            return
        timer = threading.Timer(grace_s, segment.release)
        timer.daemon = True
        with self._lock:
            self._timers = [t for t in self._timers if t.is_alive()] + [timer]
        timer.start()

    def unmount_local_disk(self, grace_period_seconds: int) -> int:
        """Withdraw the holder's disk tier (`StoreClient.unmount_disk`); 0 also without one."""
        _sizes(grace_period_seconds=grace_period_seconds)
        client = self._connection.ready()
        if client is None:
            return FAILED
        try:
            if not client.unmount_disk(grace_period_seconds):
                logger.warning("unmount_local_disk_segment: this client serves no disk (ssd offload not enabled)")
        except TsukimiError as exc:
            logger.error("unmount_local_disk_segment: %s", exc)
            return code_of(exc)
        return OK

    def clear(self) -> None:
        """Free every segment's memory now (the client unmounted them, or is gone). Mutates."""
        with self._lock:
            timers, self._timers = self._timers, []
            segments = [*self._mapped.values(), *self._allocated.values()]
            self._mapped.clear()
            self._allocated.clear()
        for timer in timers:
            timer.cancel()
            timer.function()
        for segment in segments:
            segment.release()
