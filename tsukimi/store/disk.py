"""The SSD tier of a store client: objects evicted from memory kept as files in one directory.

One file per object, named by the sha256 hex digest of the key (keys may hold any character,
'/' included), with capacity bounded by the sum of value sizes (the per-file header and key,
at most ~4 KiB, are not charged) and an LRU of its own. Empty values are allowed.

File layout (little-endian):

    0      4       6        10        18      22            22+K        22+K+V
    | magic | ver  | key_len | val_len | crc32 | key (UTF-8) | value      |
      TSKD    u16    u32 (K)   u64 (V)   u32     K bytes       V bytes

The LRU order survives a restart in the files' mtimes: every put or get stamps the file
(`os.utime`, nanoseconds) with the injected clock's reading, forced strictly increasing, so
a restart sorts the files by mtime and no file is rewritten on a read. Writes go to a
`*.tmp` file in the same directory, then `os.replace` (atomic); a restart deletes leftover
temp files and files whose header, name or size do not agree. The value's crc32 is checked
on every read (not at restart), and a corrupt file is deleted and read as a miss.
A directory belongs to one `DiskTier` at a time.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import tempfile
import threading
import zlib
from collections import OrderedDict
from pathlib import Path

from tsukimi.clock import Clock, WallClock
from tsukimi.errors import ConfigError, InvalidBufferError

logger = logging.getLogger(__name__)

MAGIC = b"TSKD"
VERSION = 1
MAX_KEY_BYTES = 4096
_HEADER = struct.Struct("<4sHIQI")
_SUFFIX = ".obj"
_TMP_SUFFIX = ".tmp"


def _key_bytes(key: str) -> bytes:
    if not isinstance(key, str) or not key:
        raise ConfigError(f"a key must be a non-empty str, got {key!r}")
    raw = key.encode("utf-8")
    if len(raw) > MAX_KEY_BYTES:
        raise ConfigError(f"a key must be at most {MAX_KEY_BYTES} UTF-8 bytes, got {len(raw)}")
    return raw


def _file_name(raw_key: bytes) -> str:
    return hashlib.sha256(raw_key).hexdigest() + _SUFFIX


class DiskTier:
    """A bounded, LRU-evicted, restart-surviving object store in a local directory.

    Thread-safe: one lock serialises every call, file I/O included.
    """

    def __init__(
        self, directory: str | Path, capacity_bytes: int, clock: Clock | None = None, durable: bool = True
    ) -> None:
        """Open (creating if needed) `directory` and recover the objects already in it.

        Args:
            directory: where the files live; owned by this tier alone.
            capacity_bytes: bound on the sum of value sizes (> 0); if the recovered objects
                exceed it, the least recently used are evicted.
            clock: source of the access stamps (default `WallClock`).
            durable: fsync each file before it replaces the old copy (off for tests/benchmarks).

        Raises:
            ConfigError: capacity_bytes <= 0.
        """
        if capacity_bytes <= 0:
            raise ConfigError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self._dir = Path(directory)
        self._dir.mkdir(parents=True, exist_ok=True)
        self._capacity = capacity_bytes
        self._clock: Clock = clock if clock is not None else WallClock()
        self._durable = durable
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> value size, LRU first
        self._used = 0
        self._last_stamp_ns = 0
        with self._lock:
            self._recover()

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    @property
    def num_objects(self) -> int:
        with self._lock:
            return len(self._index)

    def keys(self) -> list[str]:
        """The stored keys, least recently used first (does not touch the LRU)."""
        with self._lock:
            return list(self._index)

    def contains(self, key: str) -> bool:
        """Whether `key` is stored (does not touch the LRU)."""
        _key_bytes(key)
        with self._lock:
            return key in self._index

    def size_of(self, key: str) -> int | None:
        """The value size of `key`, None if absent (does not touch the LRU)."""
        _key_bytes(key)
        with self._lock:
            return self._index.get(key)

    def put(self, key: str, data: bytes | memoryview) -> bool:
        """Store `data` under `key` as the most recently used object (mutates).

        Replaces any older copy and evicts least recently used objects until it fits.
        Returns False, storing nothing and dropping any older copy, if `data` alone exceeds
        the capacity. Raises ConfigError for an invalid key; OSError from the filesystem
        propagates, leaving the older copy in place.
        """
        raw = _key_bytes(key)
        view = memoryview(data).cast("B")
        size = view.nbytes
        with self._lock:
            if size > self._capacity:
                self._drop(key)
                return False
            old = self._index.get(key, 0)
            while self._used - old + size > self._capacity:
                victim = next(k for k in self._index if k != key)
                logger.debug("disk tier evicts %r", victim)
                self._drop(victim)
            self._write(raw, view)
            self._used += size - old
            self._index[key] = size
            self._index.move_to_end(key)
            return True

    def get(self, key: str) -> bytes | None:
        """The value of `key` (crc-checked), marked most recently used; None on a miss."""
        return self._value(key, remove=False)

    def get_into(self, key: str, buffer: bytearray | memoryview) -> int | None:
        """Read the value of `key` into the front of `buffer`, marking it most recently used.

        Returns the value size, or None on a miss (a corrupt file is deleted; its bytes may
        already be in `buffer`). Raises InvalidBufferError if `buffer` is read-only,
        non-contiguous or smaller than the value.
        """
        raw = _key_bytes(key)
        try:
            view = memoryview(buffer).cast("B")
        except TypeError as e:
            raise InvalidBufferError(f"buffer is not a contiguous byte buffer: {e}") from e
        if view.readonly:
            raise InvalidBufferError("buffer is read-only")
        with self._lock:
            size = self._index.get(key)
            if size is None:
                return None
            if view.nbytes < size:
                raise InvalidBufferError(f"buffer of {view.nbytes} bytes is too small for a value of {size}")
            return size if self._read_touch(key, raw, view[:size]) else None

    def pop(self, key: str) -> bytes | None:
        """Get and remove `key` (promotion to memory); None on a miss (mutates)."""
        return self._value(key, remove=True)

    def _value(self, key: str, remove: bool) -> bytes | None:
        """`key`'s checked bytes, then touched (or dropped, with `remove` or when unreadable)."""
        raw = _key_bytes(key)
        with self._lock:
            size = self._index.get(key)
            if size is None:
                return None
            buffer = bytearray(size)
            if remove:
                ok = self._read(key, raw, memoryview(buffer))
                self._drop(key)
            else:
                ok = self._read_touch(key, raw, memoryview(buffer))
            return bytes(buffer) if ok else None

    def remove(self, key: str) -> bool:
        """Delete `key`; False if it was absent (mutates)."""
        _key_bytes(key)
        with self._lock:
            return self._drop(key)

    def check_invariants(self) -> None:
        """Assert the index matches the files (names, sizes), accounting and LRU order."""
        with self._lock:
            names = {_file_name(k.encode("utf-8")): k for k in self._index}
            on_disk = {p.name: p.stat() for p in self._dir.iterdir() if p.name.endswith((_SUFFIX, _TMP_SUFFIX))}
            assert set(on_disk) == set(names), (sorted(on_disk), sorted(names))
            for name, key in names.items():
                assert on_disk[name].st_size == _HEADER.size + len(key.encode("utf-8")) + self._index[key], key
            assert self._used == sum(self._index.values()) <= self._capacity
            # The LRU order is exactly the indexed keys, and the mtimes a restart sorts by agree with it.
            stamps = [on_disk[_file_name(k.encode("utf-8"))].st_mtime_ns for k in self._index]
            assert stamps == sorted(stamps) and all(s <= self._last_stamp_ns for s in stamps)

    # -- internals (called with the lock held) --

    def _drop(self, key: str) -> bool:
        size = self._index.pop(key, None)
        if size is None:
            return False
        self._used -= size
        (self._dir / _file_name(key.encode("utf-8"))).unlink(missing_ok=True)
        return True

    def _stamp(self, path: Path) -> None:
        """Record an access in `path`'s mtime, strictly later than every earlier stamp."""
        stamp = max(int(self._clock.now() * 1e9), self._last_stamp_ns + 1)
        self._last_stamp_ns = stamp
        os.utime(path, ns=(stamp, stamp))

    def _write(self, raw_key: bytes, view: memoryview) -> None:
        header = _HEADER.pack(MAGIC, VERSION, len(raw_key), view.nbytes, zlib.crc32(view))
        fd, tmp = tempfile.mkstemp(dir=self._dir, prefix=".", suffix=_TMP_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(raw_key)
                f.write(view)
                f.flush()
                self._stamp(Path(tmp))  # NOTE: before fsync and rename, so the stamp is durable too
                if self._durable:
                    os.fsync(f.fileno())
            os.replace(tmp, self._dir / _file_name(raw_key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _read_touch(self, key: str, raw_key: bytes, out: memoryview) -> bool:
        """`_read`, then mark `key` most recently used, or drop it if unreadable."""
        if not self._read(key, raw_key, out):
            self._drop(key)
            return False
        self._index.move_to_end(key)
        self._stamp(self._dir / _file_name(raw_key))
        return True

    def _read(self, key: str, raw_key: bytes, out: memoryview) -> bool:
        """Fill `out` (exactly the value's size) from the file of `key`; False (logged) if the
        file is gone or disagrees with the index or its crc."""
        path = self._dir / _file_name(raw_key)
        expected = _HEADER.pack(MAGIC, VERSION, len(raw_key), out.nbytes, 0)[:-4]  # all but the crc
        try:
            with open(path, "rb") as f:
                head = f.read(_HEADER.size + len(raw_key))
                ok = head.startswith(expected) and head.endswith(raw_key) and len(head) == _HEADER.size + len(raw_key)
                ok = ok and f.readinto(out) == out.nbytes and not f.read(1)
        except FileNotFoundError:
            ok = False
        if ok and zlib.crc32(out) == _HEADER.unpack_from(head)[4]:
            return True
        logger.warning("disk tier drops corrupt or missing file %s (key %r)", path.name, key)
        return False

    def _recover(self) -> None:
        """Index the files already in the directory, LRU order from their mtimes."""
        found: list[tuple[int, str, str, int]] = []  # (mtime_ns, file name, key, size)
        for path in self._dir.iterdir():
            if path.name.endswith(_TMP_SUFFIX) and path.is_file():
                logger.info("disk tier deletes leftover temp file %s", path.name)
                path.unlink(missing_ok=True)
            elif path.name.endswith(_SUFFIX) and path.is_file():
                entry = _parse(path)
                if entry is None:
                    logger.warning("disk tier deletes invalid file %s", path.name)
                    path.unlink(missing_ok=True)
                else:
                    found.append((path.stat().st_mtime_ns, path.name, *entry))
        for stamp, _, key, size in sorted(found):
            self._index[key] = size
            self._used += size
            self._last_stamp_ns = max(self._last_stamp_ns, stamp)
        while self._used > self._capacity:
            self._drop(next(iter(self._index)))
        logger.info("disk tier at %s recovered %d objects", self._dir, len(self._index))


def _parse(path: Path) -> tuple[str, int] | None:
    """(key, value size) from a file's header if its magic, version, name and size agree."""
    with open(path, "rb") as f:
        head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            return None
        magic, version, key_len, size, _ = _HEADER.unpack(head)
        if magic != MAGIC or version != VERSION or key_len > MAX_KEY_BYTES:
            return None
        raw_key = f.read(key_len)
    try:
        key = raw_key.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if not key or _file_name(raw_key) != path.name or path.stat().st_size != _HEADER.size + key_len + size:
        return None
    return key, size
