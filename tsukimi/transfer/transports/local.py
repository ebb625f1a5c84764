"""Requests to this engine's own segment: a copy within this process, on the submitting thread.

A segment's addresses are its owner's virtual addresses, so a request whose peer is this very
engine (the store's local replica, a test) needs no transport at all: the remote range is
resolved in the local segment (as the segment server would: out of bounds when it is not
registered, so a released range is never written) and copied (copies.py). Only `transport="auto"` requests
between host memory on both sides come here (routing.py); a forced transport still carries
requests to this engine as it would any other peer's.

The copy transport is not in the registry: `auto` reaches it before the registered ones, and
it serves nothing else. It prepares nothing (tsukimi/transfer/prepared.py): a repeated list
to this engine skips validation and routing (plan_memo.py) and copies as `submit` does.
"""

from __future__ import annotations

import os

from tsukimi.clock import Clock
from tsukimi.errors import InvalidBufferError, OutOfBounds
from tsukimi.transfer.batch import OpCode, RequestRecord
from tsukimi.transfer.copies import copy_bytes
from tsukimi.transfer.segment import BufferDescriptor, LocalSegment, SegmentDescriptor
from tsukimi.transfer.transports.base import Slice
from tsukimi.transfer.transports.same_host import live_slices

SLICE_BYTES = 64 << 20


class LocalCopy:
    """Copies requests to this engine's own segment in place (see the module)."""

    name = "local"
    slice_bytes = SLICE_BYTES
    device_local = "refuse"  # NOTE: host memory on both sides only

    def __init__(self, segment: LocalSegment, clock: Clock) -> None:
        self._segment, self._clock = segment, clock

    def can_serve(self, peer: SegmentDescriptor, buffer: BufferDescriptor) -> bool:
        # NOTE: this very segment (its version word is at an address of this process), not a
        # namesake another process published
        return (
            peer.name == self._segment.name
            and peer.pid == os.getpid()
            and peer.version_address == self._segment.version_address
            and not buffer.device
        )

    def submit(self, peer: SegmentDescriptor, slices: list[Slice]) -> None:
        done: list[tuple[RequestRecord, int]] = []
        for piece in live_slices(slices, self._clock):
            try:
                _copy(self._segment, piece.op, piece.local, piece.remote_offset)
            except (OutOfBounds, InvalidBufferError) as exc:  # released, or now device memory
                piece.record.slice_failed(f"copy within {peer.name} failed: {exc}", exc.code)
            except ValueError as exc:  # NOTE: freed between resolve() and the copy: released too
                piece.record.slice_failed(f"copy within {peer.name} failed: {exc}", OutOfBounds.code)
            else:
                done.append((piece.record, len(piece.local)))
        RequestRecord.slices_done(done)

    def close(self) -> None:
        """Nothing to stop: every copy runs on the submitting thread."""


def _copy(segment: LocalSegment, op: OpCode, local: memoryview, remote_offset: int) -> None:
    """Copy one slice between `local` and the segment's registered bytes at `remote_offset`.
    Raises OutOfBounds / InvalidBufferError: the range is not registered host memory."""
    there = segment.resolve(remote_offset, len(local))
    if op is OpCode.WRITE:
        copy_bytes(there, local)
    else:
        copy_bytes(local, there)
