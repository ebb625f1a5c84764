"""`StoreClient`: put and get objects in the KV cache pool.

The master only hands out addresses; this client moves the bytes itself with its Transfer
Engine (tsukimi/store/replica_io.py). A put is put_start (replicas placed) -> WRITE every
replica -> put_end, or put_revoke if any write failed. A get asks for the complete replicas
(a read lease) and READs them in order, failing over to the next replica inside the same
call. The client may contribute a segment of its own memory, heartbeats the master, and
remounts its segments when the master restarted. A holder given a disk directory
(`client.ssd_dir`) also serves the master-tracked disk tier (disk_holder.py); a get of an
object with no readable memory replica reads a disk copy from its holder (disk_server.py).

The API is a batch core with thin single-key helpers: `batch_put` / `put`, `batch_get` /
`get` / `get_into`, `batch_exists` / `exists`, `size_of`, `remove`, `remove_all`; objects
made of several buffers: `batch_put_parts` / `put_parts`, `batch_get_parts`; byte ranges:
`get_ranges` (or `locate` once, then `get_ranges_located`); puts split in steps:
`start_puts` / `write_ranges` / `end_puts` / `revoke_puts`; replica sets and tasks:
`clear_replicas`, `remove_matching`, `describe`, `copy`, `move`, `task`, `wait_task`. A batch
costs one master round trip and one Transfer Engine batch per phase, whatever its size (it is
cut into `MAX_BATCH` operations per round trip). A get's result is a `GetResult`; a miss is
never an error. `AsyncStoreClient` (async_client.py) wraps a client for asyncio.

Values and destinations may be device memory (CUDA tensors, DeviceRanges): `DeviceIO` stages
them through host staging this client allocates from its engine (device_io.py). On a host with
a GPU the contributed segment is pinned for DMA (a failure only logs).

The client owns the connection: the master link, the Transfer Engine, its segment and mounts,
the heartbeat, the disk holder, the task runner. The rest is done by parts it makes in
`__init__`, each given exactly what it needs and keeping no state of its own:

| part                            | does                                                          |
|---------------------------------|---------------------------------------------------------------|
| puts.py `PutPath`               | every put: PutStart -> WRITE -> PutEnd / PutRevoke, waits     |
| parts.py `PartsIO`              | objects made of several buffers (puts through `PutPath`)      |
| ranges.py `RangeReads`          | byte ranges of objects into the caller's buffers              |
| replica_admin.py `ReplicaAdmin` | replica clears, removal by pattern, describe, copy/move tasks |
| device_io.py `DeviceIO`         | device memory (GPU) as put sources / get destinations, staged |

Whole-object gets (a master batch, then replica_io.py) and the metadata calls (one master
call each) stay here. The parts share the client's link, engine and clock; none reads the
client's private state or another part's (PartsIO puts through `PutPath.put`).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import cast

import msgspec

from tsukimi.clock import WallClock
from tsukimi.config import Config
from tsukimi.device import DeviceRange
from tsukimi.device.batch_copy import HostBuffer, HostStaging
from tsukimi.errors import InvalidArgument, InvalidBufferError, ObjectNotFound, ProtocolError, TsukimiError
from tsukimi.store import disk_protocol as dp
from tsukimi.store import protocol as p
from tsukimi.store.device_io import DeviceIO, DevicePut, Part, as_part, has_device, pin_for_gpus
from tsukimi.store.disk import DiskStore
from tsukimi.store.disk_holder import DiskHolder
from tsukimi.store.disk_server import DiskReader
from tsukimi.store.master_batch import call_batch
from tsukimi.store.master_link import MasterLink
from tsukimi.store.parts import PartsIO, PartsPut
from tsukimi.store.puts import OpenPut, PutPath, RangeWrite, Reservation
from tsukimi.store.ranges import Lookup, RangeRead, RangeReads
from tsukimi.store.replica_admin import ReplicaAdmin
from tsukimi.store.replica_io import GetResult, PartsResult, PutItem, read_disk_copies, read_replicas
from tsukimi.store.task_runner import TaskRunner
from tsukimi.transfer import TransferEngine
from tsukimi.transfer.segment import RegisteredBuffer

logger = logging.getLogger(__name__)
WILDCARD_HOSTS = ("0.0.0.0", "::")  # NOTE: no address a peer could connect to

# NOTE: names this process to the master: a holder restarted under the same TE segment name
# mounts with a new incarnation, and the master drops the old one's replicas at once.
INCARNATION = uuid.uuid4().hex

PinName = str  # "", "soft" or "hard"


def _per_item(
    items: Sequence[object], configs: Sequence[p.ReplicaConfig] | None, config: p.ReplicaConfig
) -> list[p.ReplicaConfig]:
    """Each item's config: its own from `configs`, else `config`. Raises InvalidArgument."""
    if configs is None:
        return [config] * len(items)
    if len(configs) != len(items):
        raise InvalidArgument(f"{len(configs)} configs for {len(items)} items: one per item")
    return list(configs)


