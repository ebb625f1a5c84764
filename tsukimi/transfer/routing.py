"""Routing: a request -> (transport, peer descriptor, slices). `Routes` validates a request
(`plan`), finds its peer's descriptor (re-fetched once when the range is unknown: a buffer
registered after it was cached), picks the first transport, by rank, that can serve the
buffer (or the one forced; `auto` copies requests to this engine's own host memory in
place, transports/local.py), remembers that choice per descriptor, cuts the slices (`group`) and
hands each transport its slices in one call per peer (`hand_off`).

A request whose local buffer is device memory (a device object, or an (address, length)
inside a registered device buffer) is cut into device slices (`Slice.device`) and goes only
to a transport that takes them: directly (`device_local = "direct"`: shm, device_ipc) or
through the engine's staging around a host-only one ("staged": tcp); "refuse" (cma) is
skipped. Host buffers pay one class check for this.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tsukimi.config import TransferConfig
from tsukimi.device import DeviceRange
from tsukimi.errors import ConfigError, InvalidBufferError, OutOfBounds, TransferError, TsukimiError
from tsukimi.transfer.batch import OpCode, RequestRecord, SegmentHandle, TransferRequest
from tsukimi.transfer.device_memory import request_memory
from tsukimi.transfer.directory import SegmentDirectory
from tsukimi.transfer.segment import (
    HOST_TYPES,
    NO_VIEW,
    BufferDescriptor,
    LocalSegment,
    SegmentDescriptor,
    byte_view,
    host_view,
)
from tsukimi.transfer.transports import Slice, Transport

MAX_CHOICES = 4096  # remembered transport choices (see choose)
Plan = tuple[SegmentHandle, OpCode, memoryview | DeviceRange, int]  # validated: where, what, which bytes, offset
Group = tuple[Transport, SegmentDescriptor, list[Slice]]  # one transport's slices to one peer


def plan_bytes(plan: Plan) -> int:
    """How many bytes a validated request moves."""
    local = plan[2]
    return local.length if isinstance(local, DeviceRange) else len(local)


class Routes:
    """The engine's routing (not thread-hostile: the memo is a dict replaced wholesale)."""

    def __init__(
        self,
        config: TransferConfig,
        directory: SegmentDirectory,
        transports: Sequence[Transport],
        segment: LocalSegment,
        stage: Callable[[Transport], Transport],
        local: Transport | None = None,
    ) -> None:
        """`segment`: this engine's (device buffers registered there are device memory in
        requests too); `stage`: a host-only transport wrapped to take device-local slices;
        `local`: what `auto` gives requests to this engine's own host memory first
        (transports/local.py)."""
        self.config, self._directory, self._transports = config, directory, list(transports)
        self._segment, self._stage, self._local = segment, stage, local
        self._choices: dict[tuple[str, int, int, bool], tuple[SegmentDescriptor, Transport]] = {}

    def plan(self, req: TransferRequest) -> Plan:
        """Validate a request (pure). Raises ConfigError, InvalidBufferError, OutOfBounds."""
        if not isinstance(req.op, OpCode):
            raise ConfigError(f"op must be an OpCode, got {req.op!r}")
        local = req.local
        if local.__class__ in HOST_TYPES:  # NOTE: the common case: no device lookup, no other kinds
            memory = None
            view = host_view(local, req.op is OpCode.READ)
            size = len(view)
        elif (memory := request_memory(local, self._segment)) is None:
            view = byte_view(local, writable=req.op is OpCode.READ, with_address=False)[0]
            size = len(view)
        else:
            size = memory.length
        length = size - req.local_offset if req.length is None else req.length
        if req.local_offset < 0 or length <= 0 or req.local_offset + length > size:
            raise InvalidBufferError(
                f"local range [{req.local_offset}, +{length}) does not fit a buffer of {size} bytes"
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
        if memory is not None:
            return handle, req.op, memory.sub(req.local_offset, length), req.remote_offset
        return handle, req.op, view[req.local_offset : req.local_offset + length], req.remote_offset

    def group(self, records: list[RequestRecord], plans: list[Plan]) -> list[Group]:
        """Route every request: its slices, grouped per (transport, peer). A request that
        cannot be routed ends FAILED here."""
        refreshed: set[str] = set()
        routes: dict[tuple[int, str], Group] = {}
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
                    routes.setdefault((id(transport), desc.name), (transport, desc, []))[2].extend(pieces)
        except BaseException:  # a bug or an interrupt: never leave a record pending for ever
            for record in records[routed:]:
                record.fail_now(TransferError("submit was interrupted before this request was routed"))
            for _, _, pieces in routes.values():
                for piece in pieces:
                    piece.record.slice_failed("submit was interrupted")
            raise
        return list(routes.values())

    @staticmethod
    def hand_off(groups: list[Group], waiting: bool = False) -> None:
        """Give each transport its slices (one call per peer). `waiting`: the caller waits for
        them next, so the last group goes to its transport's `submit_waiting` where it has one
        (transports/base.py `Waitable`: e.g. tcp reads a small burst's answers on this thread)."""
        last = len(groups) - 1
        for i, (transport, desc, pieces) in enumerate(groups):
            try:
                submit = getattr(transport, "submit_waiting", None) if waiting and i == last else None
                (submit or transport.submit)(desc, pieces)
            except TsukimiError as exc:  # closed concurrently
                for piece in pieces:
                    piece.record.slice_failed(str(exc), exc.code)

    def route(
        self, record: RequestRecord, plan: Plan, refreshed: set[str]
    ) -> tuple[Transport, SegmentDescriptor, list[Slice]] | None:
        """Pick the transport and cut the slices of one validated request; None when it
        already ended FAILED (mutates `refreshed`)."""
        handle, op, local, offset = plan
        size = plan_bytes(plan)
        desc = self._directory.get(handle.name)
        buffer = desc.find(offset, size)
        if buffer is None and handle.name not in refreshed:  # maybe registered after we cached
            refreshed.add(handle.name)
            desc = self._directory.fetch(handle.name)
            buffer = desc.find(offset, size)
        if buffer is None:
            record.fail_now(OutOfBounds(f"[{offset:#x}, +{size}) is outside every buffer of {handle.name}"))
            return None
        device = local if isinstance(local, DeviceRange) else None
        transport = self.choose(handle, desc, buffer, device is not None)
        if transport is None:
            where = f" from {device.device} memory" if device is not None else ""
            record.fail_now(
                TransferError(f"transport {handle.transport} cannot reach that buffer of {handle.name}{where}")
            )
            return None
        step = transport.slice_bytes
        if device is not None:
            pieces = [
                Slice(record, op, NO_VIEW, offset + i, buffer, device=device.sub(i, min(step, size - i)))
                for i in range(0, size, step)
            ]
        else:
            assert isinstance(local, memoryview)
            if size <= step:  # NOTE: the common request: one slice, its bytes the plan's view itself
                pieces = [Slice(record, op, local, offset, buffer)]
            else:
                pieces = [Slice(record, op, local[i : i + step], offset + i, buffer) for i in range(0, size, step)]
        record.slices_left = len(pieces)
        return transport, desc, pieces

    def locate(self, handle: SegmentHandle, offset: int, length: int) -> tuple[Transport, SegmentDescriptor] | None:
        """The transport and descriptor a request would take now (None: none can serve it).
        Raises SegmentNotFound / MetadataError: the segment cannot be found."""
        desc = self._directory.get(handle.name)
        buffer = desc.find(offset, length)
        transport = self.choose(handle, desc, buffer) if buffer is not None else None
        return (transport, desc) if transport is not None else None

    def choose(
        self, handle: SegmentHandle, desc: SegmentDescriptor, buffer: BufferDescriptor, device_local: bool = False
    ) -> Transport | None:
        """The first transport (in rank order) that can serve the buffer (from device memory
        when `device_local`), or the one forced. A choice is remembered for this very
        descriptor object (a peer that changes publishes a new one); a refusal is not, so a
        peer that becomes reachable is found."""
        key = (handle.transport, id(desc), buffer.base, device_local)
        known = self._choices.get(key)
        if known is not None and known[0] is desc:
            return known[1]
        mine = [self._local] if self._local is not None and handle.transport == "auto" and not device_local else []
        for transport in (*mine, *self._transports):
            if handle.transport in ("auto", transport.name) and transport.can_serve(desc, buffer):
                chosen = self._from_device(transport) if device_local else transport
                if chosen is None:
                    continue
                if len(self._choices) >= MAX_CHOICES:
                    self._choices.clear()
                self._choices[key] = (desc, chosen)
                return chosen
        return None

    def _from_device(self, transport: Transport) -> Transport | None:
        """What carries device-local slices over `transport` (see the module), or None."""
        mode = getattr(transport, "device_local", "staged")
        if mode == "direct":
            return transport
        return self._stage(transport) if mode == "staged" else None
