"""A holder's disk directory: one file per version of an object, for the master-tracked disk
tier (the master decides what is written, read and deleted: tsukimi/store/master/tiers.py).

A version is (key, put id): the put id of the put that wrote the object. Files are named by
the sha256 of the key and the put id, in 256 subdirectories, so two versions of a key never
share a file and a reader asking for one version can never get another:

    DIR/.lock          flock: one process per directory
    DIR/disk-id        this directory's id (random, made once): the master knows it by it
    DIR/ab/<sha256(key)>-<put id hex>.obj

File layout (little-endian):

    0      4      6         10        18       26       30            30+K      30+K+V
    | magic | ver | key_len | val_len | put_id | crc32c | key (UTF-8) | value   |
      TSKD    u16   u32 (K)   u64 (V)   u64      u32      K bytes       V bytes

A file is written to a temp file and renamed (atomic), without fsync: this is a cache, and
`scan` at start drops torn or corrupt files (crc32c checked when `verify`) and leftovers.
Capacity counts value bytes; a write that does not fit is refused (the master keeps its own
accounting and evicts, so this is a backstop). Thread-safe.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import struct
import tempfile
import threading
import uuid
from pathlib import Path

import crc32c

from tsukimi.errors import ChecksumMismatch, ConfigError, ObjectNotFound, OutOfSpace
from tsukimi.store.disk_protocol import DiskFile
from tsukimi.store.protocol import check_key

logger = logging.getLogger(__name__)

MAGIC = b"TSKD"
VERSION = 2
_HEADER = struct.Struct("<4sHIQQI")
_SUFFIX = ".obj"
_TMP_SUFFIX = ".tmp"
_CHUNK = 4 << 20

Version = tuple[str, int]  # (key, put id)


def file_name(key: str, put_id: int) -> str:
    """`ab/<sha256 hex>-<put id hex>.obj`: the file of one version, relative to the directory."""
    digest = hashlib.sha256(key.encode()).hexdigest()
    return f"{digest[:2]}/{digest}-{put_id:016x}{_SUFFIX}"


class DiskStore:
    """The files of one disk directory, indexed in memory: (key, put id) -> (size, crc32c)."""

    def __init__(self, directory: str | Path, capacity_bytes: int, verify: bool = True) -> None:
        """Open (creating if needed) `directory`, lock it, and index the files in it (see `scan`).

        Raises:
            ConfigError: capacity_bytes <= 0, or another process has the directory.
        """
        if capacity_bytes <= 0:
            raise ConfigError(f"the disk capacity must be > 0, got {capacity_bytes}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.directory / ".lock", "a+b")  # noqa: SIM115 (held until close)
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            self._lock_file.close()
            raise ConfigError(f"disk directory {self.directory} is in use by another process") from exc
        self.capacity_bytes = capacity_bytes
        self.disk_id = self._disk_id()
        self._lock = threading.Lock()
        self._index: dict[Version, tuple[int, int]] = {}
        self._used = 0
        self.scan(verify)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def files(self) -> list[DiskFile]:
        """What the directory holds (pure)."""
        with self._lock:
            return [DiskFile(key, put_id, size, crc) for (key, put_id), (size, crc) in self._index.items()]

    def info(self, key: str, put_id: int) -> tuple[int, int] | None:
        """(size, crc32c) of a version, or None (pure)."""
        with self._lock:
            return self._index.get((key, put_id))

    def write(self, key: str, put_id: int, data: memoryview) -> int:
        """Store `data` as version `put_id` of `key` (replacing the same version); its crc32c.

        Raises:
            OutOfSpace: it does not fit in the capacity.
            OSError: from the filesystem (nothing is stored).
        """
        check_key(key)
        size = data.nbytes
        with self._lock:
            old = self._index.pop((key, put_id), None)
            self._used -= old[0] if old else 0
            if self._used + size > self.capacity_bytes:
                raise OutOfSpace(
                    f"disk {self.disk_id}: {size} bytes do not fit ({self._used} of {self.capacity_bytes} used)"
                )
            self._used += size  # NOTE: reserved while the file is written
        try:
            crc = self._write_file(key, put_id, data)
        except BaseException:
            with self._lock:
                self._used -= size
            raise
        with self._lock:
            self._index[(key, put_id)] = (size, crc)
        return crc

    def read_into(self, key: str, put_id: int, offset: int, out: memoryview) -> tuple[int, int]:
        """Fill `out` from byte `offset` of the version's value; its (size, crc32c).

        Raises:
            ObjectNotFound: no such version here (or it is shorter than offset + len(out)).
        """
        found = self.info(key, put_id)
        if found is None or offset < 0 or offset + out.nbytes > found[0]:
            raise ObjectNotFound(f"disk {self.disk_id} has no version {put_id:x} of {key!r} (at {offset})")
        start = _HEADER.size + len(key.encode()) + offset
        try:
            with open(self.directory / file_name(key, put_id), "rb", buffering=0) as f:
                f.seek(start)
                got = 0
                while got < out.nbytes:
                    n = f.readinto(out[got:])
                    if not n:
                        break
                    got += n
        except FileNotFoundError as exc:
            raise ObjectNotFound(f"version {put_id:x} of {key!r} was deleted from disk {self.disk_id}") from exc
        if got != out.nbytes:
            raise ObjectNotFound(f"the file of {key!r} on disk {self.disk_id} is truncated")
        return found

    def read_checked(self, key: str, put_id: int, out: memoryview) -> None:
        """Fill `out` (exactly the value's size) with the whole value and check its crc32c.

        Raises:
            ObjectNotFound: no such version here, or `out` is not its size.
            ChecksumMismatch: the file is corrupt (it is deleted).
        """
        _, crc = self.read_into(key, put_id, 0, out)
        if self.info(key, put_id) != (out.nbytes, crc):
            raise ObjectNotFound(f"{key!r} is not {out.nbytes} bytes on disk {self.disk_id}")
        if crc32c.crc32c(out) != crc:
            self.delete(key, put_id)
            raise ChecksumMismatch(f"the file of {key!r} on disk {self.disk_id} is corrupt (deleted)")

    def delete(self, key: str, put_id: int) -> bool:
        """Delete a version; False if it was not here (mutates)."""
        with self._lock:
            found = self._index.pop((key, put_id), None)
            if found is None:
                return False
            self._used -= found[0]
        (self.directory / file_name(key, put_id)).unlink(missing_ok=True)
        return True

    def scan(self, verify: bool) -> None:
        """Index the files in the directory, deleting temp files and files whose name, header
        or size disagree (and, with `verify`, whose crc32c does). Mutates."""
        index: dict[Version, tuple[int, int]] = {}
        for path in sorted(self.directory.glob("??/*")):
            entry = _check(path, verify) if path.name.endswith(_SUFFIX) else None
            if entry is None:
                logger.warning("disk %s deletes invalid or leftover file %s", self.disk_id, path.name)
                path.unlink(missing_ok=True)
            else:
                key, put_id, size, crc = entry
                index[(key, put_id)] = (size, crc)
        with self._lock:
            self._index = index
            self._used = sum(size for size, _ in index.values())
        logger.info("disk %s at %s holds %d objects, %d bytes", self.disk_id, self.directory, len(index), self._used)

    def close(self) -> None:
        """Release the directory (idempotent)."""
        if not self._lock_file.closed:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()

    def _disk_id(self) -> str:
        path = self.directory / "disk-id"
        try:
            found = path.read_text().strip()
        except FileNotFoundError:
            found = ""
        if not found:
            found = uuid.uuid4().hex
            path.write_text(found + "\n")
        return found

    def _write_file(self, key: str, put_id: int, data: memoryview) -> int:
        raw = key.encode()
        crc = crc32c.crc32c(data)
        target = self.directory / file_name(key, put_id)
        target.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".", suffix=_TMP_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_HEADER.pack(MAGIC, VERSION, len(raw), data.nbytes, put_id, crc) + raw)
                f.write(data)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return crc


def _check(path: Path, verify: bool) -> tuple[str, int, int, int] | None:
    """(key, put id, size, crc32c) of a file whose header, name and size agree (and crc32c,
    with `verify`); None otherwise."""
    try:
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
            if len(head) < _HEADER.size:
                return None
            magic, version, key_len, size, put_id, crc = _HEADER.unpack(head)
            if magic != MAGIC or version != VERSION or key_len > 4096:
                return None
            key = f.read(key_len).decode()
            if file_name(key, put_id) != f"{path.parent.name}/{path.name}":
                return None
            if path.stat().st_size != _HEADER.size + key_len + size:
                return None
            if verify:
                value = 0
                while chunk := f.read(_CHUNK):
                    value = crc32c.crc32c(chunk, value)
                if value != crc:
                    return None
    except (OSError, UnicodeDecodeError):
        return None
    return key, put_id, size, crc
