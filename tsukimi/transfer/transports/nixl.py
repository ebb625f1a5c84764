"""The optional `nixl` transport: NVIDIA's NIXL library (UCX inside), for clusters with RDMA
NICs (ib / mlx5 / RoCE through UCX's modules), off by default (`transfer.nixl = true`;
`make nixl` installs it; docs/rdma.md says how to run it on a cluster).

Each engine owns one NIXL agent, with no listener (NIXL has no authentication: its agent
metadata, which carries the rkeys, travels only in tsukimi's descriptor, over the metadata
path that the cluster secret protects) and no progress thread (it spins a core). Every buffer
the engine registers is registered with the agent too, so transfers to and from registered
memory are zero-copy; other local memory is staged through a registered bounce buffer.

    submit -> per op: initialize_xfer(local descs, remote descs) -> transfer()
               "DONE": slices done at once (one host: UCX picks CMA, and copies in the call)
               "PROC": handed to the progress thread, which polls it until done or deadline
    progress thread: polls pending transfers, and progresses the agent (get_new_notifs) at
               least every 100 ms: a UCX worker nobody progresses stalls its peers after its
               keepalive interval

Calls are serialized by NIXL itself (sync mode STRICT): the library is not thread-safe
otherwise. On one host NIXL does not notice a range its owner released (CMA is not checked
by anyone), so for same-host peers the owner's registration version is read first, as the
cma transport does; across hosts the NIC refuses a stale rkey.

NOTE: UCX's `efa` module links the system's libefa when Debian's ibverbs-providers is
installed, which loads a second libnl-route and crashes every process at exit (rc 139);
`UCX_MODULES=^efa` (set here unless the user set UCX_MODULES) avoids it and keeps ib/mlx5.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tsukimi.clock import Clock
from tsukimi.errors import ClosedError, ConfigError, OutOfBounds, PeerError, TsukimiError
from tsukimi.transfer.batch import OpCode
from tsukimi.transfer.segment import BufferDescriptor, RegisteredBuffer, SegmentDescriptor
from tsukimi.transfer.transports.base import Slice, TransportContext, register_transport

os.environ.setdefault("UCX_MODULES", "^efa")  # NOTE: before the first agent (see the module)

_raise_exceptions = logging.raiseExceptions
try:
    from nixl_cu12 import nixl_agent, nixl_agent_config
    from nixl_cu12._api import nixl_thread_sync_t, nixl_xfer_handle
except ImportError as exc:  # pragma: no cover - only without `make nixl`
    raise ImportError(f"the nixl transport needs `pip install --no-deps nixl nixl-cu12`: {exc}") from exc
# NOTE: NIXL configures its own logger at import: INFO lines on *stdout* (which our child
# processes speak their protocol on), not propagated, and it flips logging.raiseExceptions.
# Hand its records to the application's logging instead, at WARNING and up.
_nixl_logger = logging.getLogger("nixl")
for _handler in list(_nixl_logger.handlers):
    _nixl_logger.removeHandler(_handler)
_nixl_logger.propagate = True
_nixl_logger.setLevel(logging.WARNING)
logging.raiseExceptions = _raise_exceptions

logger = logging.getLogger(__name__)

SLICE_BYTES = 4 << 20
_PROGRESS_S = 0.1  # the agent is progressed at least this often
_POLL_S = 0.0002  # while transfers are pending


Done = Callable[[TsukimiError | None, bool], None]
"""Called once a NIXL transfer ended: (error or None, whether it timed out)."""


@dataclass(slots=True)
class _Pending:
    handle: nixl_xfer_handle
    done: Done
    deadline: float


class NixlTransport:
    """Moves slices through a NIXL agent (see the module)."""

    name = "nixl"
    slice_bytes = SLICE_BYTES
    # NOTE: device memory is not given to NIXL (its descriptors here are DRAM): device
    # buffers, the peer's or ours, go over device_ipc / shm / tcp instead
    device_local = "refuse"

    def __init__(self, context: TransportContext) -> None:
        self._clock: Clock = context.clock
        self._host_id, self._fetch = context.host_id, context.fetch
        config = nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=[],
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self._agent = nixl_agent(f"tsukimi-{uuid.uuid4().hex}", config)
        self._agent.create_backend("UCX", {})
        self._lock = threading.Lock()
        self._regions: list[tuple[int, int, object]] = []  # sorted (base, end, registration)
        self._peers: dict[str, tuple[str, bytes]] = {}  # segment name -> (agent name, metadata)
        self._pending: list[_Pending] = []
        self._wake = threading.Event()
        self._closed = False
        self._word = np.zeros(1, np.uint64)  # where a same-host peer's registration version lands
        self._staging = np.zeros(context.config.nixl_staging_bytes, np.uint8)
        self._staging_lock = threading.Lock()
        self._register(int(self._word.ctypes.data), 8)
        self._register(_addr(self._staging), len(self._staging))
        if context.version_address:  # NOTE: so that same-host peers can read it (see the module)
            self._register(context.version_address, 8)
        self._thread = threading.Thread(target=self._progress, name="tsukimi-nixl", daemon=True)
        self._thread.start()

    # -- SegmentAware --------------------------------------------------------------------

    def on_register(self, buffer: RegisteredBuffer) -> None:
        if buffer.device is None:
            self._register(buffer.base, buffer.length)

    def on_unregister(self, buffer: RegisteredBuffer) -> None:
        if buffer.device is not None:
            return
        with self._lock:
            for i, (base, _, reg) in enumerate(self._regions):
                if base == buffer.base:
                    del self._regions[i]
                    self._agent.deregister_memory(reg)
                    return

    def local_info(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    # -- Transport -----------------------------------------------------------------------

    def can_serve(self, peer: SegmentDescriptor, buffer: BufferDescriptor) -> bool:
        return not self._closed and not buffer.device and bool(peer.transport_info.get(self.name))

    def submit(self, peer: SegmentDescriptor, slices: list[Slice]) -> None:
        if self._closed:
            raise ClosedError("nixl transport is closed")
        try:
            remote = self._remote(peer)
            if peer.host_id == self._host_id:
                slices = self._still_registered(remote, peer, slices)
        except TsukimiError as exc:
            _fail(slices, exc)
            return
        zero_copy = [p for p in slices if self._registered(_addr(p.local), len(p.local))]
        staged = [p for p in slices if not self._registered(_addr(p.local), len(p.local))]
        for op in (OpCode.READ, OpCode.WRITE):
            group = [p for p in zero_copy if p.op is op]
            if group:
                local = [(_addr(p.local), len(p.local), 0) for p in group]
                self._post(remote, op, local, group, _ender(group))
        if staged:
            self._staged(remote, staged)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending, self._pending = self._pending, []
        self._wake.set()
        self._thread.join(timeout=5)
        for item in pending:
            _release(item.handle)
            item.done(ClosedError("nixl transport closed"), False)
        for name, _ in self._peers.values():
            _quietly(self._agent.remove_remote_agent, name)
        for _, _, reg in [*self._regions]:
            _quietly(self._agent.deregister_memory, reg)
        self._regions = []

    # -- internals ---------------------------------------------------------------------

    def _register(self, base: int, length: int) -> object:
        try:
            reg = self._agent.register_memory([(base, length, 0, "")], "DRAM")
        except Exception as exc:  # NOTE: NIXL raises its own exception classes
            raise ConfigError(f"nixl could not register [{base:#x}, +{length}): {exc}") from exc
        with self._lock:
            bisect.insort(self._regions, (base, base + length, reg), key=lambda r: r[0])
        return reg

    def _registered(self, address: int, length: int) -> bool:
        regions = self._regions
        i = bisect.bisect_right(regions, address, key=lambda r: r[0]) - 1
        return i >= 0 and address + length <= regions[i][1]

    def _remote(self, peer: SegmentDescriptor) -> str:
        """The peer's agent name, adding (or refreshing) its metadata when it changed."""
        metadata = peer.transport_info[self.name]
        known = self._peers.get(peer.name)
        if known is not None and known[1] == metadata:
            return known[0]
        with self._lock:
            if known is not None:
                _quietly(self._agent.remove_remote_agent, known[0])
            try:
                name = self._agent.add_remote_agent(metadata)
            except Exception as exc:  # NOTE: NIXL raises its own exception classes
                raise PeerError(f"nixl refused the metadata of {peer.name}: {exc}") from exc
            agent = name.decode() if isinstance(name, bytes) else str(name)
            self._peers[peer.name] = (agent, metadata)
        return agent

    def _post(self, remote: str, op: OpCode, local: list[tuple[int, int, int]], group: list[Slice], done: Done) -> None:
        """One NIXL transfer of `group`'s ranges from/to `local`; `done` runs once it ended
        (now, when UCX finished it in the call, or later on the progress thread)."""
        descs = [(p.remote_offset, len(p.local), 0) for p in group]
        try:
            handle = self._agent.initialize_xfer(
                op.name, self._agent.get_xfer_descs(local, "DRAM"), self._agent.get_xfer_descs(descs, "DRAM"), remote
            )
            state = self._agent.transfer(handle)
        except Exception as exc:  # NOTE: NIXL raises its own exception classes
            done(_error_of(exc, remote), False)
            return
        if state == "PROC":
            with self._lock:
                self._pending.append(_Pending(handle, done, min(p.record.deadline for p in group)))
            self._wake.set()
            return
        _release(handle)
        done(None if state == "DONE" else PeerError(f"nixl transfer with {remote} failed ({state})"), False)

    def _staged(self, remote: str, slices: list[Slice]) -> None:
        """Slices whose local memory NIXL does not know go through the registered staging
        buffer, a staging-full at a time; the submitting thread waits for each round."""
        with self._staging_lock:
            group: list[Slice] = []
            used = 0
            for piece in slices:
                if used + len(piece.local) > len(self._staging) and group:
                    self._stage_round(remote, group)
                    group, used = [], 0
                group.append(piece)
                used += len(piece.local)
            self._stage_round(remote, group)

    def _stage_round(self, remote: str, group: list[Slice]) -> None:
        base, offsets, cursor = _addr(self._staging), [], 0
        for piece in group:
            offsets.append(cursor)
            if piece.op is OpCode.WRITE:
                self._staging[cursor : cursor + len(piece.local)] = np.frombuffer(piece.local, np.uint8)
            cursor += len(piece.local)
        ended = threading.Event()
        outcomes: dict[OpCode, tuple[TsukimiError | None, bool]] = {}
        ops = [op for op in (OpCode.READ, OpCode.WRITE) if any(p.op is op for p in group)]

        def record(op: OpCode) -> Done:
            def done(error: TsukimiError | None, timed_out: bool) -> None:
                outcomes[op] = (error, timed_out)
                if len(outcomes) == len(ops):
                    ended.set()

            return done

        for op in ops:
            chosen = [i for i, p in enumerate(group) if p.op is op]
            local = [(base + offsets[i], len(group[i].local), 0) for i in chosen]
            self._post(remote, op, local, [group[i] for i in chosen], record(op))
        latest = max(p.record.deadline for p in group)
        if not ended.wait(max(0.0, latest - self._clock.now()) + 1.0):
            _fail(group, PeerError("staged nixl transfer did not end"))  # NOTE: the thread ends it by the deadline
            return
        for piece, offset in zip(group, offsets, strict=True):
            error, timed_out = outcomes[piece.op]
            if error is None and piece.op is OpCode.READ:
                np.frombuffer(piece.local, np.uint8)[:] = self._staging[offset : offset + len(piece.local)]
            _ender([piece])(error, timed_out)

    def _still_registered(self, remote: str, peer: SegmentDescriptor, slices: list[Slice]) -> list[Slice]:
        """Same-host peers: the slices whose ranges the owner still registers (see the module)."""
        if not peer.version_address or self._read_word(remote, peer.version_address) == peer.version:
            return slices
        fresh = self._fetch(peer.name)
        if self._read_word(self._remote(fresh), fresh.version_address) != fresh.version:
            raise PeerError(f"{peer.name} is changing its registrations; try again")
        live = []
        for piece in slices:
            if fresh.find(piece.remote_offset, len(piece.local)) is None:
                where = f"[{piece.remote_offset:#x}, +{len(piece.local)}) of {peer.name}"
                _fail([piece], OutOfBounds(f"{where} was released (no longer registered)"))
            else:
                live.append(piece)
        return live

    def _read_word(self, remote: str, address: int) -> int:
        local = self._agent.get_xfer_descs([(int(self._word.ctypes.data), 8, 0)], "DRAM")
        handle = self._agent.initialize_xfer(
            "READ", local, self._agent.get_xfer_descs([(address, 8, 0)], "DRAM"), remote
        )
        try:
            deadline = self._clock.now() + 5.0
            state = self._agent.transfer(handle)
            while state == "PROC" and self._clock.now() < deadline:
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise PeerError(f"reading the registration version of {remote} failed ({state})")
        finally:
            _release(handle)
        return int(self._word[0])

    def _progress(self) -> None:
        """Poll pending transfers; progress the agent so peers never stall on us."""
        next_tick = 0.0
        while not self._closed:
            with self._lock:
                pending = list(self._pending)
            for item in pending:
                self._check(item)
            now = self._clock.now()
            if now >= next_tick:
                _quietly(self._agent.get_new_notifs)
                next_tick = now + _PROGRESS_S
            if pending:
                self._wake.wait(_POLL_S)
            else:
                self._wake.wait(_PROGRESS_S)
                self._wake.clear()

    def _check(self, item: _Pending) -> None:
        try:
            state = self._agent.check_xfer_state(item.handle)
        except Exception as exc:  # NOTE: NIXL raises its own exception classes
            state, error = "ERR", _error_of(exc, "peer")
        else:
            error = PeerError(f"nixl transfer failed ({state})")
        if state == "PROC" and self._clock.now() < item.deadline:
            return
        with self._lock:
            self._pending.remove(item)
        _release(item.handle)
        if state == "DONE":
            item.done(None, False)
        elif state == "PROC":
            item.done(PeerError("request timed out in nixl"), True)
        else:
            item.done(error, False)


