"""`P2PStore`: master-less, many-reader payloads (checkpoints, weights) over the Transfer Engine.

    store = P2PStore(config)                       # its own TE, or P2PStore(config, engine=te)
    store.register("ckpt-7", [tensor_a, tensor_b]) # origin: metadata only, no byte moves
    store.get_replica("ckpt-7", [buf_a, buf_b])    # reader: pulls every shard, then serves them
    store.list("ckpt-")                            # PayloadInfo: sizes, live copies per shard
    store.delete_replica("ckpt-7") / store.unregister("ckpt-7")

The payload record lives in the metadata service (records.py) and changes only by
compare-and-set: registering creates it (a second origin of the name loses), each reader adds
its verified shards to it, withdrawing removes them. No master: readers choose holders
themselves (fetch.py), and holders prove they are alive with an ephemeral key (holders.py).
Buffers are anything `TransferEngine.register` takes; the store registers those that are not
registered yet and unregisters them when the payload is withdrawn here.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from tsukimi.config import Config
from tsukimi.errors import (
    ClosedError,
    ConfigError,
    InvalidArgument,
    PayloadExists,
    PayloadNotFound,
    PayloadNotOpen,
    RevisionConflict,
    TsukimiError,
)
from tsukimi.p2p.buffers import claim_buffers, crc32c_of, release
from tsukimi.p2p.fetch import P2PStats, RecordView, ShardFetch
from tsukimi.p2p.holders import HolderBeacon, live_holders
from tsukimi.p2p.records import (
    PAYLOAD_PREFIX,
    Extent,
    Location,
    PayloadInfo,
    PayloadRecord,
    Shard,
    cut_shards,
    decode_record,
    encode,
    info_of,
    map_range,
    payload_key,
)
from tsukimi.p2p.updates import add_replicas, remove_replicas, unregister_record
from tsukimi.transfer import TransferEngine
from tsukimi.transfer.metadata import MetadataBackend, connect_metadata

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Open:
    """A payload this store has open: as its origin or as a replica."""

    role: str  # "origin" | "replica"
    registration: str
    extents: tuple[Extent, ...]
    registered: tuple[int, ...]  # bases this store registered with the engine (unregistered on withdrawal)


class P2PStore:
    """A P2P store on a Transfer Engine and a metadata service (thread-safe; close() when done).

    Args:
        config: the settings (`config.p2p`, and `metadata` / `transfer` / `security` when the
            store opens its own engine or metadata client).
        engine: a Transfer Engine to share; None: the store opens (and closes) its own.
        metadata: a metadata backend to share; None: opened from `config.metadata`.
    Raises (constructor):
        ConfigError: no metadata service ("p2p" handshake mode has nowhere to keep records).
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        engine: TransferEngine | None = None,
        metadata: MetadataBackend | None = None,
    ) -> None:
        cfg = config or Config()
        self.config = cfg.p2p
        self._owns_metadata = metadata is None
        if metadata is None:
            metadata = connect_metadata(cfg.metadata, cfg.security.secret())
        if metadata is None:
            raise ConfigError("the P2P store needs a metadata service: metadata.url http://, etcd:// or memory://")
        self._metadata = metadata
        self._owns_engine = engine is None
        try:
            self.engine = engine if engine is not None else TransferEngine(config=cfg, metadata=metadata)
        except BaseException:
            if self._owns_metadata:
                metadata.close()
            raise
        self.stats = P2PStats()
        self._beacon = HolderBeacon(metadata, self.engine.name, self.config.holder_ttl_s)
        self._lock = threading.Lock()
        self._open: dict[str, _Open] = {}
        self._fetching: set[str] = set()
        self._closed = False

    # -- origin --------------------------------------------------------------------------

    def register(
        self, name: str, buffers: Sequence[object], max_shard_bytes: int | None = None, *, meta: bytes = b""
    ) -> PayloadInfo:
        """Publish `buffers` (concatenated, in order) as payload `name`: computes each shard's
        crc32c and writes the record; no byte moves. The buffers must stay unchanged while
        registered (readers check crcs). Mutates the metadata service and the engine.

        Raises:
            InvalidArgument (bad name, shard size, meta), InvalidBufferError / OverlappingBuffers,
            PayloadExists (open here, or registered by another origin), MetadataError.
        """
        shard_bytes = self.config.max_shard_bytes if max_shard_bytes is None else max_shard_bytes
        if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes < 4096:
            raise InvalidArgument(f"max_shard_bytes must be an int >= 4096, got {shard_bytes!r}")
        if not isinstance(meta, (bytes, bytearray)):
            raise InvalidArgument(f"meta must be bytes, got {type(meta).__name__}")
        key = payload_key(name)
        extents, registered = self._claim(name, buffers)
        try:
            shards = [
                Shard(offset, gold.extents[0].length, self._crc(gold.extents), gold)
                for offset, gold in cut_shards(extents, self.engine.name, shard_bytes)
            ]
            registration = uuid.uuid4().hex
            record = PayloadRecord(
                name=name,
                registration=registration,
                origin=self.engine.name,
                total_bytes=sum(e.length for e in extents),
                shards=shards,
                meta=bytes(meta),
            )
            self._opened(name, _Open("origin", registration, extents, registered))
            self._metadata.compare_and_set(key, encode(record), 0)
        except RevisionConflict:
            self._withdrawn(name, registered)
            raise PayloadExists(f"P2P payload {name!r} is already registered by another origin") from None
        except BaseException:
            self._withdrawn(name, registered)
            raise
        self._advertise()
        logger.info("registered P2P payload %r: %d bytes in %d shards", name, record.total_bytes, len(shards))
        return info_of(record, {self.engine.name})

    def unregister(self, name: str) -> None:
        """Withdraw payload `name`, registered here: deletes its record (readers in flight
        fail with PayloadNotFound unless they already hold every shard) and releases its
        buffers. Mutates.

        Raises:
            PayloadNotOpen: this store is not the origin of `name`. MetadataError.
        """
        opened = self._take_open(name, "origin")
        try:
            unregister_record(self._metadata, name, opened.registration, self.config.cas_attempts)
        finally:
            self._withdrawn(name, opened.registered)
            self._advertise()

    # -- readers -------------------------------------------------------------------------

    def get_replica(self, name: str, buffers: Sequence[object]) -> PayloadInfo:
        """Pull payload `name` into `buffers` (their total size must be the payload's) and
        become one of its holders. Mutates the buffers, the engine and the record.

        Raises:
            PayloadNotFound (not registered, or unregistered meanwhile), PayloadExists (open
            here already), InvalidArgument (size mismatch), InvalidBufferError /
            OverlappingBuffers, TooManyRetries (a shard failed from every holder tried),
            MetadataError. On any error this store holds nothing of the payload.
        """
        entry = self._metadata.get_versioned(payload_key(name))
        if entry is None:
            raise PayloadNotFound(f"no P2P payload {name!r} is registered")
        record = decode_record(entry.value)
        extents, registered = self._claim(name, buffers)
        total = sum(e.length for e in extents)
        if total != record.total_bytes:
            release(self.engine, registered)
            raise InvalidArgument(f"P2P payload {name!r} is {record.total_bytes} bytes; the buffers hold {total}")
        opened = _Open("replica", record.registration, extents, registered)
        self._opened(name, opened)
        try:
            self._fetch(record, opened)
        except BaseException:
            self._abandon(name, opened)
            raise
        self._advertise()
        return self.describe(name)

    def _fetch(self, record: PayloadRecord, opened: _Open) -> None:
        with self._lock:
            self._fetching.add(record.name)
        self._advertise()
        view = RecordView(self._metadata, record.name, record.registration)
        announcer = _Announcer(self, record.name, record.registration, opened.extents, record)
        try:
            ShardFetch(self.engine, self.config, view, opened.extents, announcer.add, self.stats).run()
        finally:
            with self._lock:
                self._fetching.discard(record.name)

    def delete_replica(self, name: str) -> None:
        """Withdraw this store's copy of `name` (removed from the record, buffers released).

        Raises:
            PayloadNotOpen: this store holds no replica of `name`. MetadataError.
        """
        self._abandon(name, self._take_open(name, "replica"))

    def _abandon(self, name: str, opened: _Open) -> None:
        try:
            remove_replicas(self._metadata, name, opened.registration, self.engine.name, self.config.cas_attempts)
        except TsukimiError as exc:
            logger.warning("could not remove this holder from P2P payload %r (it expires with its key): %s", name, exc)
        finally:
            self._withdrawn(name, opened.registered)
            self._advertise()

    # -- queries -------------------------------------------------------------------------

    def describe(self, name: str) -> PayloadInfo:
        """Payload `name` as it stands. Raises PayloadNotFound, MetadataError."""
        entry = self._metadata.get_versioned(payload_key(name))
        if entry is None:
            raise PayloadNotFound(f"no P2P payload {name!r} is registered")
        return info_of(decode_record(entry.value), set(live_holders(self._metadata)))

    def list(self, prefix: str = "") -> list[PayloadInfo]:
        """Every registered payload whose name starts with `prefix`, by name. Raises MetadataError."""
        live = set(live_holders(self._metadata))
        infos = []
        for key, entry in sorted(self._metadata.list_prefix(PAYLOAD_PREFIX + prefix).items()):
            try:
                infos.append(info_of(decode_record(entry.value), live))
            except ValueError as exc:  # NOTE: msgspec.DecodeError: another version's record
                logger.warning("skipping unreadable P2P record %s: %s", key, exc)
        return infos

    def open_payloads(self) -> dict[str, str]:
        """Name -> role ("origin" or "replica") of the payloads open here."""
        with self._lock:
            return {name: opened.role for name, opened in self._open.items()}

    # -- bookkeeping ---------------------------------------------------------------------

    def _claim(self, name: str, buffers: Sequence[object]) -> tuple[tuple[Extent, ...], tuple[int, ...]]:
        with self._lock:
            self._check_open_store()
            if name in self._open:
                raise PayloadExists(f"P2P payload {name!r} is already open here ({self._open[name].role})")
            taken = [e for opened in self._open.values() for e in opened.extents]
        return claim_buffers(self.engine, buffers, taken)

    def _opened(self, name: str, opened: _Open) -> None:
        with self._lock:
            if name in self._open:
                release(self.engine, opened.registered)
                raise PayloadExists(f"P2P payload {name!r} is already open here ({self._open[name].role})")
            self._open[name] = opened

    def _take_open(self, name: str, role: str) -> _Open:
        with self._lock:
            opened = self._open.get(name)
            if opened is None or opened.role != role:
                what = "the origin of" if role == "origin" else "a replica holder of"
                raise PayloadNotOpen(f"this P2P store is not {what} {name!r}")
            return opened

    def _withdrawn(self, name: str, registered: tuple[int, ...]) -> None:
        with self._lock:
            self._open.pop(name, None)
        release(self.engine, registered)

    def _advertise(self) -> None:
        with self._lock:
            holding, fetching = set(self._open), set(self._fetching)
        try:
            self._beacon.update(holding=holding - fetching, fetching=fetching)
        except TsukimiError as exc:
            logger.warning("could not advertise this P2P holder: %s", exc)

    def _crc(self, extents: tuple[Extent, ...]) -> int:
        return crc32c_of(self.engine, extents)

    def _check_open_store(self) -> None:
        if self._closed:
            raise ClosedError("the P2P store is closed")

    def close(self) -> None:
        """Withdraw every payload open here, stop advertising, close what the store opened."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            opened = dict(self._open)
        for name, entry in opened.items():
            try:
                (self.unregister if entry.role == "origin" else self.delete_replica)(name)
            except TsukimiError as exc:
                logger.warning("could not withdraw P2P payload %r on close: %s", name, exc)
        self._beacon.close()
        if self._owns_engine:
            self.engine.close()
        if self._owns_metadata:
            self._metadata.close()

    def __enter__(self) -> P2PStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _Announcer:
    """Adds this reader's verified shards to the record, several per compare-and-set when
    they finish together (one thread writes; the others' shards ride along)."""

    def __init__(
        self, store: P2PStore, name: str, registration: str, extents: tuple[Extent, ...], record: PayloadRecord
    ) -> None:
        self._store, self._name, self._registration = store, name, registration
        self._locations = {
            i: Location(store.engine.name, map_range(extents, shard.offset, shard.size))
            for i, shard in enumerate(record.shards)
        }
        self._pending: set[int] = set()
        self._pending_lock = threading.Lock()
        self._write_lock = threading.Lock()

    def add(self, index: int) -> None:
        """Announce shard `index`. Raises PayloadNotFound (unregistered), MetadataError."""
        with self._pending_lock:
            self._pending.add(index)
        with self._write_lock:
            with self._pending_lock:
                batch, self._pending = self._pending, set()
            if batch:
                store = self._store
                add_replicas(
                    store._metadata,
                    self._name,
                    self._registration,
                    {i: self._locations[i] for i in batch},
                    store.config.cas_attempts,
                )
