"""The Transfer Engine: owns this process's segment and moves bytes to and from peers'.

    engine = TransferEngine(config=cfg)            # binds its segment server, publishes
    base = engine.register(array)                  # or engine.allocate(n) for shared memory
    peer = engine.open_segment("other")            # descriptor from metadata or handshake
    engine.write(peer, remote_offset, data)        # one request; raises its error
    statuses = engine.transfer([TransferRequest(...), ...])   # a batch: submit + wait
    batch = engine.submit([...]); batch.wait() / await batch.wait_async()
    statuses = await engine.transfer_async([...])

`submit` is the core: every request is checked against the peer's descriptor (re-fetched
once when the range is unknown), given a transport (the first registered one, by rank, that
can serve it, unless one is forced), cut into slices and handed to that transport; submit
never waits on the network. Mooncake's batch-id API (allocate_batch_id / submit / status /
free) lives in tsukimi/compat/batches.py over this one.
With a cluster secret (`config.security`), every TCP connection to or from a peer and every
request to an HTTP metadata server is authenticated with it (tsukimi/auth.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
from collections.abc import Sequence

from tsukimi.clock import Clock, WallClock
from tsukimi.config import Config
from tsukimi.errors import ClosedError, ConfigError, InvalidBufferError, OutOfBounds, TransferError, TsukimiError
from tsukimi.transfer.batch import (
    Batch,
    OpCode,
    RequestRecord,
    RequestStatus,
    SegmentHandle,
    TransferRequest,
    first_error,
)
from tsukimi.transfer.directory import SegmentDirectory, parse_host_port
from tsukimi.transfer.metadata import MetadataBackend, connect_metadata
from tsukimi.transfer.segment import (
    BufferDescriptor,
    LocalSegment,
    RegisteredBuffer,
    SegmentDescriptor,
    byte_view,
    decode_descriptor,
    encode_descriptor,
    host_id,
    process_start_time,
)
from tsukimi.transfer.server import SegmentServer
from tsukimi.transfer.shared_memory import SharedMemoryAllocator
from tsukimi.transfer.transports import SegmentAware, Slice, Transport, TransportContext, build_transports

logger = logging.getLogger(__name__)

MAX_CHOICES = 4096  # remembered transport choices (see _choose)
_Plan = tuple[SegmentHandle, OpCode, memoryview, int]  # a validated request: where, what, which bytes, offset


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
        self._servers: list[SegmentServer] = []
        try:  # NOTE: one server per address (one per NIC): peers stripe over them (transports/tcp.py)
            for host in self.config.bind_hosts:
                self._servers.append(SegmentServer(
                    self._segment, self.config, self._describe_bytes, self._on_handshake, self._clock,
                    secret=secret, host=host,
                ))  # fmt: skip
        except BaseException:
            self._close_servers()
            raise
        endpoint = self._servers[0].endpoint
        if backend is None and name is not None and parse_host_port(name) != endpoint:
            self._close_servers()
            raise ConfigError(f"in p2p mode the segment name is its server's address; drop name={name!r}")
        self.name = self._segment.name = name or f"{endpoint.host}:{endpoint.port}"
        self._directory = SegmentDirectory(backend, self._describe_bytes, cfg.metadata.timeout_s, secret)
        self._shm = SharedMemoryAllocator(self.config.shm_dir)
        context = TransportContext(
            self.config, self._clock, self._host_id, secret, self._directory.invalidate, self._directory.fetch,
            self._segment.version_address,
        )  # fmt: skip
        try:
            self._transports = build_transports(context)  # in the order "auto" tries them
        except BaseException:
            self._close_servers()
            raise
        self._aware = [t for t in self._transports if isinstance(t, SegmentAware)]
        names = ("auto", *(t.name for t in self._transports))
        if self.config.transport not in names:
            for transport in self._transports:
                transport.close()
            self._close_servers()
            raise ConfigError(f"transfer.transport must be one of {', '.join(names)}, got {self.config.transport!r}")
        self._choices: dict[tuple[str, int, int], tuple[SegmentDescriptor, Transport]] = {}
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

    def register(self, buffer: object) -> int:
        """Register memory that peers may read and write; returns its base (remote offset).

        Accepts bytearray, mmap, numpy arrays, torch CPU tensors, (address, length).
        Raises InvalidBufferError (read-only, non-contiguous, overlapping). Mutates; publishes.
        """
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

    # -- peers and batches -------------------------------------------------------------

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
        self._check_open()
        deadline = self._clock.now() + (timeout_s if timeout_s is not None else self.config.timeout_s)
        plans = [self._plan(req) for req in requests]
        batch = Batch([req.local for req in requests], deadline, self._clock)
        self._dispatch(batch.records, plans)
        return batch

    def _dispatch(self, records: list[RequestRecord], plans: list[_Plan]) -> None:
        """Route every request and hand each transport its slices, one hand-off per peer."""
        refreshed: set[str] = set()
        routes: dict[tuple[str, str], tuple[Transport, SegmentDescriptor, list[Slice]]] = {}
        routed = 0
        try:
            for record, plan in zip(records, plans, strict=True):
                try:
                    route = self._route(record, plan, refreshed)
                except TsukimiError as exc:  # e.g. the metadata service failed on a re-fetch
                    record.fail_now(exc)
                    route = None
                routed += 1
                if route is not None:
                    transport, desc, pieces = route
                    routes.setdefault((transport.name, desc.name), (transport, desc, []))[2].extend(pieces)
        except BaseException:  # a bug or an interrupt: never leave a record pending for ever
            for record in records[routed:]:
                record.fail_now(TransferError("submit was interrupted before this request was routed"))
            for _, _, pieces in routes.values():
                for piece in pieces:
                    piece.record.slice_failed("submit was interrupted")
            raise
        for transport, desc, pieces in routes.values():
            try:
                transport.submit(desc, pieces)
            except TsukimiError as exc:  # closed concurrently
                for piece in pieces:
                    piece.record.slice_failed(str(exc), exc.code)

    def _route(
        self, record: RequestRecord, plan: _Plan, refreshed: set[str]
    ) -> tuple[Transport, SegmentDescriptor, list[Slice]] | None:
        """Pick the transport and cut the slices of one validated request; None when it
        already ended FAILED (mutates `refreshed`)."""
        handle, op, local, offset = plan
        desc = self._directory.get(handle.name)
        buffer = desc.find(offset, len(local))
        if buffer is None and handle.name not in refreshed:  # maybe registered after we cached
            refreshed.add(handle.name)
            desc = self._directory.fetch(handle.name)
            buffer = desc.find(offset, len(local))
        if buffer is None:
            record.fail_now(OutOfBounds(f"[{offset:#x}, +{len(local)}) is outside every buffer of {handle.name}"))
            return None
        transport = self._choose(handle, desc, buffer)
        if transport is None:
            record.fail_now(TransferError(f"transport {handle.transport} cannot reach that buffer of {handle.name}"))
            return None
        step = transport.slice_bytes
        pieces = [Slice(record, op, local[i : i + step], offset + i, buffer) for i in range(0, len(local), step)]
        record.slices_left = len(pieces)
        return transport, desc, pieces

    def transport_for(self, segment: SegmentHandle | str, remote_offset: int, length: int = 1) -> str:
        """The name of the transport that would carry a request to `segment` at
        `remote_offset` now ("" when none can). Does not move bytes.

        Raises:
            SegmentNotFound / MetadataError: the segment cannot be found.
        """
        handle = segment if isinstance(segment, SegmentHandle) else SegmentHandle(0, segment, self.config.transport)
        desc = self._directory.get(handle.name)
        buffer = desc.find(remote_offset, length)
        transport = self._choose(handle, desc, buffer) if buffer is not None else None
        return transport.name if transport is not None else ""

    # -- one-call helpers ----------------------------------------------------------------

    def transfer(self, requests: Sequence[TransferRequest], timeout_s: float | None = None) -> list[RequestStatus]:
        """Submit `requests` as one batch, wait for all, return their final statuses.
        Raises what `submit` raises (caller errors); transfer failures are in the statuses."""
        return self.submit(requests, timeout_s).wait()

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
        for transport in self._transports:
            transport.close()
        self._shm.close()
        if self._owns_backend:
            self._directory.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------

    def _plan(self, req: TransferRequest) -> _Plan:
        if not isinstance(req.op, OpCode):
            raise ConfigError(f"op must be an OpCode, got {req.op!r}")
        view = byte_view(req.local, writable=req.op is OpCode.READ, with_address=False)[0]
        length = len(view) - req.local_offset if req.length is None else req.length
        if req.local_offset < 0 or length <= 0 or req.local_offset + length > len(view):
            raise InvalidBufferError(
                f"local range [{req.local_offset}, +{length}) does not fit a buffer of {len(view)} bytes"
            )
        if req.remote_offset < 0 or req.remote_offset + length >= 1 << 64:
            raise OutOfBounds(f"remote range [{req.remote_offset}, +{length}) is outside the 64-bit address space")
        # NOTE: a segment named by string is resolved when its request is routed: an
        # unreachable peer fails its own requests (SegmentNotFound), not the whole batch.
        handle = (
            req.segment
            if isinstance(req.segment, SegmentHandle)
            else SegmentHandle(0, req.segment, self.config.transport)
        )
        return handle, req.op, view[req.local_offset : req.local_offset + length], req.remote_offset

    def _choose(self, handle: SegmentHandle, desc: SegmentDescriptor, buffer: BufferDescriptor) -> Transport | None:
        """The first transport (in rank order) that can serve the buffer, or the one forced.
        A choice is remembered for this very descriptor object (a peer that changes publishes
        a new one); a refusal is not, so a peer that becomes reachable is found."""
        key = (handle.transport, id(desc), buffer.base)
        known = self._choices.get(key)
        if known is not None and known[0] is desc:
            return known[1]
        for transport in self._transports:
            if handle.transport in ("auto", transport.name) and transport.can_serve(desc, buffer):
                if len(self._choices) >= MAX_CHOICES:
                    self._choices.clear()
                self._choices[key] = (desc, transport)
                return transport
        return None

    @staticmethod
    def _raise_first(statuses: Sequence[RequestStatus]) -> None:
        error = first_error(statuses)
        if error is not None:
            raise error

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
