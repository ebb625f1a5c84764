"""Transports move slices of requests to and from a peer's segment.

A transport is small on purpose: `can_serve` says whether it can reach a given buffer of a
given peer, `submit` starts slices and returns at once, and every slice ends by calling
`record.slice_done` or `record.slice_failed` exactly once, before its deadline plus the
transport's I/O timeout. An RDMA or UCX backend plugs in by implementing this protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tsukimi.transfer.batch import OpCode, RequestRecord
from tsukimi.transfer.segment import BufferDescriptor, SegmentDescriptor


@dataclass(slots=True)
class Slice:
    """One contiguous piece of a request: `local` is exactly its bytes on this side."""

    record: RequestRecord
    op: OpCode
    local: memoryview
    remote_offset: int
    buffer: BufferDescriptor
    attempts: int = 0


class Transport(Protocol):
    name: str

    def can_serve(self, peer: SegmentDescriptor, buffer: BufferDescriptor) -> bool:
        """Whether this transport can reach `buffer` of `peer` from this process."""
        ...

    def submit(self, peer: SegmentDescriptor, slices: list[Slice]) -> None:
        """Start the slices. Raises ClosedError only when none of them was started (the
        caller then ends them); after that, every slice ends through its record."""
        ...

    def close(self) -> None:
        """Stop workers; pending slices fail with a ClosedError reason."""
        ...
