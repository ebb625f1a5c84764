"""Device IPC transport: a same-host peer's device memory, opened from its export (CUDA IPC)
and copied by the device's backend; the owner's process does no work.

    local host   <-> peer device : backend.from_host / to_host on the opened range
    local device <-> peer device : backend.copy (GPU to GPU: no host memory on the way)

Each peer buffer's export is opened once and cached (by base and export, so a buffer
registered again at the same address is opened anew); what the owner no longer registers is
closed when its fresh descriptor is fetched, and everything of a peer when it is replaced
(restarted) or the transport closes, each once the copies using it have ended.

Liveness and released ranges, as for host memory: the peer is pinned by a pidfd (same_host.
PeerProcess), checked before and after every copy; before each batch the owner's
registration version is read from its memory (cma.VersionWord) and, when it moved, the
descriptor is fetched again and a slice whose range is gone fails as out of bounds, so a
stale export is never written. A peer whose version word cannot be read (the kernel refuses
process_vm_readv: Yama, seccomp) is declined, so `auto` falls back to tcp, where the owner's
server checks every range itself.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

from tsukimi.clock import Clock
from tsukimi.config import TransferConfig
from tsukimi.device import DeviceRange, OpenedRange, backend
from tsukimi.errors import ClosedError, ConfigError, PeerError, TsukimiError
from tsukimi.transfer.batch import OpCode
from tsukimi.transfer.segment import BufferDescriptor, SegmentDescriptor
from tsukimi.transfer.transports.base import Slice, TransportContext, register_transport
from tsukimi.transfer.transports.cma import VersionWord
from tsukimi.transfer.transports.same_host import (
    CopyWorkers,
    PeerProcess,
    PeerTable,
    copy_now_or_hand_off,
    live_slices,
    still_registered,
)

logger = logging.getLogger(__name__)

INLINE_BYTES = 1 << 20  # a submit of at most this many bytes is copied by the submitting thread
SLICE_BYTES = 64 << 20

_Key = tuple[int, bytes]  # a peer buffer: its base and its export


class _Opened:
    """A peer buffer opened here, the copies using it now, and whether it is to be closed:
    it is closed once no copy uses it (closing a CUDA IPC mapping under a running copy is an
    illegal address that poisons the whole context)."""

    def __init__(self, opened: OpenedRange) -> None:
        self.range = opened
        self.users = 0
        self.closing = False


class _IpcPeer(PeerProcess):
    """One peer process: its pidfd, its version word, and its buffers opened so far."""

    def __init__(self, desc: SegmentDescriptor) -> None:
        super().__init__(desc)
        self.version = VersionWord(desc.pid)
        self.readable: bool | None = None  # whether its version word can be read (probed once)
        self.lock = threading.Lock()
        self.opened: dict[_Key, _Opened] = {}

    @contextlib.contextmanager
    def using(self, buffer: BufferDescriptor) -> Iterator[OpenedRange]:
        """`buffer` opened here (once), held open while the block runs.
        Raises InvalidBufferError / DeviceError / ConfigError."""
        key = (buffer.base, buffer.device_export)
        with self.lock:
            found = self.opened.get(key)
            if found is None:
                found = self.opened[key] = _Opened(backend(buffer.device).open(buffer.device_export, buffer.length))
            found.users += 1
        try:
            yield found.range
        finally:
            with self.lock:
                found.users -= 1
                close = found.closing and found.users == 0
            if close:
                found.range.close()

    def keep_only(self, desc: SegmentDescriptor) -> None:
        """Close what `desc` (the owner's fresh descriptor) no longer registers."""
        live = {(buf.base, buf.device_export) for buf in desc.buffers if buf.device}
        with self.lock:
            stale = [key for key in self.opened if key not in live]
            self._retire([self.opened.pop(key) for key in stale])

    def _retire(self, entries: list[_Opened]) -> None:
        """Close `entries` now, or when their last copy ends (caller holds the lock)."""
        for entry in entries:
            entry.closing = True
            if entry.users == 0:
                entry.range.close()

    def close(self) -> None:
        with self.lock:
            entries, self.opened = list(self.opened.values()), {}
            self._retire(entries)
        super().close()


class DeviceIpcTransport:
    """Copies slices between this process and a same-host peer's device memory (see the module)."""

    name = "device_ipc"
    slice_bytes = SLICE_BYTES
    device_local = "direct"

    def __init__(
        self, config: TransferConfig, local_host_id: str, clock: Clock, fetch: Callable[[str], SegmentDescriptor]
    ) -> None:
        self._host_id, self._clock, self._fetch = local_host_id, clock, fetch
        self._peers: PeerTable[_IpcPeer] = PeerTable("device_ipc", _IpcPeer)
        self._workers: CopyWorkers[tuple[_IpcPeer, Slice]] = CopyWorkers(
            config.num_shm_workers,
            "tsukimi-device-ipc",
            lambda item: self._run(*item),
            lambda item: item[1].record.slice_failed("device_ipc transport is closed", ClosedError.code),
        )

    def can_serve(self, peer: SegmentDescriptor, buffer: BufferDescriptor) -> bool:
        if not buffer.device_export or peer.host_id != self._host_id:
            return False
        try:
            if not backend(buffer.device).available():
                return False
            state = self._peers.get(peer)
        except (ConfigError, OSError):  # an unknown device kind; the peer is gone or elsewhere
            return False
        if state.readable is None:
            state.readable = state.version.read(peer) is not None
            if not state.readable:
                logger.warning("device_ipc: cannot read %s's registration version; using tcp for it", peer.name)
        return state.readable

    def submit(self, peer: SegmentDescriptor, slices: list[Slice]) -> None:
        state = self._peers.get(peer)
        version = state.version.read(peer)
        if version is None:
            self._fail(slices, PeerError(f"owner process {peer.pid} of {peer.name} has exited"))
            return
        if version != peer.version:
            fresh, slices = still_registered(peer, state.version.read, self._fetch, slices)
            if fresh is not None:
                state.keep_only(fresh)
        copy_now_or_hand_off(state, slices, self._run, self._workers, INLINE_BYTES)

    def close(self) -> None:
        self._workers.close()
        self._peers.close()

    def _run(self, peer: _IpcPeer, piece: Slice) -> None:
        """Copy one slice and end it (done, failed or timed out)."""
        if not live_slices([piece], self._clock):
            return
        try:
            self._copy(peer, piece)
        except TsukimiError as exc:  # DeviceError, InvalidBufferError (e.g. devices of two kinds), PeerError
            piece.record.slice_failed(f"device_ipc transfer to {peer.name} failed: {exc}", exc.code)
        except OSError as exc:
            piece.record.slice_failed(f"device_ipc transfer to {peer.name} failed: {exc}", PeerError.code)
        else:
            piece.record.slice_done(piece.nbytes)

    def _copy(self, peer: _IpcPeer, piece: Slice) -> None:
        if not peer.alive():
            raise PeerError(f"owner process {peer.pid} has exited")
        with peer.using(piece.buffer) as opened:
            start = opened.address + piece.remote_offset - piece.buffer.base
            remote = DeviceRange(opened.device, start, piece.nbytes)
            device = backend(opened.device)
            if piece.device is not None:
                if piece.op is OpCode.WRITE:
                    device.copy(remote, piece.device)
                else:
                    device.copy(piece.device, remote)
            elif piece.op is OpCode.WRITE:
                device.from_host(remote, piece.local)
            else:
                device.to_host(remote, piece.local)
        if not peer.alive():
            raise PeerError(f"owner process {peer.pid} exited during the copy")

    @staticmethod
    def _fail(pieces: list[Slice], error: TsukimiError) -> None:
        for piece in pieces:
            piece.record.slice_failed(str(error), error.code)


def _create(context: TransportContext) -> DeviceIpcTransport:
    return DeviceIpcTransport(context.config, context.host_id, context.clock, context.fetch)


register_transport("device_ipc", _create, rank=5)