def replica_config(replicas: int = 1, pin: PinName = "", preferred: Sequence[str] = ()) -> p.ReplicaConfig:
    """Raises InvalidArgument for a bad count or pin."""
    if pin not in ("", "soft", "hard"):
        raise InvalidArgument(f"pin must be '', 'soft' or 'hard', got {pin!r}")
    return p.ReplicaConfig(replicas, pin == "soft", pin == "hard", tuple(preferred))


class StoreClient:
    """A connection to the store. Thread-safe; `close()` when done. Delegates to its parts
    (see the module)."""

    def __init__(self, config: Config | None = None, engine: TransferEngine | None = None) -> None:
        self.config = config or Config()
        cfg = self.config.client
        self.client_id = uuid.uuid4().hex
        self._clock = WallClock()
        self._owns_engine = engine is None
        self.engine = engine or TransferEngine(config=self.config)
        self._link = MasterLink(cfg, p.CODEC, self.config.security.secret())
        self._mounts: list[p.MountSegment] = []
        self._mounts_lock = threading.Lock()  # mount / unmount / the heartbeat's remount, one at a time
        self._segment_base = 0
        self._segment: RegisteredBuffer | None = None
        self._unpin_segment: Callable[[], None] = _nothing
        self.disk: DiskHolder | None = None
        self._disk_reader = DiskReader(cfg.rpc_timeout_s, self.config.security.secret())
        self._stop = threading.Event()
        try:
            if cfg.segment_bytes:
                buf = self._segment = self.engine.allocate(cfg.segment_bytes)
                self._segment_base = buf.base
                self._unpin_segment = pin_for_gpus(buf.view)
                mount = p.MountSegment(
                    self.client_id,
                    f"{self.engine.name}/{buf.base:x}",
                    self.engine.name,
                    buf.base,
                    buf.length,
                    INCARNATION,
                )
                self._call(mount)
                self._mounts.append(mount)
            self._call(p.Heartbeat(self.client_id))
            if cfg.ssd_dir:
                self.disk = self._start_disk(DiskStore(cfg.ssd_dir, cfg.ssd_bytes, cfg.ssd_verify))
        except BaseException:
            self._close_transport()
            raise
        self._tasks = TaskRunner(self.engine, self._link, self.client_id, self.config.transfer.timeout_s)
        self._puts = PutPath(self.client_id, self._link, self.engine, self._clock, cfg)
        self._staging = HostStaging(self._staging_buffer)
        self.device = DeviceIO(self._staging)
        self._parts = PartsIO(
            self._puts, self.device, self._link, self.engine, self._clock, self._disk_reader, cfg.checksum
        )
        self._ranges = RangeReads(self._link, self.engine, self._clock)
        self._replicas = ReplicaAdmin(self._link, self._clock)
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="tsukimi-store-heartbeat", daemon=True)
        self._heartbeat.start()

    def _start_disk(self, store: DiskStore) -> DiskHolder:
        """Serve `store` as this holder's disk (closes it on failure)."""
        try:
            host = self.config.transfer.bind_hosts[0]
            return DiskHolder(
                self.client_id,
                store,
                self._link,
                self.engine,
                self._local_view,
                host=host,
                poll_s=self.config.client.disk_poll_s,
                secret=self.config.security.secret(),
            )
        except BaseException:
            store.close()
            raise

    def _staging_buffer(self, nbytes: int) -> HostBuffer:
        """Host staging for device bytes: this engine's shared memory, registered, so the
        pool's transports move it as any registered buffer (device_io.py)."""
        buf = self.engine.allocate(nbytes)
        return HostBuffer(buf.view, lambda: self.engine.unregister(buf.base))

    def _local_view(self, address: int, size: int) -> memoryview | None:
        """This holder's segment memory at [address, address + size), or None (pure)."""
        buf = self._segment
        if buf is None or not buf.base <= address <= address + size <= buf.base + buf.length:
            return None
        return memoryview(buf.view)[address - buf.base : address - buf.base + size]

    @property
    def disk_reads(self) -> int:
        """Objects this client read from a holder's disk (Mooncake's offload RPC read count)."""
        return self._disk_reader.num_reads

    @classmethod
    def connect(
        cls,
        master: str = "tcp://127.0.0.1:50051",
        segment_bytes: int = 0,
        config: Config | None = None,
        transfer_host: str = "",
    ) -> StoreClient:
        """A client of the master at `master`, contributing `segment_bytes` of shared memory;
        its Transfer Engine serves peers on `transfer_host` ("" or a wildcard: the config's
        `transfer.bind_host`), e.g. a worker's own address when workers sit on several hosts."""
        base = config or Config()
        if transfer_host and transfer_host not in WILDCARD_HOSTS:
            base = replace(base, transfer=replace(base.transfer, bind_host=transfer_host))
        return cls(replace(base, client=replace(base.client, master=master, segment_bytes=segment_bytes)))

    # -- writes ------------------------------------------------------------------------

    def put(
        self,
        key: str,
        data: object,
        replicas: int = 1,
        pin: PinName = "",
        preferred: Sequence[str] = (),
        *,
        upsert: bool = False,
        config: p.ReplicaConfig | None = None,
    ) -> None:
        """Store `data` (any buffer; written from it, zero-copy) under `key`; with `upsert`,
        replacing any object of that key. `config`, when given, replaces `replicas`, `pin`
        and `preferred` (soft pin TTLs, keeping a soft pin across an upsert).

        Raises:
            ObjectExists (not upsert), OutOfSpace, TransferError (a replica write failed; the
            put was revoked), InvalidArgument, RpcTimeout / MasterUnavailable.
        """
        self._raise(self.batch_put([(key, data)], replicas, pin, preferred, upsert=upsert, config=config)[0])

    def put_parts(
        self,
        key: str,
        parts: Sequence[object],
        replicas: int = 1,
        pin: PinName = "",
        preferred: Sequence[str] = (),
        *,
        upsert: bool = False,
        config: p.ReplicaConfig | None = None,
    ) -> None:
        """`put` of the concatenation of `parts` (buffers), each written from its own buffer
        (parts.py). Raises as `put`; InvalidBufferError for a part that is no buffer, or none."""
        config = config or replica_config(replicas, pin, preferred)
        self._raise(self.batch_put_parts([(key, parts)], config, upsert=upsert)[0])

    def batch_put(
        self,
        items: Sequence[tuple[str, object]],
        replicas: int = 1,
        pin: PinName = "",
        preferred: Sequence[str] = (),
        *,
        upsert: bool = False,
        config: p.ReplicaConfig | None = None,
        configs: Sequence[p.ReplicaConfig] | None = None,
    ) -> list[TsukimiError | None]:
        """Put several objects; each key's error, or None where it succeeded. A value may be
        device memory (a CUDA tensor, EmulatedMemory, a DeviceRange: staged, device_io.py).
        `configs`, when given, is each item's own config (e.g. its replica group), replacing
        the others. Raises only for the whole call (InvalidArgument, also for `configs` of
        another length than `items`; RpcTimeout / MasterUnavailable; DeviceError: a device
        copy failed)."""
        each = _per_item(items, configs, config or replica_config(replicas, pin, preferred))
        parts = [as_part(data) for _, data in items]
        if has_device(parts):
            puts = [DevicePut(key, (part,), c, upsert) for (key, _), part, c in zip(items, parts, each, strict=True)]
            return self.device.put(puts, self._puts.put)
        views = cast(list[memoryview], parts)
        host = [PutItem(key, (v,), c, upsert) for (key, _), v, c in zip(items, views, each, strict=True)]
        return self._puts.put(host)

    def start_puts(self, reservations: Sequence[Reservation]) -> list[OpenPut | TsukimiError]:
        """Start puts without their bytes; each an OpenPut to `write_ranges` into and then
        `end_puts` or `revoke_puts` within `master.put_timeout_s` (`PutPath.start`, puts.py),
        or its error. Raises only for the whole call (RpcTimeout / MasterUnavailable)."""
        return self._puts.start(reservations)

    def write_ranges(self, writes: Sequence[RangeWrite]) -> list[TsukimiError | None]:
        """WRITE byte ranges into every replica of open puts, in one Transfer Engine batch
        (`PutPath.write`); each write's error, or None. Device sources are staged (DeviceIO:
        one device->host copy per staged group). Raises DeviceError (a device copy failed)."""
        parts = [_part_or_empty(w.source, writable=False) for w in writes]
        if not has_device(parts):
            return self._puts.write(writes)
        staged = iter(range(len(writes)))

        def write_host(items: list[PutItem]) -> list[TsukimiError | None]:
            # NOTE: DeviceIO hands back its items in order, group by group, their device parts staged
            ranges = []
            for item in items:
                w = writes[next(staged)]
                ranges.append(RangeWrite(w.put, w.offset, item.parts[0] if len(item.parts[0]) else w.source))
            return self._puts.write(ranges)

        config = p.ReplicaConfig()  # NOTE: DeviceIO carries it along; the puts are started already
        return self.device.put(
            [DevicePut(w.put.key, (part,), config, False) for w, part in zip(writes, parts, strict=True)], write_host
        )

    def end_puts(self, puts: Sequence[OpenPut]) -> list[TsukimiError | None]:
        """PutEnd for open puts (they become readable); each one's error, or None. Raises
        only for the whole call."""
        return self._puts.end(puts)

    def revoke_puts(self, puts: Sequence[OpenPut]) -> list[TsukimiError | None]:
        """PutRevoke for open puts; each one's error, or None. Raises only for the whole call."""
        return self._puts.revoke(puts)

    def batch_put_parts(
        self,
        items: Sequence[PartsPut],
        config: p.ReplicaConfig | None = None,
        *,
        upsert: bool = False,
        configs: Sequence[p.ReplicaConfig] | None = None,
    ) -> list[TsukimiError | None]:
        """Put each key as the concatenation of its buffers, zero-copy (`PartsIO.batch_put_parts`,
        parts.py); `config` defaults to one replica, no pins; `configs`, when given, is each
        item's own (as `batch_put`). Each key's error, or None."""
        each = _per_item(items, configs, config or p.ReplicaConfig())
        return self._parts.batch_put_parts(items, upsert=upsert, configs=each)

    # -- reads -------------------------------------------------------------------------

    def get(self, key: str) -> bytearray | None:
        """The object's bytes (a new bytearray: read in place, never copied again), or None
        on a miss. Raises TransferError / ChecksumMismatch when no replica was readable."""
        data = self.batch_get([key])[0].value()
        assert data is None or isinstance(data, bytearray)
        return data

    def get_into(self, key: str, buffer: object) -> int | None:
        """Read the object into `buffer` (any writable buffer, or device memory); its size, or
        None on a miss. Raises InvalidBufferError if it does not fit, TransferError if no
        replica is readable."""
        result = self.batch_get([key], [buffer])[0]
        self._raise(result.error)
        return result.size if result.found else None

    def batch_get(
        self,
        keys: Sequence[str],
        into: Sequence[object] | None = None,
        *,
        allocate: Callable[[int], bytearray] = bytearray,
    ) -> list[GetResult]:
        """Each key's `GetResult`, read into `into[i]` when given (zero-copy into your
        memory; device memory, e.g. a CUDA tensor, is staged: device_io.py, and its result
        says `device`), else into a new `allocate(size)` (a bytearray or a subclass of it).
        Raises only for the whole call (InvalidArgument: a buffer count that does not match;
        RpcTimeout / MasterUnavailable; DeviceError: a device copy failed)."""
        if into is not None and len(into) != len(keys):
            raise InvalidArgument(f"{len(keys)} keys but {len(into)} buffers")
        if into is None:
            return self._get_host(keys, None, allocate)
        parts = [as_part(b, writable=True) for b in into]
        if not has_device(parts):
            return self._get_host(keys, cast(list[memoryview], parts), allocate)
        results = self.device.get(
            [(part,) for part in parts],
            lambda group, views: self._get_host([keys[i] for i in group], [v[0] for v in views], allocate),
            lambda r: r.size if r.found and r.error is None else None,
        )
        return [
            GetResult(device=part.sub(0, r.size)) if isinstance(part, DeviceRange) and r.found else r
            for part, r in zip(parts, results, strict=True)
        ]

    def _get_host(
        self, keys: Sequence[str], views: list[memoryview] | None, allocate: Callable[[int], bytearray]
    ) -> list[GetResult]:
        results: list[GetResult] = []
        for start in range(0, len(keys), p.MAX_BATCH):
            chunk = list(keys[start : start + p.MAX_BATCH])
            found = call_batch(self._link, [p.GetReplicas(k) for k in chunk])
            dests = None if views is None else views[start : start + p.MAX_BATCH]
            checksum = self.config.client.checksum
            got = read_replicas(self.engine, self._clock, chunk, found, dests, checksum, allocate)
            results += read_disk_copies(self._disk_reader, chunk, found, dests, got, checksum, allocate)
        return results

    def batch_get_parts(self, keys: Sequence[str], into: Sequence[Sequence[object]]) -> list[PartsResult]:
        """Read each object into its writable buffers `into[i]`, in order; each key's
        `PartsResult` (`PartsIO.batch_get_parts`, parts.py). Raises InvalidBufferError for a
        list of buffers per key that does not match `keys`; RpcTimeout / MasterUnavailable."""
        return self._parts.batch_get_parts(keys, into)

    def get_ranges(self, reads: Sequence[RangeRead]) -> list[GetResult]:
        """Read byte ranges of objects straight into each read's `dest`; each read's
        `GetResult`, in order (`RangeReads.get_ranges`, ranges.py). Raises only for the whole
        call (RpcTimeout / MasterUnavailable)."""
        return self._ranges.get_ranges(reads)

    def locate(self, keys: Sequence[str]) -> list[Lookup]:
        """Each key's replicas under a read lease, for `get_ranges_located` (`RangeReads.locate`,
        ranges.py): a `Located`, the key's error, or None on a miss. Raises only for the
        whole call (RpcTimeout / MasterUnavailable)."""
        return self._ranges.locate(keys)

    def get_ranges_located(self, reads: Sequence[RangeRead], located: Mapping[str, Lookup]) -> list[GetResult]:
        """`get_ranges` from replicas `locate` found (no master round trip); the caller checks
        `Located.expired` first. Each read's `GetResult`, in order; a read into device memory
        is staged (DeviceIO: one host->device copy per staged group) and its result holds
        `device`. Raises DeviceError (a device copy failed)."""
        parts = [_part_or_empty(r.dest, writable=True) for r in reads]
        if not has_device(parts):
            return self._ranges.get_ranges(reads, located)

        def read_host(group: list[int], views: list[tuple[memoryview, ...]]) -> list[GetResult]:
            ranges = [
                RangeRead(reads[i].key, reads[i].offset, v[0] if len(v[0]) else reads[i].dest)
                for i, v in zip(group, views, strict=True)
            ]
            return self._ranges.get_ranges(ranges, located)

        results = self.device.get(
            [(part,) for part in parts], read_host, lambda r: r.size if r.found and r.error is None else None
        )
        return [
            GetResult(device=part) if isinstance(part, DeviceRange) and r.found else r
            for part, r in zip(parts, results, strict=True)
        ]

    # -- metadata ----------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        """Whether a complete object exists, in memory or on a holder's disk (grants no lease)."""
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key exists: one master round trip per MAX_BATCH keys (grants no
        lease). Raises InvalidArgument for a bad key (the whole call), RpcTimeout /
        MasterUnavailable."""
        out: list[bool] = []
        for start in range(0, len(keys), p.MAX_BATCH):
            chunk = list(keys[start : start + p.MAX_BATCH])
            found = self._link.call_as(p.ExistsMany(chunk), p.ExistsManyResult).exists
            if len(found) != len(chunk):
                raise ProtocolError(f"the master answered {len(found)} of {len(chunk)} keys")
            out += found
        return out

    def size_of(self, key: str) -> int | None:
        """The size of a complete object, or None (grants no lease)."""
        try:
            info = self._link.call_as(p.QueryKey(key), p.ObjectInfo)
        except ObjectNotFound:
            return None
        return info.size if info.complete else None

    def remove(self, key: str, force: bool = False) -> bool:
        """Remove an object (its disk copies too); False if there was none. Raises LeaseHeld
        while readers hold it."""
        try:
            self._call(p.Remove(key, force))
        except ObjectNotFound:
            return False
        return True

    def remove_all(self, force: bool = False) -> int:
        """Remove every object from the pool (disk copies too); returns how many."""
        result = self._call(p.RemoveAll(force))
        assert isinstance(result, p.RemoveAllResult)
        return result.removed

    # -- replica sets and tasks (replica_admin.py) --------------------------------------

    def clear_replicas(self, keys: Sequence[str], te_segment: str = "") -> list[str]:
        """Drop the replicas (all, or those on TE segment `te_segment`) of those `keys` whose
        read leases have ended; the keys cleared. Raises InvalidArgument (a bad key: nothing
        cleared), RpcTimeout / MasterUnavailable. See `ReplicaAdmin.clear_replicas`."""
        return self._replicas.clear_replicas(keys, te_segment)

    def remove_matching(self, pattern: str, force: bool = False) -> int:
        """Remove every object whose key matches the regular expression `pattern`; how many.
        Raises InvalidArgument (not a regular expression). See `ReplicaAdmin.remove_matching`."""
        return self._replicas.remove_matching(pattern, force)

    def describe(self, keys: Sequence[str]) -> list[p.ObjectInfo | None]:
        """What the master knows of each key, or None; grants no lease. Raises InvalidArgument."""
        return self._replicas.describe(keys)

    def copy(self, key: str, targets: Sequence[str]) -> int:
        """Start copying `key` onto the TE segments `targets`; the task's id. Raises
        InvalidArgument, ObjectNotFound, TaskInFlight, OutOfSpace (`ReplicaAdmin.copy`)."""
        return self._replicas.copy(key, targets)

    def move(self, key: str, source: str, target: str) -> int:
        """Start moving the replica of `key` on TE segment `source` to `target`; the task's
        id. Raises as `copy` (`ReplicaAdmin.move`)."""
        return self._replicas.move(key, source, target)

    def task(self, task_id: int) -> p.TaskInfo:
        """A task's state. Raises TaskNotFound (unknown, or forgotten after many others)."""
        return self._replicas.task(task_id)

    def wait_task(self, task_id: int, timeout_s: float = 30.0) -> p.TaskInfo:
        """Poll a task until it has succeeded or failed; its final state. Raises
        TaskNotFound, RpcTimeout (still in flight after `timeout_s`), InvalidArgument."""
        return self._replicas.wait_task(task_id, timeout_s)

    # -- segments mounted after the start ----------------------------------------------

    def mount(self, base: int, size: int) -> str:
        """Contribute [base, base + size) of this client's engine memory (registered already)
        as another segment; its segment id. Remounted after a master restart, unmounted at
        close, like the segment of `client.segment_bytes`.

        Raises:
            InvalidArgument (too small, bad base), ObjectExists (mounted with other
            parameters), RpcTimeout / MasterUnavailable.
        """
        mount = p.MountSegment(
            self.client_id, f"{self.engine.name}/{base:x}", self.engine.name, base, size, INCARNATION
        )
        with self._mounts_lock:
            self._call(mount)
            # NOTE: a new list, not append: close() iterates the old one unlocked
            self._mounts = [*self._mounts, mount]
        return mount.segment_id

    def unmount(self, segment_id: str) -> None:
        """Withdraw a segment `mount` added: the master drops the replicas in it at once (an
        object left with none is gone). The memory stays the caller's to free.

        Raises:
            ObjectNotFound (not a segment `mount` added, or unmounted already),
            RpcTimeout / MasterUnavailable.
        """
        first = f"{self.engine.name}/{self._segment_base:x}" if self._segment else ""
        with self._mounts_lock:
            if segment_id == first or segment_id not in {m.segment_id for m in self._mounts}:
                raise ObjectNotFound(f"this client mounted no segment {segment_id!r} after its start")
            before = self._mounts
            # NOTE: out of the remount list before the call: a remount must never bring it back
            self._mounts = [m for m in before if m.segment_id != segment_id]
            try:
                self._call(p.UnmountSegment(self.client_id, segment_id))
            except BaseException:
                self._mounts = before
                raise

    def unmount_disk(self, grace_s: float = 0.0) -> bool:
        """Withdraw this holder's disk tier: the master forgets its copies at once (readers
        get a clean miss), reads already in flight get `grace_s` seconds to finish, then the
        disk stops serving and is released. False when this client serves no disk.

        Raises:
            InvalidArgument (negative grace), RpcTimeout / MasterUnavailable (the disk still serves).
        """
        if grace_s < 0:
            raise InvalidArgument(f"grace_s must be >= 0, got {grace_s}")
        disk = self.disk
        if disk is None:
            return False
        self._link.call(dp.UnmountDisk(self.client_id, disk.store.disk_id))
        self.disk = None
        self._stop.wait(grace_s)
        disk.close()  # NOTE: its own UnmountDisk then fails, logged at info only
        return True

    # -- plumbing ----------------------------------------------------------------------

    def _call(self, request: msgspec.Struct) -> msgspec.Struct:
        return self._link.call(request)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.config.client.heartbeat_interval_s):
            try:
                beat = self._link.call_as(p.Heartbeat(self.client_id), p.HeartbeatResult, self._heartbeat_s())
                if beat.tasks:
                    self._tasks.submit(beat.tasks)
                if not beat.known and self._mounts:  # the master restarted: mount again
                    with self._mounts_lock:
                        logger.warning("the master lost this client; remounting %d segments", len(self._mounts))
                        for mount in self._mounts:
                            self._call(mount)
            except TsukimiError as exc:
                logger.warning("heartbeat to %s failed: %s", self.config.client.master, exc)

    def _heartbeat_s(self) -> float:
        """How long one heartbeat waits for a master: a heartbeat interval (at least 0.2 s)."""
        return max(0.2, self.config.client.heartbeat_interval_s)

    @staticmethod
    def _raise(error: TsukimiError | None) -> None:
        if error is not None:
            raise error

    def _close_transport(self) -> None:
        self._unpin_segment()
        self._unpin_segment = _nothing
        self._disk_reader.close()
        self._link.close()
        if self._owns_engine:
            self.engine.close()
        elif self._segment_base:  # a shared engine lives on: give our segment back
            self.engine.unregister(self._segment_base)

    def close(self) -> None:
        """Unmount this client's segments (best effort), stop heartbeats, close the engine."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._heartbeat.join(timeout=self.config.client.heartbeat_interval_s + self.config.client.rpc_timeout_s)
        self._tasks.close()
        self._staging.close()
        if self.disk is not None:
            self.disk.close()
        for mount in self._mounts:
            try:
                self._call(p.UnmountSegment(self.client_id, mount.segment_id))
            except TsukimiError as exc:
                logger.info("unmounting %s: %s", mount.segment_id, exc)
        self._close_transport()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _nothing() -> None:
    return None


def _part_or_empty(data: object, writable: bool) -> Part:
    """`as_part(data)`, or an empty view for what is no buffer at all (the host path then
    answers that range with its InvalidBufferError). Pure."""
    try:
        return as_part(data, writable)
    except InvalidBufferError:
        return memoryview(b"")
