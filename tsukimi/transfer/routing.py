"""Routing: a request -> (transport, peer descriptor, slices). `Routes` validates a request
(`plan`), finds its peer's descriptor (re-fetched once when the range is unknown: a buffer
registered after it was cached), picks the first transport, by rank, that can serve the
buffer (or the one forced), remembers that choice per descriptor, cuts the slices and hands
each transport its slices in one call per peer (`dispatch`).
"""

from __future__ import annotations

from collections.abc import Sequence

from tsukimi.config import TransferConfig
from tsukimi.errors import ConfigError, InvalidBufferError, OutOfBounds, TransferError, TsukimiError
from tsukimi.transfer.batch import OpCode, RequestRecord, SegmentHandle, TransferRequest
from tsukimi.transfer.directory import SegmentDirectory
from tsukimi.transfer.segment import BufferDescriptor, SegmentDescriptor, byte_view
from tsukimi.transfer.transports import Slice, Transport

MAX_CHOICES = 4096  # remembered transport choices (see choose)
Plan = tuple[SegmentHandle, OpCode, memoryview, int]  # a validated request: where, what, which bytes, offset


class Routes:
    """The engine's routing (not thread-hostile: the memo is a dict replaced wholesale)."""

    def __init__(self, config: TransferConfig, directory: SegmentDirectory, transports: Sequence[Transport]) -> None:
        self.config, self._directory, self._transports = config, directory, list(transports)
        self._choices: dict[tuple[str, int, int], tuple[SegmentDescriptor, Transport]] = {}

    def plan(self, req: TransferRequest) -> Plan:
        """Validate a request (pure). Raises ConfigError, InvalidBufferError, OutOfBounds."""
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

    def dispatch(self, records: list[RequestRecord], plans: list[Plan]) -> None:
        """Route every request and hand each transport its slices, one hand-off per peer."""
        refreshed: set[str] = set()
        routes: dict[tuple[str, str], tuple[Transport, SegmentDescriptor, list[Slice]]] = {}
        routed = 0
        try:
            for record, plan in zip(records, plans, strict=True):
                try:
                    route = self.route(record, plan, refreshed)
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

    def route(
        self, record: RequestRecord, plan: Plan, refreshed: set[str]
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
        transport = self.choose(handle, desc, buffer)
        if transport is None:
            record.fail_now(TransferError(f"transport {handle.transport} cannot reach that buffer of {handle.name}"))
            return None
        step = transport.slice_bytes
        pieces = [Slice(record, op, local[i : i + step], offset + i, buffer) for i in range(0, len(local), step)]
        record.slices_left = len(pieces)
        return transport, desc, pieces

    def locate(self, handle: SegmentHandle, offset: int, length: int) -> tuple[Transport, SegmentDescriptor] | None:
        """The transport and descriptor a request would take now (None: none can serve it).
        Raises SegmentNotFound / MetadataError: the segment cannot be found."""
        desc = self._directory.get(handle.name)
        buffer = desc.find(offset, length)
        transport = self.choose(handle, desc, buffer) if buffer is not None else None
        return (transport, desc) if transport is not None else None

    def choose(self, handle: SegmentHandle, desc: SegmentDescriptor, buffer: BufferDescriptor) -> Transport | None:
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
