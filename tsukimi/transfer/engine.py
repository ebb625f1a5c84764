"""The Transfer Engine: owns this process's segment and moves bytes to and from peers'.

    engine = TransferEngine(config=cfg)            # binds its segment server, publishes
    base = engine.register(array)                  # or engine.allocate(n) for shared memory
    peer = engine.open_segment("other")            # descriptor from metadata or handshake
    engine.write(peer, remote_offset, data)        # one request; raises its error
    statuses = engine.transfer([TransferRequest(...), ...])   # a batch: submit + wait
    batch = engine.submit([...]); batch.wait() / await batch.wait_async()
    statuses = await engine.transfer_async([...])
    engine.notify(peer, Notification("req-7", b"kv ready"))   # after the transfer: data first
    engine.notifications()                         # (on the peer) what peers delivered here
    engine.probe(peer)                             # seconds a PING took; raises if it is down

`submit` is the core: every request is checked against the peer's descriptor (re-fetched
once when the range is unknown), given a transport (the first registered one, by rank, that
can serve it, unless one is forced), cut into slices and handed to that transport; submit
never waits on the network. A list of requests submitted again (same buffers, offsets and
peers) skips validation and routing, and where one transport prepared it, moves as
`prepare(...).run()` does (tsukimi/transfer/plan_memo.py). Mooncake's batch-id API
(allocate_batch_id / submit / status / free) lives in tsukimi/compat/batches.py over this one.
Notifications and probes are control requests to the peer's segment server (control.py),
whatever transport carries the data.
With a cluster secret (`config.security`), every TCP connection to or from a peer and every
request to an HTTP metadata server is authenticated with it (tsukimi/auth.py).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

from tsukimi.clock import Clock, WallClock
from tsukimi.config import Config
from tsukimi.device import DeviceRange
from tsukimi.errors import ClosedError, ConfigError, TsukimiError
from tsukimi.transfer.batch import (
    Batch,
    OpCode,
    RequestStatus,
    SegmentHandle,
    TransferRequest,
    first_error,
)
from tsukimi.transfer.control import ControlChannel
from tsukimi.transfer.device_memory import export_of, registered_memory
from tsukimi.transfer.directory import SegmentDirectory, parse_host_port
from tsukimi.transfer.metadata import MetadataBackend, connect_metadata
from tsukimi.transfer.notifications import Notification, NotificationInbox
from tsukimi.transfer.plan_memo import PlanMemo
from tsukimi.transfer.prepared import PreparedTransfer
from tsukimi.transfer.routing import Group, Plan, Routes, plan_bytes
from tsukimi.transfer.segment import (
    LocalSegment,
    RegisteredBuffer,
    SegmentDescriptor,
    byte_view,
    decode_descriptor,
    encode_descriptor,
    host_id,
    process_start_time,
)
from tsukimi.transfer.server import SegmentServer, ServerHooks
from tsukimi.transfer.shared_memory import SharedMemoryAllocator
from tsukimi.transfer.staging import StagingPool
from tsukimi.transfer.transports import Preparable, PreparedItem, SegmentAware, TransportContext, build_transports
from tsukimi.transfer.transports.local import LocalCopy
from tsukimi.transfer.transports.same_host import live_slices
from tsukimi.transfer.transports.staged import Staging

logger = logging.getLogger(__name__)


class TransferEngine:
    """One segment's owner and initiator of transfers. Thread-safe; close() when done.

    The cluster secret comes from `config.security.secret()`, read once here.

    Raises (constructor): ConfigError (an unreadable or too short cluster secret, a p2p name
    that is not the server's address), OSError (the server cannot bind).
    """

    def __init__(
        self,
        name: str | None = None,
        config: Config | None = None,
        *,
        metadata: MetadataBackend | None = None,
        clock: Clock | None = None,
    ) -> None:
        cfg = config or Config()
        self.config = cfg.transfer
        self._clock = clock or WallClock()
        self._owns_backend = metadata is None
        secret = cfg.security.secret()  # NOTE: read once: a changed file needs a restart
        backend = metadata if metadata is not None else connect_metadata(cfg.metadata, secret)
        self._host_id = host_id()
        self._pid_start = process_start_time(os.getpid())
        self._segment = LocalSegment(name or "")
        self._inbox = NotificationInbox()
        self._servers = self._start_servers(secret)
        endpoint = self._servers[0].endpoint
        if backend is None and name is not None and parse_host_port(name) != endpoint:
            self._close_servers()
            raise ConfigError(f"in p2p mode the segment name is its server's address; drop name={name!r}")
        self.name = self._segment.name = name or f"{endpoint.host}:{endpoint.port}"
        self._directory = SegmentDirectory(backend, self._describe_bytes, cfg.metadata.timeout_s, secret)
        self._control = ControlChannel(self._directory, self._clock, self.config.connect_timeout_s, secret)
        self._shm = SharedMemoryAllocator(self.config.shm_dir)
        context = TransportContext(
            self.config,
            self._clock,
            self._host_id,
            secret,
            self._directory.invalidate,
            self._directory.fetch,
            self._segment.version_address,
        )
        try:
            self._transports = build_transports(context)  # in the order "auto" tries them; checks the name
        except BaseException:
            self._close_servers()
            raise
        self._aware = [t for t in self._transports if isinstance(t, SegmentAware)]
        self._staging = Staging(self._clock)  # NOTE: device bytes over tcp; memory on first use
        local = LocalCopy(self._segment, self._clock)
        self._routes = Routes(self.config, self._directory, self._transports, self._segment, self._staging.wrap, local)
        self._memo = PlanMemo(self._directory, self._segment)
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        try:
            self._publish()
        except BaseException:  # e.g. AuthError: the metadata server refused us; stop serving
            self.close()
            raise
        logger.info("transfer engine %s serving on %s:%d", self.name, endpoint.host, endpoint.port)

    # -- the local segment -------------------------------------------------------------

    def register(self, buffer: object, location: str | None = None) -> int:
        """Register memory that peers may read and write; returns its base (remote offset).

        Args:
            buffer: host memory (bytearray, mmap, numpy arrays, torch CPU tensors), device
                memory (torch CUDA tensors, EmulatedMemory, DeviceRange), or (address,
                length), a device pointer when `tsukimi.device.locate` says so.
            location: as Mooncake's register_memory: None or "*" detect, "cpu" forces host
                memory, "cuda:0" (any "KIND:N") forces that device.

        Raises:
            InvalidBufferError: read-only, non-contiguous, overlapping, or not on `location`.
            ConfigError: an unknown device kind in `location`.
        Mutates; publishes (a device buffer with its IPC export, for peers on this host).
        """
        memory = registered_memory(buffer, location)
        if memory is not None:
            buf = self._added(self._segment.add_device(memory, buffer, export_of(memory)))
        else:
            view, address = byte_view(buffer, writable=True)
            buf = self._added(self._segment.add(view, address, buffer))
        self._publish()
        return buf.base

    def unregister(self, base: int) -> None:
        """Withdraw the buffer registered at `base`. Raises OutOfBounds if there is none."""
        buf = self._segment.remove(base)
        for aware in self._aware:
            aware.on_unregister(buf)
        if buf.shm_name:
            self._shm.release(buf.shm_name)
        self._publish()

    def allocate(self, nbytes: int) -> RegisteredBuffer:
        """Shared memory, registered: peers on this host reach it with zero-copy shm.

        Returns the registered buffer: `.view` to fill or read it, `.base` for peers.
        Free it with `unregister(buffer.base)`.
        """
        mapping = self._shm.create(nbytes)
        address = byte_view(mapping.view)[1]
        try:
            buf = self._added(self._segment.add(mapping.view, address, mapping, shm_name=mapping.name))
        except BaseException:
            self._shm.release(mapping.name)
            raise
        self._publish()
        return buf

    def _added(self, buf: RegisteredBuffer) -> RegisteredBuffer:
        """Tell the transports that follow registrations; undone if one refuses."""
        told: list[SegmentAware] = []
        try:
            for aware in self._aware:
                aware.on_register(buf)
                told.append(aware)
        except BaseException:
            for undo in told:
                undo.on_unregister(buf)
            self._segment.remove(buf.base)
            raise
        return buf

    def describe(self) -> SegmentDescriptor:
        """This engine's current descriptor (what peers see)."""
        return SegmentDescriptor(
            name=self.name,
            host_id=self._host_id,
            pid=os.getpid(),
            pid_start=self._pid_start,
            version_address=self._segment.version_address,
            version=self._segment.version,
            endpoints=[server.endpoint for server in self._servers],
            buffers=[buf.describe() for buf in self._segment.buffers()],
            transport_info={t.name: t.local_info() for t in self._aware},
        )

    def local_view(self, address: int, length: int) -> memoryview:
        """The bytes [address, address + length) of this engine's registered host memory, to
        read or fill in place (never mutates the registry). Raises OutOfBounds when the range
        is not inside one registered buffer, InvalidBufferError (naming the device) when it is
        device memory (the host cannot address it: move it with tsukimi.device.backend)."""
        return self._segment.resolve(address, length)

    def local_memory(self, address: int, length: int) -> memoryview | DeviceRange:
        """The registered bytes [address, address + length): a view of host memory, or the
        device range (to move with `tsukimi.device.backend(range.device)`). Never mutates.
        Raises OutOfBounds when the range is not inside one registered buffer."""
        return self._segment.resolve_any(address, length)

    # -- peers and batches -------------------------------------------------------------

    def lookup(self, name: str, *, fresh: bool = False) -> SegmentDescriptor:
        """The descriptor of segment `name` (this engine's own included): its buffers and
        endpoints. `fresh` fetches it again instead of using the cached one (updates the cache).

        Raises:
            SegmentNotFound / MetadataError / AuthError / ProtocolError: as `open_segment`.
        """
        self._check_open()
        if name == self.name:
            return self.describe()
        return self._directory.fetch(name) if fresh else self._directory.get(name)

    def on_this_host(self, name: str) -> bool:
        """Whether segment `name` is this engine's own or lives on this engine's host (its
        cached descriptor's host id); False when it cannot be looked up (never raises)."""
        if name == self.name:
            return True
        try:
            return self.lookup(name).host_id == self._host_id
        except TsukimiError:
            return False

    def open_segment(self, name: str, transport: str = "") -> SegmentHandle:
        """Find a peer's segment; `transport` ("auto", "shm", "tcp") overrides the config.

        Raises SegmentNotFound (unknown or unreachable), ConfigError (bad transport),
        AuthError (p2p: the cluster-secret handshake with the peer failed).
        """
        self._check_open()
        chosen = transport or self.config.transport
        names = ("auto", *(t.name for t in self._transports))
        if chosen not in names:
            raise ConfigError(f"transport must be one of {', '.join(names)}, got {chosen!r}")
        self._directory.get(name)
        return SegmentHandle(next(self._ids), name, chosen)

    def submit(self, requests: Sequence[TransferRequest], timeout_s: float | None = None) -> Batch:
        """Start `requests` as one batch; returns it without waiting for the network
        (`batch.wait()`, `await batch.wait_async()`, `batch.statuses()`).

        Every request is validated first, so a caller error (bad buffer, bad range) raises
        before anything starts. Requests to a segment that cannot be found or reached, or out
        of its range, do not raise: they end FAILED with that reason.

        Raises:
            InvalidBufferError / OutOfBounds / ConfigError: a request is malformed.
            ClosedError: the engine is closed.
        """
        started = self._start(requests, timeout_s, waiting=False)
        if isinstance(started, Batch):
            return started
        batch = Batch([None] * len(started), self._clock.now(), self._clock)
        batch.complete_all([status.transferred_bytes for status in started])
        return batch

    def _start(
        self, requests: Sequence[TransferRequest], timeout_s: float | None, waiting: bool
    ) -> Batch | list[RequestStatus]:
        """`submit`'s work: the batch started, or, where a remembered prepared call moved
        every request, their statuses (tsukimi/transfer/plan_memo.py). `waiting`: the caller
        waits for the batch next (`transfer`), so a transport may do its part on this thread;
        else (`submit`, which must not wait on workers) only a prepared call that runs on this
        thread alone is taken."""
        self._check_open()
        deadline = self._clock.now() + (timeout_s if timeout_s is not None else self.config.timeout_s)
        found = self._memo.find(requests)
        keyed, entry, wanted = found if found is not None else (None, None, False)
        if entry is not None and keyed is not None:  # NOTE: the same list again: no validation, no routing
            left = deadline - self._clock.now()
            if left > 0 and (entry.inline or waiting) and (statuses := entry.run_fast(left)) is not None:
                return statuses
            batch = Batch([req.local for req in requests], deadline, self._clock)
            groups = entry.slices(batch.records, requests, keyed[1])
            if self._clock.now() < deadline:
                self._routes.hand_off(groups, waiting)
            else:  # NOTE: the prepared call ran out the time: end them now, as a transport would
                for _, _, pieces in groups:
                    live_slices(pieces, self._clock)
            return batch
        version = self._segment.version
        plans = [self._routes.plan(req) for req in requests]
        batch = Batch([req.local for req in requests], deadline, self._clock)
        groups = self._routes.group(batch.records, plans)
        try:
            if keyed is not None and wanted:  # NOTE: before the transports touch the slices
                self._memo.remember(keyed[0], version, batch.records, plans, groups, self._prepared)
        finally:  # NOTE: whatever remember met, the slices are handed off (they end the records)
            self._routes.hand_off(groups, waiting)
        return batch

    @staticmethod
    def _prepared(groups: list[Group], plans: list[Plan]) -> Callable[[float], bool] | None:
        """The prepared call for host requests whose every group's transport can prepare
        them (else None): one peer's, or, over several peers of transports that copy on the
        caller's thread (not tcp's, which waits: its slices go to every peer at once), each
        group's prepared call in turn (a store get or put reads or writes several holders)."""
        preparable = [
            (transport, desc, pieces) for transport, desc, pieces in groups if isinstance(transport, Preparable)
        ]
        if not groups or len(preparable) != len(groups):
            return None
        if len(groups) == 1:
            items = [(op, local, offset) for _, op, local, offset in plans if isinstance(local, memoryview)]
            return _prepare(preparable[0][0], preparable[0][1], items) if len(items) == len(plans) else None
        if any(getattr(transport, "prepared_waits", False) for transport, _, _ in groups):
            return None
        calls = []
        for transport, desc, pieces in preparable:
            if any(piece.device is not None for piece in pieces):
                return None
            call = _prepare(transport, desc, [(piece.op, piece.local, piece.remote_offset) for piece in pieces])
            if call is None:
                return None
            calls.append(call)
        return functools.partial(_run_in_turn, calls)

    def prepare(self, requests: Sequence[TransferRequest], timeout_s: float | None = None) -> PreparedTransfer:
        """Validate and route `requests` once, to run them many times (`run()` = `transfer`,
        faster where a transport can prepare them: tsukimi/transfer/prepared.py).

        Raises:
            what `submit` raises for a malformed request; SegmentNotFound / MetadataError.
        """
        self._check_open()
        plans = [self._routes.plan(req) for req in requests]
        sizes = [plan_bytes(plan) for plan in plans]
        fast = None
        hosts = [(op, local, offset) for _, op, local, offset in plans if isinstance(local, memoryview)]
        if len(hosts) == len(plans):  # NOTE: a prepared call moves host memory only
            routes = [self._routes.locate(plan[0], plan[3], size) for plan, size in zip(plans, sizes, strict=True)]
            distinct = {(id(r[0]), id(r[1])) if r is not None else None for r in routes}
            if len(distinct) == 1 and (route := routes[0]) is not None and isinstance(route[0], Preparable):
                fast = _prepare(route[0], route[1], hosts)
        timeout = timeout_s if timeout_s is not None else self.config.timeout_s
        return PreparedTransfer(requests, sizes, timeout, self.transfer, fast, self._clock)

    def transport_for(self, segment: SegmentHandle | str, remote_offset: int, length: int = 1) -> str:
        """The name of the transport that would carry a request to `segment` at
        `remote_offset` now ("" when none can). Does not move bytes.

        Raises:
            SegmentNotFound / MetadataError: the segment cannot be found.
        """
        handle = segment if isinstance(segment, SegmentHandle) else SegmentHandle(0, segment, self.config.transport)
        found = self._routes.locate(handle, remote_offset, length)
        return found[0].name if found is not None else ""

    # -- one-call helpers ----------------------------------------------------------------

    def transfer(self, requests: Sequence[TransferRequest], timeout_s: float | None = None) -> list[RequestStatus]:
        """Submit `requests` as one batch, wait for all, return their final statuses.
        Raises what `submit` raises (caller errors); transfer failures are in the statuses."""
        started = self._start(requests, timeout_s, waiting=True)
        return started.wait() if isinstance(started, Batch) else started

    async def transfer_async(
        self, requests: Sequence[TransferRequest], timeout_s: float | None = None
    ) -> list[RequestStatus]:
        """`transfer`, awaitable from asyncio; nothing blocks the event loop (submit runs on a
        worker thread, since a first contact with a peer may wait on the network)."""
        batch = await asyncio.to_thread(self.submit, requests, timeout_s)
        return await batch.wait_async()

    def read(self, segment: SegmentHandle | str, remote_offset: int, into: object) -> None:
        """Fill `into` from the peer's segment at `remote_offset`. Raises the request's error
        (OutOfBounds, PeerError, RpcTimeout, ... as the transport reported it)."""
        self._raise_first(self.transfer([TransferRequest(OpCode.READ, segment, remote_offset, into)]))

    def write(self, segment: SegmentHandle | str, remote_offset: int, data: object) -> None:
        """Write `data` into the peer's segment at `remote_offset`. Raises the request's error."""
        self._raise_first(self.transfer([TransferRequest(OpCode.WRITE, segment, remote_offset, data)]))

    # -- notifications and liveness ------------------------------------------------------

    def notify(self, segment: SegmentHandle | str, notification: Notification, timeout_s: float | None = None) -> None:
        """Deliver `notification` into the peer's inbox (its `notifications()`), at most once,
        within `timeout_s` (default: config.timeout_s). Sent after `transfer()` returned, it
        arrives after that transfer's data is in place.

        Raises:
            InvalidArgument: over wire.MAX_NOTIFY_BYTES. SegmentNotFound / MetadataError.
            BrokenConnectionError: the peer cannot be reached. PeerError: its inbox is full.
            RpcTimeout: no answer in time. AuthError. ClosedError: this engine is closed.
        """
        self._check_open()
        name = segment.name if isinstance(segment, SegmentHandle) else segment
        self._control.notify(name, notification, self.config.timeout_s if timeout_s is None else timeout_s)

    def notifications(self, max_count: int | None = None, timeout_s: float = 0.0) -> list[Notification]:
        """Take the notifications peers delivered here, oldest first (mutates: each is
        returned once); waits up to `timeout_s` for one when none is queued."""
        return self._inbox.take(max_count, timeout_s)

    def probe(self, segment: SegmentHandle | str, timeout_s: float | None = None) -> float:
        """The seconds the peer's segment server took to answer a PING (is it alive and
        serving?), within `timeout_s` (default: config.connect_timeout_s).
        Raises what `notify` raises, but InvalidArgument and the inbox's PeerError."""
        self._check_open()
        name = segment.name if isinstance(segment, SegmentHandle) else segment
        return self._control.probe(name, self.config.connect_timeout_s if timeout_s is None else timeout_s)

    def close(self) -> None:
        """Withdraw the segment, stop serving, fail what is pending, free shared memory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._directory.withdraw(self.name)
        except TsukimiError as exc:
            logger.warning("could not withdraw segment %s: %s", self.name, exc)
        self._close_servers()
        self._control.close()
        for transport in self._transports:
            transport.close()
        self._staging.close()
        self._server_staging.close()
        self._shm.close()
        if self._owns_backend:
            self._directory.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------

    @staticmethod
    def _raise_first(statuses: Sequence[RequestStatus]) -> None:
        error = first_error(statuses)
        if error is not None:
            raise error

    def _start_servers(self, secret: bytes | None) -> list[SegmentServer]:
        """One segment server per address (one per NIC): peers stripe over them (transports/tcp.py)."""
        hooks = ServerHooks(self._describe_bytes, self._on_handshake, self._inbox.put)
        # NOTE: its own pool: a request of ours staged to ourselves must not wait for the chunks it holds
        self._server_staging = StagingPool("serve", num_chunks=8)
        servers: list[SegmentServer] = []
        try:
            for host in self.config.bind_hosts:
                servers.append(
                    SegmentServer(
                        self._segment,
                        self.config,
                        hooks,
                        self._clock,
                        secret=secret,
                        host=host,
                        staging=self._server_staging,
                    )
                )
        except BaseException:
            for server in servers:
                server.close()
            self._server_staging.close()
            raise
        return servers

    def _close_servers(self) -> None:
        for server in self._servers:
            server.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"transfer engine {self.name} is closed")

    def _publish(self) -> None:
        # NOTE: serialised, so concurrent registrations never leave an older descriptor last.
        with self._publish_lock:
            self._directory.publish(self.describe())

    def _describe_bytes(self) -> bytes:
        return encode_descriptor(self.describe())

    def _on_handshake(self, raw: bytes) -> None:
        self._directory.learn_hint(decode_descriptor(raw))


def _run_in_turn(calls: list[Callable[[float], bool]], timeout_s: float) -> bool:
    """Several peers' prepared calls, one after another within `timeout_s`; whether every
    one moved all of its bytes (else the ordinary path redoes the list: copies repeat)."""
    until = time.monotonic() + timeout_s
    for call in calls:
        left = until - time.monotonic()
        if left <= 0 or not call(left):
            return False
    return True


def _prepare(
    transport: Preparable, peer: SegmentDescriptor, items: list[PreparedItem]
) -> Callable[[float], bool] | None:
    """`transport.prepare`, None where it cannot (e.g. the peer is gone, or a concurrent run
    released a mapping it used: the ordinary path then says what is wrong)."""
    try:
        return transport.prepare(peer, items)
    except (TsukimiError, OSError, ValueError):
        return None