def _ender(group: list[Slice]) -> Done:
    """The `Done` that ends `group`'s slices with the outcome."""

    def done(error: TsukimiError | None, timed_out: bool) -> None:
        for piece in group:
            if error is None:
                piece.record.slice_done(len(piece.local))
            else:
                piece.record.slice_failed(str(error), error.code, timed_out)

    return done


def _addr(view: memoryview | np.ndarray) -> int:
    return int(np.frombuffer(view, np.uint8).ctypes.data) if isinstance(view, memoryview) else int(view.ctypes.data)


def _error_of(exc: Exception, remote: str) -> TsukimiError:
    kind = type(exc).__name__
    if kind == "nixlNotFoundError":  # a descriptor outside every registered region
        return OutOfBounds(f"{remote}: the range is not inside a registered buffer ({exc})")
    return PeerError(f"nixl transfer with {remote} failed: {kind}: {exc}")


def _fail(slices: list[Slice], error: TsukimiError) -> None:
    for piece in slices:
        piece.record.slice_failed(str(error), error.code)


def _release(handle: nixl_xfer_handle) -> None:
    _quietly(handle.release)


def _quietly(call: object, *args: object) -> None:
    try:
        call(*args)  # type: ignore[operator]
    except Exception as exc:  # NOTE: teardown and progress: log, never raise
        logger.debug("nixl: %s failed: %s", getattr(call, "__name__", call), exc)


def _create(context: TransportContext) -> NixlTransport:
    return NixlTransport(context)


register_transport("nixl", _create, rank=50, enabled=lambda config: config.nixl)
