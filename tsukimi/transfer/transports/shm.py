"""Shared-memory transport: peers on this host map each other's shm files once and copy.

The owner's process does no work. Copies run on a small pool of worker threads (numpy's
copy releases the GIL, so large copies run in parallel with the caller). A submit is worked
on as a group, not slice by slice: before and after the group's copies the owner's liveness
is checked through a pidfd, and each file's link count (once per group) tells whether the
owner unregistered the buffer, so writes into a dead or released segment are
reported as failures rather than silently landing in orphaned memory.

Device memory on this side (`device_local = "direct"`) is copied straight between the peer's
mapped file and the device by the device's backend (to_host / from_host on the mapped view):
no staging. A mapping is pinned for a kind of device the first time it is used with one
(cudaHostRegister in place: DMA speed, GPU.md) and unpinned before it is unmapped.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

from tsukimi.clock import Clock
from tsukimi.config import TransferConfig
from tsukimi.device import backend, pin_or_warn
from tsukimi.errors import ClosedError, OutOfBounds, PeerError, TsukimiError
from tsukimi.transfer.batch import OpCode, RequestRecord
from tsukimi.transfer.copies import copy_bytes
from tsukimi.transfer.native import Copy, still_there
from tsukimi.transfer.segment import BufferDescriptor, SegmentDescriptor, view_address
from tsukimi.transfer.shared_memory import SharedMapping, map_shared, valid_shm_name
from tsukimi.transfer.transports.base import PreparedItem, Slice, TransportContext, register_transport
from tsukimi.transfer.transports.same_host import (
    CopyWorkers,
    PeerProcess,
    PeerTable,
    live_slices,
    split_by_bytes,
)
from tsukimi.transfer.transports.shares import Share, copier, run_shares

logger = logging.getLogger(__name__)

INLINE_BYTES = 1 << 20  # a submit of at most this many bytes is copied by the submitting thread
SLICE_BYTES = 16 << 20


class _ShmPeer(PeerProcess):
    """One peer process: its pidfd and the files of it mapped so far."""

    def __init__(self, desc: SegmentDescriptor, shm_dir: str) -> None:
        super().__init__(desc)
        self.shm_dir = shm_dir
        self.lock = threading.Lock()
        self.mappings: dict[str, SharedMapping] = {}
        self.unpins: dict[tuple[str, str], Callable[[], None]] = {}  # (file, device kind) -> unpin

    def mapping(self, shm_name: str) -> SharedMapping:
        found = self.mappings.get(shm_name)
        if found is None:
            with self.lock:
                found = self.mappings.get(shm_name)
                if found is None:
                    found = self.mappings[shm_name] = map_shared(self.shm_dir, shm_name)
        return found

    def pin(self, shm_name: str, mapping: SharedMapping, kind: str) -> None:
        """Pin a mapped file for devices of `kind` (once; see the module)."""
        if (shm_name, kind) not in self.unpins:
            with self.lock:
                if (shm_name, kind) not in self.unpins:
                    self.unpins[shm_name, kind] = pin_or_warn(kind, mapping.view, f"shared memory {shm_name}")

    def drop(self, shm_name: str) -> None:
        """Unmap a file the owner released (frees its memory once nothing else maps it)."""
        with self.lock:
            mapping = self.mappings.pop(shm_name, None)
            unpins = [self.unpins.pop(key) for key in list(self.unpins) if key[0] == shm_name]
        for unpin in unpins:
            unpin()
        if mapping is not None:
            mapping.close()

    def close(self) -> None:
        with self.lock:
            for unpin in self.unpins.values():
                unpin()
            self.unpins.clear()
            for mapping in self.mappings.values():
                mapping.close()
            self.mappings.clear()
        super().close()


class ShmTransport:
    """Copies slices between this process and a same-host peer's shared memory."""

    name = "shm"
    slice_bytes = SLICE_BYTES
    device_local = "direct"

    def __init__(
        self, config: TransferConfig, local_host_id: str, clock: Clock, on_stale: Callable[[str], None]
    ) -> None:
        self._clock = clock
        self._on_stale = on_stale  # told the name of a peer whose cached descriptor is stale
        self._host_id = local_host_id
        self._peers: PeerTable[_ShmPeer] = PeerTable("shm", lambda desc: _ShmPeer(desc, config.shm_dir))
        self._num_workers = config.num_shm_workers
        self._workers: CopyWorkers[tuple[_ShmPeer, list[Slice]] | Share] = CopyWorkers(
            config.num_shm_workers, "tsukimi-shm", self._work, self._refuse
        )

    def can_serve(self, peer: SegmentDescriptor, buffer: BufferDescriptor) -> bool:
        if not buffer.shm_name or peer.host_id != self._host_id or not valid_shm_name(buffer.shm_name):
            return False
        try:
            self._peers.get(peer)
        except OSError:  # another pid namespace, the process is gone, or its pid was reused
            return False
        return True

    def submit(self, peer: SegmentDescriptor, slices: list[Slice]) -> None:
        state = self._peers.get(peer)
        if sum(piece.nbytes for piece in slices) <= INLINE_BYTES:  # NOTE: the common small submit: no hand-off
            self._run(state, slices)
            return
        for chunk in split_by_bytes(slices, self._num_workers, _nbytes):
            self._workers.put((state, chunk))

    def prepare(self, peer: SegmentDescriptor, items: list[PreparedItem]) -> Callable[[float], bool] | None:
        """Prepared requests (tsukimi/transfer/prepared.py): each item's file mapped and both
        addresses found once; a run checks, under the peer's lock, that each file is still
        mapped, pinning its mapping for the copies, and after them that the peer still runs
        and no file was released (tsukimi/transfer/native.py `still_there`). A run above
        INLINE_BYTES shares its copies, cut as slices are, with the workers, waiting for them
        at most the run's time left (shares.py). Keeps no view of the items (addresses only:
        the caller keeps them alive). None when an item is not in a live file of the peer (a
        released one is left as it is: the slices say so)."""
        state = self._peers.get(peer)
        files: dict[str, SharedMapping] = {}
        copies: list[Copy] = []
        for op, local, offset in items:
            buffer = peer.find(offset, len(local))
            if buffer is None or not buffer.shm_name or not valid_shm_name(buffer.shm_name):
                return None
            mapping = files.get(buffer.shm_name) or _mapped(state, buffer.shm_name)
            if mapping is None:
                return None
            files[buffer.shm_name] = mapping
            start = offset - buffer.base + buffer.shm_offset
            if start < 0 or start + len(local) > len(mapping.view):
                return None
            there, here = view_address(mapping.view) + start, view_address(local)
            for at in range(0, len(local), SLICE_BYTES):
                size = min(SLICE_BYTES, len(local) - at)
                copies.append((there + at, here + at, size) if op is OpCode.WRITE else (here + at, there + at, size))
        checks = tuple(files.items())
        total = sum(size for _, _, size in copies)
        shares = [copies] if total <= INLINE_BYTES else split_by_bytes(copies, self._num_workers + 1, _copy_bytes)
        works = [copier(share) for share in shares]

        fds = tuple(mapping.fd for _, mapping in checks)
        put = self._workers.put
        alone = works[0] if len(works) == 1 else None  # NOTE: the common small call: no latch, no hand-off

        def run(timeout_s: float) -> bool:
            # NOTE: the peer's liveness and its files' links once, after the copies: the pidfd
            # pins the process and an unlinked file stays unlinked, so what holds then held
            # throughout (a copy into a dead peer's or a released file, still mapped here, is
            # harmless: the call says False and the slices report it)
            with state.lock:  # NOTE: drop() and close() unmap under this lock: the check holds
                if not _all_mapped(state, checks):
                    return False
                pins = [mapping.view[0:0] for _, mapping in checks]  # NOTE: a live slice keeps it mapped
            try:
                moved = alone() if alone is not None else run_shares(works, put, timeout_s)
            finally:
                del pins
            with state.lock:  # NOTE: a file still mapped is not closed: its descriptor is its own
                if not _all_mapped(state, checks):
                    moved = False
                elif moved:
                    return still_there(state.pidfd, fds)
            _unmap_dropped(state, checks)
            return moved

        return run

    def close(self) -> None:
        self._workers.close()
        self._peers.close()

    def _work(self, item: tuple[_ShmPeer, list[Slice]] | Share) -> None:
        if isinstance(item, Share):
            item.run()
        else:
            self._run(*item)

    @staticmethod
    def _refuse(item: tuple[_ShmPeer, list[Slice]] | Share) -> None:
        if isinstance(item, Share):
            item.refuse()
        else:
            _fail(item[1], "shm transport is closed", ClosedError.code)

    def _run(self, peer: _ShmPeer, slices: list[Slice]) -> None:
        """Copy a group of one peer's slices and end each (done, failed or timed out).

        NOTE: the work is per group, not per slice: one deadline check before the copies and
        one liveness check after them (the pidfd pins the process: one that runs then ran
        throughout, and a peer that died before or during them fails them all), each file's
        mapping and release checked once, and one lock acquisition to end them."""
        live = live_slices(slices, self._clock)
        if not live:
            return
        files: dict[str, SharedMapping | TsukimiError] = {}
        copied: list[Slice] = []
        for piece in live:
            name = piece.buffer.shm_name
            mapping = files.get(name)
            if mapping is None:
                mapping = files[name] = self._mapping(peer, name)
            try:
                if isinstance(mapping, TsukimiError):
                    raise mapping
                self._copy(peer, mapping, piece)
            except OutOfBounds as exc:  # the owner released the buffer: its range is gone, as tcp says too
                piece.record.slice_failed(f"shm transfer to {peer.name} failed: {exc}", exc.code)
            except (OSError, ValueError, PeerError) as exc:
                piece.record.slice_failed(f"shm transfer to {peer.name} failed: {exc}", PeerError.code)
            except TsukimiError as exc:  # the device's backend failed (DeviceError)
                piece.record.slice_failed(f"shm transfer to {peer.name} failed: {exc}", exc.code)
            else:
                copied.append(piece)
        if not copied:
            return
        if not still_there(peer.pidfd, ()):  # NOTE: once, after: the pidfd pins the process (see prepare)
            _fail(copied, f"shm transfer to {peer.name} failed: owner process {peer.pid} has exited")
            return
        RequestRecord.slices_done([(piece.record, piece.nbytes) for piece in copied])

    def _mapping(self, peer: _ShmPeer, shm_name: str) -> SharedMapping | TsukimiError:
        """The peer's file mapped, or why it cannot be copied to (released: out of bounds)."""
        try:
            mapping = peer.mapping(shm_name)
            released = mapping.unlinked()
        except (OSError, ValueError) as exc:
            return PeerError(str(exc))
        if released:  # its address may already hold a new buffer
            peer.drop(shm_name)
            self._on_stale(peer.name)
            return OutOfBounds("the owner released this buffer (descriptor dropped: the next request re-fetches it)")
        return mapping

    @staticmethod
    def _copy(peer: _ShmPeer, mapping: SharedMapping, piece: Slice) -> None:
        start = piece.remote_offset - piece.buffer.base + piece.buffer.shm_offset
        if piece.device is not None:
            peer.pin(piece.buffer.shm_name, mapping, piece.device.kind)
            remote_bytes = mapping.view[start : start + piece.device.length]
            if piece.op is OpCode.WRITE:
                backend(piece.device.device).to_host(piece.device, remote_bytes)
            else:
                backend(piece.device.device).from_host(piece.device, remote_bytes)
            return
        size = len(piece.local)
        if start < 0 or start + size > len(mapping.view):
            raise ValueError(f"[{start:#x}, +{size}) is outside the peer's file")
        remote = mapping.view[start : start + size]
        if piece.op is OpCode.WRITE:
            copy_bytes(remote, piece.local)
        else:
            copy_bytes(piece.local, remote)


