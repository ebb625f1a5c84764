"""Device memory over a host-only transport (tcp): each slice of a device-local request goes
through a pinned chunk of the engine's staging pool (tsukimi/transfer/staging.py).

    WRITE: [fill thread] wait for a chunk -> to_host(device -> chunk) -> inner.submit(chunk)
           [inner's thread, when it lands] release the chunk -> slice done
    READ:  [fill thread] wait for a chunk -> inner.submit(into chunk)
           [inner's thread] -> [copy thread] from_host(chunk -> device) -> release -> done

Slices are one chunk each, so with several chunks the next one is being copied while the
last is on the socket. Each inner slice is a one-request batch of its own whose completion
(`Batch.on_done`) hands the chunk on; the caller's slice ends once its bytes are in place.
The fill threads are the only ones that wait for chunks; copy threads and the inner
transport's threads only release them, so a waiting fill always ends.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from tsukimi.clock import Clock
from tsukimi.device import DeviceRange, backend
from tsukimi.errors import ClosedError, RpcTimeout, TsukimiError
from tsukimi.transfer.batch import Batch, OpCode, RequestState, RequestStatus
from tsukimi.transfer.segment import BufferDescriptor, SegmentDescriptor
from tsukimi.transfer.staging import StagingPool
from tsukimi.transfer.transports.base import Slice, Transport
from tsukimi.transfer.transports.same_host import live_slices

logger = logging.getLogger(__name__)

NUM_FILL_THREADS = 2


class Staging:
    """The engine's staging for device-local requests: the pool, the fill threads and one
    StagedTransport per host-only transport (`wrap`). Thread-safe; close() when done."""

    def __init__(self, clock: Clock, num_chunks: int = 4) -> None:
        self.pool = StagingPool("stage", num_chunks)
        self.clock = clock
        self.fill = ThreadPoolExecutor(NUM_FILL_THREADS, thread_name_prefix="tsukimi-stage-fill")
        self._wrapped: dict[int, StagedTransport] = {}
        self.closed = False

    def wrap(self, inner: Transport) -> Transport:
        """`inner` taking device-local slices through staging (one wrapper per transport)."""
        found = self._wrapped.get(id(inner))
        if found is None:
            found = self._wrapped[id(inner)] = StagedTransport(inner, self)
        return found

    def close(self) -> None:
        """Fail what waits to be filled, then free the pool (after the inner transports closed)."""
        self.closed = True
        self.fill.shutdown(wait=True)
        self.pool.close()


class StagedTransport:
    """`inner` with device-local slices staged through pinned chunks (see the module)."""

    device_local = "direct"

    def __init__(self, inner: Transport, staging: Staging) -> None:
        self.name = inner.name
        self.slice_bytes = staging.pool.chunk_bytes
        self._inner, self._staging = inner, staging

    def can_serve(self, peer: SegmentDescriptor, buffer: BufferDescriptor) -> bool:
        return self._inner.can_serve(peer, buffer)

    def submit(self, peer: SegmentDescriptor, slices: list[Slice]) -> None:
        if self._staging.closed:
            raise ClosedError(f"{self.name} staging is closed")
        for piece in slices:
            try:
                self._staging.fill.submit(self._start, peer, piece)
            except RuntimeError:  # NOTE: the executor shut down concurrently
                piece.record.slice_failed(f"{self.name} staging is closed", ClosedError.code)

    def close(self) -> None:
        return None  # NOTE: the engine closes the inner transport and the staging

    def _start(self, peer: SegmentDescriptor, piece: Slice) -> None:
        try:
            self._fill(peer, piece)
        except BaseException as exc:  # NOTE: a bug; an executor would swallow it and the slice hang
            logger.exception("staging a slice to %s failed", peer.name)
            piece.record.slice_failed(f"staging failed: {type(exc).__name__}: {exc}")

    def _fill(self, peer: SegmentDescriptor, piece: Slice) -> None:
        """On a fill thread: take a chunk, fill it for a WRITE, hand it to the inner transport."""
        if not live_slices([piece], self._staging.clock):
            return
        device = piece.device
        assert device is not None, "only device-local slices are staged"
        pool = self._staging.pool
        try:
            chunk = pool.acquire(device.kind, piece.record.deadline - self._staging.clock.now())
        except RpcTimeout as exc:
            piece.record.slice_failed(f"staging: {exc}", timed_out=True)
            return
        except TsukimiError as exc:
            piece.record.slice_failed(f"staging: {exc}", exc.code)
            return
        part = chunk[: device.length]
        if piece.op is OpCode.WRITE:
            try:
                backend(device.device).to_host(device, part)
            except TsukimiError as exc:
                pool.release(chunk)
                piece.record.slice_failed(f"copy from {device.device} failed: {exc}", exc.code)
                return
        inner = Batch([None], piece.record.deadline, self._staging.clock)
        inner.records[0].slices_left = 1
        inner.set_on_done(lambda: self._landed(piece, device, chunk, inner))
        try:
            self._inner.submit(peer, [Slice(inner.records[0], piece.op, part, piece.remote_offset, piece.buffer)])
        except TsukimiError as exc:  # closed: nothing was started
            inner.records[0].slice_failed(str(exc), exc.code)

    def _landed(self, piece: Slice, device: DeviceRange, chunk: memoryview, inner: Batch) -> None:
        """The inner slice ended (on the inner transport's thread, its batch lock held)."""
        done = inner.records[0].status()
        if done.state is RequestState.COMPLETED and piece.op is OpCode.READ:
            try:
                self._staging.pool.copies.submit(self._copy_in, piece, device, chunk)
                return
            except RuntimeError:
                done = RequestStatus(RequestState.FAILED, 0, f"{self.name} staging is closed", ClosedError.code)
        self._staging.pool.release(chunk)
        if done.state is RequestState.COMPLETED:
            piece.record.slice_done(device.length)
        else:
            piece.record.slice_failed(done.reason, done.error_code, done.state is RequestState.TIMED_OUT)

    def _copy_in(self, piece: Slice, device: DeviceRange, chunk: memoryview) -> None:
        """On a copy thread: the received chunk into device memory."""
        try:
            backend(device.device).from_host(device, chunk[: device.length])
        except TsukimiError as exc:
            piece.record.slice_failed(f"copy to {device.device} failed: {exc}", exc.code)
        else:
            piece.record.slice_done(device.length)
        finally:
            self._staging.pool.release(chunk)
