"""`StoreClient`: put and get objects in the KV cache pool.

The master only hands out addresses; this client moves the bytes itself with its Transfer
Engine (shm to holders on this host, tcp to others). A put is put_start (replicas placed) ->
WRITE every replica -> put_end, or put_revoke if any write failed. A get asks for the complete
replicas (a read lease) and READs them in order, failing over to the next replica inside the
same call. The client may contribute a segment of its own memory, heartbeats the master, and
remounts its segments when the master restarted. Batch calls cost one master round trip and
one Transfer Engine batch per phase.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace

import crc32c
import msgspec

from tsukimi.clock import WallClock
from tsukimi.config import Config
from tsukimi.errors import (
    ChecksumMismatch,
    InvalidArgument,
    InvalidBufferError,
    ObjectExists,
    ObjectNotFound,
    TransferError,
    TsukimiError,
    error_from_code,
)
from tsukimi.store import protocol as p
from tsukimi.store.disk import DiskTier
from tsukimi.store.master_link import MasterLink
from tsukimi.transfer import OpCode, RequestState, TransferEngine, TransferRequest
from tsukimi.transfer.segment import byte_view

logger = logging.getLogger(__name__)

LEASE_SHARE = 0.8  # reads must end within this share of the read lease
MIN_READ_S = 0.05
# NOTE: names this process to the master: a holder restarted under the same TE segment name
# mounts with a new incarnation, and the master drops the old one's replicas at once.
INCARNATION = uuid.uuid4().hex

PinName = str  # "", "soft" or "hard"


@dataclass(frozen=True, slots=True)
class _Put:
    key: str
    data: memoryview
    config: p.ReplicaConfig
    upsert: bool


def replica_config(replicas: int = 1, pin: PinName = "", preferred: Sequence[str] = ()) -> p.ReplicaConfig:
    """Raises InvalidArgument for a bad count or pin."""
    if pin not in ("", "soft", "hard"):
        raise InvalidArgument(f"pin must be '', 'soft' or 'hard', got {pin!r}")
    return p.ReplicaConfig(replicas, pin == "soft", pin == "hard", tuple(preferred))


class StoreClient:
    """A connection to the store. Thread-safe; `close()` when done."""

    def __init__(self, config: Config | None = None, engine: TransferEngine | None = None) -> None:
        self.config = config or Config()
        cfg = self.config.client
        self.client_id = uuid.uuid4().hex
        self._clock = WallClock()
        self._owns_engine = engine is None
        self.engine = engine or TransferEngine(config=self.config)
        self._rpc = MasterLink(cfg, p.CODEC, self.config.security.secret())
        self._mounts: list[p.MountSegment] = []
        self._segment_base = 0
        self._disk = DiskTier(cfg.ssd_dir, cfg.ssd_bytes) if cfg.ssd_dir else None
        self._stop = threading.Event()
        try:
            if cfg.segment_bytes:
                buf = self.engine.allocate(cfg.segment_bytes)
                self._segment_base = buf.base
                mount = p.MountSegment(
                    self.client_id, f"{self.engine.name}/{buf.base:x}", self.engine.name, buf.base, buf.length,
                    INCARNATION,
                )  # fmt: skip
                self._call(mount)
                self._mounts.append(mount)
            self._call(p.Heartbeat(self.client_id))
        except BaseException:
            self._close_transport()
            raise
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="tsukimi-store-heartbeat", daemon=True)
        self._heartbeat.start()

    @classmethod
    def connect(
        cls, master: str = "tcp://127.0.0.1:50051", segment_bytes: int = 0, config: Config | None = None
    ) -> StoreClient:
        """A client of the master at `master`, contributing `segment_bytes` of shared memory."""
        base = config or Config()
        return cls(replace(base, client=replace(base.client, master=master, segment_bytes=segment_bytes)))

    # -- writes ------------------------------------------------------------------------

    def put(self, key: str, data: object, replicas: int = 1, pin: PinName = "", preferred: Sequence[str] = ()) -> None:
        """Store `data` (any buffer) under a new key. Raises ObjectExists, OutOfSpace,
        TransferError, InvalidArgument, RpcTimeout."""
        self._raise(self.batch_put([(key, data)], replicas, pin, preferred)[0])

    put_from = put  # the Transfer Engine writes straight from the caller's buffer: zero-copy either way

    def upsert(
        self, key: str, data: object, replicas: int = 1, pin: PinName = "", preferred: Sequence[str] = ()
    ) -> None:
        """Store `data`, replacing any existing object of that key."""
        config = replica_config(replicas, pin, preferred)
        self._raise(self._put_many([_Put(key, _view(data), config, upsert=True)])[0])

    def batch_put(
        self, items: Sequence[tuple[str, object]], replicas: int = 1, pin: PinName = "", preferred: Sequence[str] = ()
    ) -> list[TsukimiError | None]:
        """Put several objects; the result holds each key's error, or None where it succeeded."""
        config = replica_config(replicas, pin, preferred)
        return self._put_many([_Put(key, _view(data), config, upsert=False) for key, data in items])

    batch_put_from = batch_put

    def _put_many(self, puts: list[_Put]) -> list[TsukimiError | None]:
        checksum = self.config.client.checksum
        started = self._call_batch([
            p.PutStart(self.client_id, u.key, len(u.data), u.config, u.upsert, _new_put_id(),
                       crc32c.crc32c(u.data) if checksum else None)
            for u in puts
        ])  # fmt: skip
        errors: list[TsukimiError | None] = [_error(r) for r in started]
        live = [i for i, r in enumerate(started) if isinstance(r, p.PutStartResult)]
        written = False
        try:
            self._write_replicas(puts, started, live, errors)
            written = True
        finally:  # NOTE: even when the writes raised, never leave a started put pending
            if not written:
                for i in live:
                    errors[i] = errors[i] or TransferError(f"writing {puts[i].key!r} was interrupted")
            self._end_puts(puts, started, live, errors)
        if self._disk is not None:
            for put, error in zip(puts, errors, strict=True):
                if error is None:
                    self._disk.put(put.key, put.data)
        return errors

    def _write_replicas(
        self, puts: list[_Put], started: list[msgspec.Struct], live: list[int], errors: list[TsukimiError | None]
    ) -> None:
        requests: list[TransferRequest] = []
        owners: list[int] = []
        for i in live:
            result = started[i]
            assert isinstance(result, p.PutStartResult)
            for loc in result.replicas:
                requests.append(TransferRequest(OpCode.WRITE, loc.te_segment, loc.address, puts[i].data))
                owners.append(i)
        statuses = self.engine.transfer(requests) if requests else []
        for i, status in zip(owners, statuses, strict=True):
            if status.state is not RequestState.COMPLETED and errors[i] is None:
                errors[i] = TransferError(f"writing a replica of {puts[i].key!r} failed: {status.reason}")

    def _end_puts(
        self, puts: list[_Put], started: list[msgspec.Struct], live: list[int], errors: list[TsukimiError | None]
    ) -> None:
        """PutEnd where every replica was written, PutRevoke elsewhere (mutates `errors`)."""
        ends: list[p.PutEnd | p.PutRevoke] = []
        for i in live:
            result = started[i]
            assert isinstance(result, p.PutStartResult)
            end = p.PutEnd if errors[i] is None else p.PutRevoke
            ends.append(end(self.client_id, puts[i].key, result.put_id))
        try:
            ended = self._call_batch(ends)
        except TsukimiError as exc:  # ambiguous: the master may or may not have applied them
            for i in live:
                errors[i] = errors[i] or exc
            return
        for i, result in zip(live, ended, strict=True):
            errors[i] = errors[i] or _error(result)

    # -- reads -------------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None on a miss. Raises TransferError when no replica is readable."""
        result = self._get_many([key], None)[0]
        if isinstance(result, TsukimiError):
            raise result
        return bytes(result) if result is not None else None

    def get_into(self, key: str, buffer: object) -> int:
        """Read the object into `buffer` (any writable buffer); returns its size, 0 on a miss.
        Raises InvalidBufferError if it does not fit, TransferError if no replica is readable."""
        result = self._get_many([key], [_view(buffer, writable=True)])[0]
        if isinstance(result, TsukimiError):
            raise result
        return len(result) if result is not None else 0

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each object's bytes, None on a miss or (logged) when no replica was readable."""
        return [bytes(r) if isinstance(r, bytearray | memoryview) else None for r in self._get_many(list(keys), None)]

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[object]) -> list[int]:
        """Sizes read into each buffer; 0 on a miss, -1 where no replica was readable (logged)."""
        if len(keys) != len(buffers):
            raise InvalidArgument(f"{len(keys)} keys but {len(buffers)} buffers")
        views = [_view(b, writable=True) for b in buffers]
        results = self._get_many(list(keys), views)
        return [-1 if isinstance(r, TsukimiError) else (len(r) if r is not None else 0) for r in results]

    def _get_many(self, keys: list[str], into: list[memoryview] | None) -> list[memoryview | TsukimiError | None]:
        found = self._call_batch([p.GetReplicas(k) for k in keys])
        results: list[memoryview | TsukimiError | None] = [None] * len(keys)
        targets: dict[int, _Target] = {}
        lease_s = min((r.lease_s for r in found if isinstance(r, p.GetReplicasResult) and r.replicas), default=0.0)
        for i, result in enumerate(found):
            if isinstance(result, p.Failure):
                results[i] = error_from_code(result.code, result.message)
            elif isinstance(result, p.GetReplicasResult) and result.replicas:
                dest = into[i] if into is not None else memoryview(bytearray(result.size))
                if len(dest) < result.size:
                    results[i] = InvalidBufferError(f"{keys[i]!r} is {result.size} bytes; the buffer holds {len(dest)}")
                    continue
                checksum = result.checksum if self.config.client.checksum else None
                targets[i] = _Target(dest[: result.size], list(result.replicas), checksum)
        # NOTE: replicas stay in place only while the lease lasts; a read that could finish
        # later might read blocks already given to another object, so it must end before.
        self._read_replicas(keys, targets, results, self._clock.now() + LEASE_SHARE * lease_s)
        if self._disk is not None:
            self._from_disk(keys, into, results)
        return results

    def _read_replicas(
        self,
        keys: list[str],
        targets: dict[int, _Target],
        results: list[memoryview | TsukimiError | None],
        lease_end: float,
    ) -> None:
        """READ each target from its first replica; the failed ones (and, with checksums,
        the ones whose bytes do not match) from the next, and so on, all before `lease_end`."""
        attempt = 0
        while targets:
            order = list(targets)
            requests = [TransferRequest(OpCode.READ, targets[i].replicas[attempt].te_segment,
                                        targets[i].replicas[attempt].address, targets[i].dest)
                        for i in order]  # fmt: skip
            statuses = self.engine.transfer(requests, timeout_s=max(MIN_READ_S, lease_end - self._clock.now()))
            attempt += 1
            for i, status in zip(order, statuses, strict=True):
                target = targets[i]
                reason, error = status.reason, TransferError
                if status.state is RequestState.COMPLETED:
                    if target.checksum is None or crc32c.crc32c(target.dest) == target.checksum:
                        results[i] = target.dest
                        del targets[i]
                        continue
                    reason, error = f"crc32c mismatch in {target.replicas[attempt - 1].te_segment}", ChecksumMismatch
                    logger.warning("get %r: %s", keys[i], reason)
                if attempt >= len(target.replicas):
                    results[i] = error(f"no replica of {keys[i]!r} was readable: {reason}")
                    logger.warning("get %r failed on every replica: %s", keys[i], reason)
                    del targets[i]

    def _from_disk(
        self, keys: list[str], into: list[memoryview] | None, results: list[memoryview | TsukimiError | None]
    ) -> None:
        assert self._disk is not None
        for i, key in enumerate(keys):
            if results[i] is not None:
                continue
            data = self._disk.get(key)
            if data is None:
                continue
            if into is not None:
                if len(into[i]) < len(data):
                    results[i] = InvalidBufferError(f"{key!r} is {len(data)} bytes; the buffer holds {len(into[i])}")
                    continue
                into[i][: len(data)] = data
                results[i] = into[i][: len(data)]
            else:
                results[i] = memoryview(bytearray(data))
            # NOTE: not an upsert: a newer version put meanwhile by anyone must win
            promoted = self._put_many([_Put(key, memoryview(data), p.ReplicaConfig(), upsert=False)])[0]
            if promoted is not None and not isinstance(promoted, ObjectExists):
                logger.info("could not promote %r from the SSD tier: %s", key, promoted)

    # -- metadata ----------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        """Whether a complete object exists (grants no lease). Also true if only on the SSD tier."""
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        results = self._call_batch([p.Exists(k) for k in keys])
        out = []
        for key, result in zip(keys, results, strict=True):
            if isinstance(result, p.Failure):
                raise error_from_code(result.code, result.message)
            assert isinstance(result, p.ExistsResult)
            out.append(result.exists or (self._disk is not None and self._disk.contains(key)))
        return out

    def size_of(self, key: str) -> int | None:
        """The size of a complete object, or None (grants no lease)."""
        try:
            info = self._rpc.call_as(p.QueryKey(key), p.ObjectInfo)
        except ObjectNotFound:
            return None
        return info.size if info.complete else None

    def remove(self, key: str, force: bool = False) -> bool:
        """Remove an object; False if there was none. Raises LeaseHeld while readers hold it."""
        if self._disk is not None:
            self._disk.remove(key)
        try:
            self._call(p.Remove(key, force))
        except ObjectNotFound:
            return False
        return True

    def remove_all(self, force: bool = False) -> int:
        """Remove every object from the pool (and this client's SSD tier); returns how many."""
        if self._disk is not None:
            for key in list(self._disk.keys()):
                self._disk.remove(key)
        result = self._call(p.RemoveAll(force))
        assert isinstance(result, p.RemoveAllResult)
        return result.removed

    # -- asyncio -----------------------------------------------------------------------

    async def put_async(self, key: str, data: object, replicas: int = 1, pin: PinName = "") -> None:
        await asyncio.to_thread(self.put, key, data, replicas, pin)

    async def get_async(self, key: str) -> bytes | None:
        return await asyncio.to_thread(self.get, key)

    async def get_into_async(self, key: str, buffer: object) -> int:
        return await asyncio.to_thread(self.get_into, key, buffer)

    async def exists_async(self, key: str) -> bool:
        return await asyncio.to_thread(self.exists, key)

    async def remove_async(self, key: str, force: bool = False) -> bool:
        return await asyncio.to_thread(self.remove, key, force)

    # -- plumbing ----------------------------------------------------------------------

    def _call(self, request: msgspec.Struct) -> msgspec.Struct:
        return self._rpc.call(request)

    def _call_batch(self, ops: Sequence[msgspec.Struct]) -> list[msgspec.Struct]:
        if not ops:
            return []
        result = self._rpc.call_as(p.Batch(list(ops)), p.BatchResult)  # type: ignore[arg-type]
        return list(result.results)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.config.client.heartbeat_interval_s):
            try:
                beat = self._rpc.call_as(p.Heartbeat(self.client_id), p.HeartbeatResult, self._heartbeat_s())
                if not beat.known and self._mounts:  # the master restarted: mount again
                    logger.warning("the master does not know this client; remounting %d segments", len(self._mounts))
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
        self._rpc.close()
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


@dataclass(frozen=True, slots=True)
class _Target:
    """A get in progress: where the bytes go, the replicas to try in order, the crc32c."""

    dest: memoryview
    replicas: list[p.ReplicaLocation]
    checksum: int | None


def _new_put_id() -> int:
    """A random non-zero put id: a PutStart retried after a lost reply is recognised as the same put."""
    return secrets.randbits(62) | 1


def _view(data: object, writable: bool = False) -> memoryview:
    if isinstance(data, str):
        raise InvalidBufferError("store values are bytes-like, not str (encode it first)")
    return byte_view(data, writable=writable, with_address=False)[0]


def _error(result: msgspec.Struct) -> TsukimiError | None:
    return error_from_code(result.code, result.message) if isinstance(result, p.Failure) else None
