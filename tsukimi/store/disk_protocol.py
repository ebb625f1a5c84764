"""The disk tier's boundary types: the master operations of holders with a disk directory,
the tasks the master hands them, and the holder's own disk server's messages (`DISK_CODEC`).

The master tracks every disk copy (tsukimi/store/master/tiers.py) and hands out work through
`DiskSync`, which a disk holder polls: it reports the tasks it finished and takes new ones.
A copy is one *version* of an object, named by the put id of the put that wrote it, so a
copy of an older version is never taken for the current one. Readers read a copy from the
holder's disk server (`ReadDisk`, tsukimi/store/disk_server.py) in chunks of at most
`MAX_READ_BYTES`.

    holder                         master                              reader
    DiskSync(done) ------------->  [OffloadTask(key, put_id, address)]
    copy own memory -> file
    DiskSync([ok, crc32c]) ----->  record the copy; free the memory
                                   <------------- GetReplicas(key)
                                   DiskLocation(endpoint, put_id) ----------->
    ReadDisk(key, put_id, offset, length)  <-------------------------------------
"""

from __future__ import annotations

import msgspec

from tsukimi.rpc.codec import Codec

MAX_READ_BYTES = 16 << 20


class DiskLocation(msgspec.Struct, frozen=True):
    """A copy of version `put_id` of an object on a holder's disk `disk_id`, served by the
    holder's disk server at `endpoint` (tcp://HOST:PORT)."""

    endpoint: str
    disk_id: str
    put_id: int
    size: int


class DiskFile(msgspec.Struct, frozen=True, array_like=True):
    """One object file a holder's disk holds (checked: header, size and crc32c agree)."""

    key: str
    put_id: int
    size: int
    checksum: int


# -- master operations ----------------------------------------------------------------------


class MountDisk(msgspec.Struct, frozen=True, tag=True):
    """A client offers its disk directory `disk_id` (stable across its restarts) of
    `capacity_bytes`, served at `endpoint`. A client has at most one disk."""

    client_id: str
    disk_id: str
    endpoint: str
    capacity_bytes: int


class UnmountDisk(msgspec.Struct, frozen=True, tag=True):
    """The client stops serving its disk: its copies are forgotten (an object whose only
    copy it was is gone) until the disk is mounted and its files registered again."""

    client_id: str
    disk_id: str


class RegisterDiskFiles(msgspec.Struct, frozen=True, tag=True):
    """The files a (re)mounted disk still holds, in chunks of at most MAX_BATCH; `last` ends
    the registration. The result says which the master accepted: the holder deletes the rest."""

    client_id: str
    disk_id: str
    files: list[DiskFile]
    last: bool = True


class TaskResult(msgspec.Struct, frozen=True):
    """How a disk task ended on the holder: `checksum` (an offload's crc32c of the bytes it
    wrote) and `elapsed_s` (the time it took: the tiers' bandwidth metrics)."""

    task_id: int
    ok: bool
    message: str = ""
    checksum: int | None = None
    elapsed_s: float = 0.0


class DiskSync(msgspec.Struct, frozen=True, tag=True):
    """A disk holder's poll: the results of the tasks it finished, and up to `max_tasks` new ones."""

    client_id: str
    disk_id: str
    done: list[TaskResult] = []
    max_tasks: int = 64


class MasterInfo(msgspec.Struct, frozen=True, tag=True):
    """What a client needs to know of the master's configuration (the disk tier's)."""


# -- results ----------------------------------------------------------------------------------


class OffloadTask(msgspec.Struct, frozen=True, tag=True):
    """Copy the memory replica at `address` (in this holder's own segment) to the disk as
    version `put_id` of `key`, within `timeout_s` of receiving the task."""

    task_id: int
    key: str
    put_id: int
    size: int
    address: int
    timeout_s: float


class PromoteTask(msgspec.Struct, frozen=True, tag=True):
    """Copy version `put_id` of `key` from the disk into the block at `address` of TE segment
    `te_segment`, within `timeout_s` of receiving the task."""

    task_id: int
    key: str
    put_id: int
    size: int
    te_segment: str
    address: int
    timeout_s: float


class DeleteTask(msgspec.Struct, frozen=True, tag=True):
    """Delete version `put_id` of `key` from the disk (a no-op if it is not there)."""

    task_id: int
    key: str
    put_id: int


DiskTask = OffloadTask | PromoteTask | DeleteTask


class DiskSyncResult(msgspec.Struct, frozen=True, tag=True):
    """`known`: False when the master does not know this disk (it restarted, or dropped the
    client): mount it again and register its files."""

    known: bool
    tasks: list[DiskTask] = []


class DiskFilesResult(msgspec.Struct, frozen=True, tag=True):
    accepted: list[bool]


class MasterInfoResult(msgspec.Struct, frozen=True, tag=True):
    """`offload`: the disk tier's mode ("off", "on_evict", "on_put"); `disk_root`: where a
    client told to use a disk but given no directory keeps it ("": none)."""

    offload: str
    disk_root: str = ""


DISK_REQUESTS: tuple[type[msgspec.Struct], ...] = (MountDisk, UnmountDisk, RegisterDiskFiles, DiskSync, MasterInfo)
DISK_RESULTS: tuple[type[msgspec.Struct], ...] = (DiskSyncResult, DiskFilesResult, MasterInfoResult)


# -- the holder's disk server ---------------------------------------------------------------


class ReadDisk(msgspec.Struct, frozen=True, tag=True):
    """`length` bytes (at most MAX_READ_BYTES) at `offset` of version `put_id` of `key`."""

    key: str
    put_id: int
    offset: int
    length: int


class DiskData(msgspec.Struct, frozen=True, tag=True):
    """The bytes asked for, and the crc32c of the whole value (checked by the reader)."""

    data: bytes
    checksum: int


DISK_CODEC = Codec((ReadDisk,), (DiskData,), max_frame_bytes=MAX_READ_BYTES + (1 << 20))
"""The codec of a holder's disk server."""