def _mapped(peer: _ShmPeer, shm_name: str) -> SharedMapping | None:
    """The peer's file mapped while it is not released, else None. NOTE: no side effect (a
    released file stays mapped): the slices that follow a failed prepare say what happened."""
    try:
        mapping = peer.mapping(shm_name)
        return None if mapping.unlinked() else mapping
    except (OSError, ValueError):
        return None


def _all_mapped(peer: _ShmPeer, checks: tuple[tuple[str, SharedMapping], ...]) -> bool:
    """Whether each (name, mapping) is still the peer's mapping of that file. NOTE: under
    peer.lock; a loop, not a generator: this runs on every prepared call."""
    mappings = peer.mappings
    for name, mapping in checks:  # noqa: SIM110
        if mappings.get(name) is not mapping:
            return False
    return True


def _unmap_dropped(peer: _ShmPeer, checks: tuple[tuple[str, SharedMapping], ...]) -> None:
    """Unmap the files that drop() let go while a run pinned them (its mm.close() then failed,
    and the file would stay mapped as long as the prepared call is kept)."""
    for name, mapping in checks:
        if peer.mappings.get(name) is not mapping:
            with contextlib.suppress(BufferError, ValueError):
                mapping.mm.close()


def _nbytes(piece: Slice) -> int:
    return piece.nbytes


def _copy_bytes(copy: Copy) -> int:
    return copy[2]


def _fail(pieces: list[Slice], reason: str, code: str = PeerError.code) -> None:
    for piece in pieces:
        piece.record.slice_failed(reason, code)


def _create(context: TransportContext) -> ShmTransport:
    return ShmTransport(context.config, context.host_id, context.clock, context.on_stale)


register_transport("shm", _create, rank=10)
