"""The plan memo: what `submit` learned about a list of requests, kept so that the same list
submitted again skips validation and routing, and, where one transport prepared it, moves
as `prepare(...).run()` does (tsukimi/transfer/prepared.py) without the caller asking.

A list's key is, per request: op, segment (name or handle), remote offset, local offset and
length, and the local buffer's address, size and writability (never the object's id: a
buffer freed and another allocated at its address are the same bytes, which is all a plan
depends on). Only host buffers of the plain bytes-like classes and (address, length) tuples
(what the Mooncake API passes; one that turns out to be registered device memory is not
remembered) are keyed; anything else (tensors, device objects) is planned anew every time.

An entry holds each request's bytes within its buffer, the slices routing cut (transport,
peer descriptor, buffer, offsets), and the prepared call, if any: addresses only, never a
view, so it keeps no caller's memory alive (each run's requests hold their buffers; the
records keep them as they always did). It is used only while every peer's cached descriptor
is the very object it was routed with (a peer that re-registers publishes a new one, and a
stale one is dropped from the cache) and the local segment's registration version is the one
it saw; otherwise it is dropped and the list planned anew.

`transfer` takes the prepared call at any size (bounded by its deadline: shares.py);
`submit` only up to INLINE_FAST_BYTES, where the call runs on the submitting thread alone
(larger ones are handed off as slices: submit never waits on the copy workers). A list cut
into more than MEMO_MAX_SLICES slices is not remembered.

A list first seen is planned without its key: it is only sighted, by its mark (its length
and its first and last requests' remote offsets) and those requests' buffer objects' ids. A
list whose mark was seen before is keyed and looked up, and remembered when its key was seen
before or its buffer objects are the ones seen last time with its mark (a hint only: the
key decides what is reused; a mark shared by other lists only costs their key).

NOTE: most callers never repeat a list (a store put writes where the master just allocated,
a KV connector moves other blocks each step): for them the key (a memoryview and its address
per request) and its lookup were ~10 % of a 64 KiB x 4 transfer's profile, ~56k instructions;
a sighting is ~9k (callgrind), and ~5k more for a list that repeats.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from tsukimi.transfer.batch import OpCode, RequestRecord, RequestState, RequestStatus, SegmentHandle, TransferRequest
from tsukimi.transfer.directory import SegmentDirectory
from tsukimi.transfer.native import NATIVE, configure
from tsukimi.transfer.routing import Group, Plan, plan_bytes
from tsukimi.transfer.segment import (
    HOST_TYPES,
    BufferDescriptor,
    LocalSegment,
    SegmentDescriptor,
    byte_view,
    view_address,
)
from tsukimi.transfer.transports import Slice, Transport

_from_buffer, _addressof = ctypes.c_char.from_buffer, ctypes.addressof
MEMO_ENTRIES = 128  # remembered (or seen) request lists, and sightings; the oldest is dropped first
MEMO_MAX_REQUESTS = 512  # a longer list is planned anew every time (bounds the memo's memory: ~10 MiB)
MEMO_MAX_SLICES = 1024  # a list cut into more slices is not remembered (an entry's size scales with them)
INLINE_FAST_BYTES = 1 << 20  # `submit` takes the prepared call only up to this (it then runs on the caller's thread)

# per request: reading, handle id, segment name, handle transport (id and transport _BY_NAME
# for a segment named by a string), remote offset, local offset, length, buffer address,
# buffer size, read-only
Key = tuple[object, ...]
KEY_FIELDS = 10
_BY_NAME = object()
_BY_ADDRESS = object()  # the read-only field of an (address, length) buffer (never read-only)
configure(tuple(HOST_TYPES), _BY_NAME, _BY_ADDRESS)
# one slice: (request index, start, stop in the request's buffer, op, remote offset, remote buffer)
SliceTemplate = tuple[int, int, int, OpCode, int, BufferDescriptor]


@dataclass(frozen=True, slots=True)
class Remembered:
    """A remembered list (see the module)."""

    peers: tuple[tuple[str, SegmentDescriptor], ...]  # the descriptors it was routed with
    version: int  # the local segment's registration version then
    sizes: tuple[int, ...]  # bytes each request moves
    counts: tuple[int, ...]  # slices each request was cut into
    groups: tuple[tuple[Transport, SegmentDescriptor, tuple[SliceTemplate, ...]], ...]
    fast: Callable[[float], bool] | None  # the prepared call of the one transport, if it made one
    completed: tuple[RequestStatus, ...]  # what a run of `fast` that says True ends with
    inline: bool  # whether it moves at most INLINE_FAST_BYTES (`submit` may take it)

    def run_fast(self, timeout_s: float) -> list[RequestStatus] | None:
        """The statuses of a prepared call that moved every request within `timeout_s`; None
        when there is no such call or it did not (the slices then say what went wrong)."""
        if self.fast is None:
            return None
        try:
            moved = self.fast(timeout_s)
        except (OSError, ValueError):  # NOTE: the transport was closed under it
            return None
        return list(self.completed) if moved else None

    def slices(
        self, records: list[RequestRecord], requests: Sequence[TransferRequest], keyed: list[memoryview | None]
    ) -> list[Group]:
        """The slices routing would cut for these records and requests (with the views
        `PlanMemo.key` made), per (transport, peer)."""
        views = [
            view if view is not None else byte_view(req.local, writable=False, with_address=False)[0]
            for view, req in zip(keyed, requests, strict=True)
        ]  # NOTE: writable was checked when the key was made (a read's buffer is never read-only)
        for record, count in zip(records, self.counts, strict=True):
            record.slices_left = count
        return [
            (
                transport,
                desc,
                [
                    Slice(records[i], op, views[i][start:stop], offset, buffer)
                    for i, start, stop, op, offset, buffer in pieces
                ],
            )
            for transport, desc, pieces in self.groups
        ]


class PlanMemo:
    """The engine's remembered request lists (see the module). Thread-safe."""

    def __init__(self, directory: SegmentDirectory, segment: LocalSegment, capacity: int = MEMO_ENTRIES) -> None:
        self._directory, self._segment, self._capacity = directory, segment, capacity
        self._lock = threading.Lock()
        # NOTE: a plain dict, oldest first: a hit does not reorder (one hash per lookup);
        # an int counts the sightings of a list not (or no longer) remembered
        self._entries: dict[Key, Remembered | int] = {}
        self._sightings: dict[tuple[object, ...], tuple[int, int]] = {}  # mark -> buffer ids then

    def find(
        self, requests: Sequence[TransferRequest]
    ) -> tuple[tuple[Key, list[memoryview | None]], Remembered | None, bool] | None:
        """What the memo knows of `requests`: None for a first sighting or a list it cannot
        key (plan it, nothing more); else its key and buffer views (`key`), its entry while it
        is valid (`get`), and whether to remember it once planned (see the module). Counts
        the sighting."""
        if not requests or len(requests) > MEMO_MAX_REQUESTS:
            return None
        first = requests[0].local.__class__
        if first not in HOST_TYPES and first is not tuple:  # NOTE: e.g. tensors (a KV connector): never keyed
            return None
        again = self.sighted(requests)
        keyed = self.key(requests) if again is not None else None
        if keyed is None:
            return None
        entry, wanted = self.get(keyed[0])
        return keyed, entry, wanted or bool(again)

    def sighted(self, requests: Sequence[TransferRequest]) -> bool | None:
        """Count a sighting of `requests` (see the module): None when its mark is new (or not
        hashable), else whether its buffer objects are the ones seen last time with it."""
        first, last = requests[0], requests[-1]
        ids = (id(first.local), id(last.local))
        mark = (len(requests), first.remote_offset, last.remote_offset)
        try:
            seen = self._sightings.get(mark)
        except TypeError:  # NOTE: an offset that is not an int: planning says so
            return None
        if seen != ids:
            with self._lock:
                self._sightings[mark] = ids
                while len(self._sightings) > self._capacity:
                    del self._sightings[next(iter(self._sightings))]
        return None if seen is None else seen == ids

    def key(self, requests: Sequence[TransferRequest]) -> tuple[Key, list[memoryview | None]] | None:
        """The list's key and each request's buffer (a flat byte view; None for an (address,
        length) buffer, and for every buffer where the key is made in C: `Remembered.slices`
        makes it if it needs it); None when a request is not memoizable (not a plain host
        buffer, or malformed: planning it anew says why). In C where tsukimi/transfer/native.py
        has it (~4x faster), else `python_key`, the reference."""
        if len(requests) > MEMO_MAX_REQUESTS:
            return None
        if NATIVE is None:
            return self.python_key(requests)
        flat = NATIVE.memo_key(requests)
        return None if flat is None else (flat, [None] * len(requests))

    @staticmethod
    def python_key(requests: Sequence[TransferRequest]) -> tuple[Key, list[memoryview | None]] | None:
        """`key` in Python.

        NOTE: one flat tuple of ints, strings and bools (hashed in C; an enum or a dataclass
        would hash in Python), and host_view and view_address inlined: this runs for every
        request of every submit."""
        flat: list[object] = []
        views: list[memoryview | None] = []
        for req in requests:
            local, segment, length = req.local, req.segment, req.length
            if (
                (local.__class__ not in HOST_TYPES and local.__class__ is not tuple)
                or req.op.__class__ is not OpCode
                or req.remote_offset.__class__ is not int
                or req.local_offset.__class__ is not int
                or not (length is None or length.__class__ is int)
            ):
                return None
            reading = req.op is OpCode.READ
            if type(segment) is SegmentHandle:
                flat += (reading, segment.handle_id, segment.name, segment.transport)
            elif type(segment) is str:
                flat += (reading, _BY_NAME, segment, _BY_NAME)
            else:
                return None
            if type(local) is tuple:  # (address, length): the address is the key; a view only if needed
                if len(local) != 2 or type(local[0]) is not int or type(local[1]) is not int or min(local) <= 0:
                    return None
                flat += (req.remote_offset, req.local_offset, length, local[0], local[1], _BY_ADDRESS)
                views.append(None)
                continue
            try:
                view = memoryview(local)  # type: ignore[arg-type]
            except (TypeError, ValueError):  # NOTE: ValueError: a released memoryview
                return None
            if view.format != "B" or view.ndim != 1:
                if not view.c_contiguous:
                    return None
                view = view.cast("B")
            readonly = view.readonly
            if not view.c_contiguous or not view.nbytes or (reading and readonly):
                return None
            address = view_address(view) if readonly else _addressof(_from_buffer(view))
            flat += (req.remote_offset, req.local_offset, length, address, len(view), readonly)
            views.append(view)
        return tuple(flat), views

    def get(self, key: Key) -> tuple[Remembered | None, bool]:
        """The entry for `key` while it is still valid (see the module), and whether the list
        is worth remembering now (seen before). Counts the sighting; drops an invalid entry."""
        entry = self._entries.get(key)
        if isinstance(entry, Remembered) and entry.version == self._segment.version:
            cached = self._directory.cached
            for name, desc in entry.peers:  # NOTE: a loop: no generator per call
                if cached(name) is not desc:
                    break
            else:
                return entry, False
        with self._lock:
            seen = self._entries.get(key)
            self._entries[key] = 1 if not isinstance(seen, int) else seen + 1
            while len(self._entries) > self._capacity:
                del self._entries[next(iter(self._entries))]
        return None, seen is not None

    def remember(
        self,
        key: Key,
        version: int,
        records: list[RequestRecord],
        plans: list[Plan],
        groups: list[Group],
        prepare: Callable[[list[Group], list[Plan]], Callable[[float], bool] | None],
    ) -> Remembered | None:
        """Keep how `plans` (of the requests `key` names, made at local registration
        `version`) were routed: `groups`, before any transport touched them. Nothing when a
        request did not route, a peer's descriptor is no longer the cached one, or the list
        was cut into more than MEMO_MAX_SLICES slices. `prepare` makes the prepared call, if
        the routes allow one. Returns the entry kept."""
        if sum(len(pieces) for _, _, pieces in groups) > MEMO_MAX_SLICES:
            return None
        index = {id(record): i for i, record in enumerate(records)}
        counts = [0] * len(records)
        peers: dict[str, SegmentDescriptor] = {}
        kept = []
        for transport, desc, pieces in groups:
            if peers.setdefault(desc.name, desc) is not desc or self._directory.cached(desc.name) is not desc:
                return None
            templates = []
            for piece in pieces:
                i = index[id(piece.record)]
                counts[i] += 1
                start = (
                    cast(int, key[i * KEY_FIELDS + 5]) + piece.remote_offset - plans[i][3]
                )  # NOTE: local and remote advance together
                templates.append((i, start, start + len(piece.local), piece.op, piece.remote_offset, piece.buffer))
            kept.append((transport, desc, tuple(templates)))
        if 0 in counts or not all(isinstance(plan[2], memoryview) for plan in plans):
            return None  # NOTE: a request ended FAILED in routing, or an address was device memory
        sizes = tuple(plan_bytes(plan) for plan in plans)
        completed = tuple(RequestStatus(RequestState.COMPLETED, size) for size in sizes)
        fast = prepare(groups, plans)
        # NOTE: a prepared call that waits on the network (tcp) is never `submit`'s to run
        inline = sum(sizes) <= INLINE_FAST_BYTES and not any(getattr(t, "prepared_waits", False) for t, _, _ in groups)
        entry = Remembered(tuple(peers.items()), version, sizes, tuple(counts), tuple(kept), fast, completed, inline)
        with self._lock:
            if key in self._entries:  # NOTE: else it was dropped meanwhile: keep the bound
                self._entries[key] = entry
        return entry
