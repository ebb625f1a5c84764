"""Shared-memory transport: peers on this host map each other's shm files once and copy.

The owner's process does no work. Copies run on a small pool of worker threads (numpy's
copy releases the GIL, so large copies run in parallel with the caller). Before and after
each copy the owner's liveness is checked through a pidfd, and the file's link count tells
whether the owner unregistered the buffer, so writes into a dead or released segment are
reported as failures rather than silently landing in orphaned memory.

Device memory on this side (`device_local = "direct"`) is copied straight between the peer's
mapped file and the device by the device's backend (to_host / from_host on the mapped view):
no staging. A mapping is pinned for a kind of device the first time it is used with one
(cudaHostRegister in place: DMA speed, GPU.md) and unpinned before it is unmapped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np

from tsukimi.clock import Clock
from tsukimi.config import TransferConfig
from tsukimi.device import DeviceRange, backend, pin_or_warn
from tsukimi.errors import ClosedError, OutOfBounds, PeerError, TsukimiError
from tsukimi.transfer.batch import OpCode
from tsukimi.transfer.segment import BufferDescriptor, SegmentDescriptor
from tsukimi.transfer.shared_memory import SharedMapping, map_shared, valid_shm_name
from tsukimi.transfer.transports.base import Slice, TransportContext, register_transport
from tsukimi.transfer.transports.same_host import CopyWorkers, PeerProcess, PeerTable, copy_now_or_hand_off, live_slices

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
        self._workers: CopyWorkers[tuple[_ShmPeer, Slice]] = CopyWorkers(
            config.num_shm_workers,
            "tsukimi-shm",
            lambda item: self._run(*item),
            lambda item: item[1].record.slice_failed("shm transport is closed", ClosedError.code),
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
        copy_now_or_hand_off(self._peers.get(peer), slices, self._run, self._workers, INLINE_BYTES)

    def close(self) -> None:
        self._workers.close()
        self._peers.close()

    def _run(self, peer: _ShmPeer, piece: Slice) -> None:
        """Copy one slice and end it (done, failed or timed out)."""
        if not live_slices([piece], self._clock):
            return
        try:
            self._copy(peer, piece)
        except OutOfBounds as exc:  # the owner released the buffer: its range is gone, as tcp says too
            piece.record.slice_failed(f"shm transfer to {peer.name} failed: {exc}", exc.code)
        except (OSError, ValueError, PeerError) as exc:
            piece.record.slice_failed(f"shm transfer to {peer.name} failed: {exc}", PeerError.code)
        except TsukimiError as exc:  # the device's backend failed (DeviceError)
            piece.record.slice_failed(f"shm transfer to {peer.name} failed: {exc}", exc.code)
        else:
            piece.record.slice_done(piece.nbytes)

    def _copy(self, peer: _ShmPeer, piece: Slice) -> None:
        if not peer.alive():
            raise PeerError(f"owner process {peer.pid} has exited")
        mapping = peer.mapping(piece.buffer.shm_name)
        if mapping.unlinked():  # released; its address may already hold a new buffer
            peer.drop(piece.buffer.shm_name)
            self._on_stale(peer.name)
            raise OutOfBounds("the owner released this buffer (descriptor dropped: the next request re-fetches it)")
        start = piece.remote_offset - piece.buffer.base + piece.buffer.shm_offset
        if piece.device is not None:
            self._copy_device(peer, mapping, piece, piece.device, start)
            return
        remote = np.frombuffer(mapping.view, np.uint8, len(piece.local), start)
        local = np.frombuffer(piece.local, np.uint8)
        if piece.op is OpCode.WRITE:
            np.copyto(remote, local)
        else:
            np.copyto(local, remote)
        if not peer.alive():
            raise PeerError(f"owner process {peer.pid} exited during the copy")

    @staticmethod
    def _copy_device(peer: _ShmPeer, mapping: SharedMapping, piece: Slice, device: DeviceRange, start: int) -> None:
        """Copy between the mapped file and local device memory (see the module)."""
        peer.pin(piece.buffer.shm_name, mapping, device.kind)
        remote = mapping.view[start : start + device.length]
        if piece.op is OpCode.WRITE:
            backend(device.device).to_host(device, remote)
        else:
            backend(device.device).from_host(device, remote)
        if not peer.alive():
            raise PeerError(f"owner process {peer.pid} exited during the copy")


def _create(context: TransportContext) -> ShmTransport:
    return ShmTransport(context.config, context.host_id, context.clock, context.on_stale)


register_transport("shm", _create, rank=10)
