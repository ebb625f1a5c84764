"""Transfers of `mooncake.engine.TransferEngine` as tsukimi requests, and the synchronous
part of the facade: a batch moved and waited for, then a notification delivered to the peer
(`TransferNotify`), and the notifications peers sent here.

A call's arguments travel as a `TransferBatch` (Mooncake's parallel lists of local addresses,
peer addresses and lengths, to one peer, one way); `build_requests` turns it into checked
tsukimi `TransferRequest`s. The asynchronous part (engine_batches.py) shares both.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from tsukimi.compat.mooncake.engine_codes import FAILED, OK, failed
from tsukimi.compat.mooncake.engine_setup import started
from tsukimi.errors import InvalidArgument, TsukimiError
from tsukimi.transfer import Notification, OpCode, TransferEngine, TransferRequest, first_error

# Mooncake's transport hints, as tsukimi transports ("" keeps the engine's own choice)
_HINTS = {"": "", "tcp": "tcp", "rdma": "nixl", "shm": "shm", "cma": "cma", "nixl": "nixl"}


class TransferOpcode(enum.IntEnum):
    """Which way a transfer goes (Mooncake's values)."""

    Read = 0
    Write = 1


class TransferNotify:
    """A notification sent with a transfer (`transfer_sync(..., notify=)`) and what
    `get_notifies` returns: `name` and `msg`, strings (bytes are taken as UTF-8)."""

    __slots__ = ("msg", "name")

    def __init__(self, name: str | bytes = "", msg: str | bytes = "") -> None:
        self.name = _text(name)
        self.msg = _text(msg)

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TransferNotify) and (self.name, self.msg) == (other.name, other.msg)

    __hash__ = None  # type: ignore[assignment]  # mutable, like Mooncake's


def _text(value: str | bytes) -> str:
    # NOTE: surrogateescape: bytes that are not UTF-8 still round-trip through a notification
    return value if isinstance(value, str) else value.decode("utf-8", "surrogateescape")


@dataclass(frozen=True, slots=True)
class TransferBatch:
    """One call's transfers, as Mooncake's arguments give them: request i moves lengths[i]
    bytes between local address buffers[i] and peer_addresses[i] of segment `target`,
    `opcode` TransferOpcode.Read or Write; `transport_hint` "" lets the engine choose."""

    target: str
    buffers: Sequence[int]
    peer_addresses: Sequence[int]
    lengths: Sequence[int]
    opcode: int
    transport_hint: str = ""


def build_requests(engine: TransferEngine, batch: TransferBatch) -> list[TransferRequest]:
    """tsukimi requests for the batch (local memory is taken by address).

    Raises:
        InvalidArgument: lists of different lengths, an unknown opcode or transport hint.
        SegmentNotFound / MetadataError / AuthError: the peer cannot be found.
        ConfigError: the hinted transport is not enabled in this engine.
    """
    if not len(batch.buffers) == len(batch.peer_addresses) == len(batch.lengths):
        raise InvalidArgument("buffers, peer_buffer_addresses and lengths have different sizes")
    if batch.opcode not in (TransferOpcode.Read, TransferOpcode.Write):
        raise InvalidArgument(f"opcode must be TransferOpcode.Read or Write, got {batch.opcode!r}")
    if batch.transport_hint not in _HINTS:
        raise InvalidArgument(f"transport_hint must be one of {sorted(_HINTS)}, got {batch.transport_hint!r}")
    handle = engine.open_segment(batch.target, _HINTS[batch.transport_hint])
    op = OpCode.WRITE if batch.opcode == TransferOpcode.Write else OpCode.READ
    return [
        TransferRequest(op, handle, peer, (local, length))
        for local, peer, length in zip(batch.buffers, batch.peer_addresses, batch.lengths, strict=True)
    ]


class SyncTransfers:
    """Transfers waited for, and notifications both ways, on the engine `initialize` started
    (None: every call fails as Mooncake's uninitialized engine does)."""

    def __init__(self, engine: TransferEngine | None) -> None:
        self._engine = engine

    def transfer(self, batch: TransferBatch, notify: TransferNotify | None) -> int:
        """Every transfer, waited for (each bounded by transfer.timeout_s), then `notify`: 0
        when all completed and the notification (if any) was delivered, -1 otherwise (logged)."""
        try:
            engine = started(self._engine)
            error = first_error(engine.transfer(build_requests(engine, batch)))
            if error is not None:
                raise error
            if notify is not None:
                engine.notify(batch.target, Notification(notify.name, notify.msg.encode("utf-8", "surrogateescape")))
        except TsukimiError as exc:
            return failed(f"transfer to {batch.target}", exc, FAILED)
        return OK

    def notifies(self) -> list[TransferNotify]:
        """The notifications peers sent here since the last call, oldest first (taken: a
        second call does not see them again). Raises ConfigError before initialize."""
        return [TransferNotify(n.name, n.message) for n in started(self._engine).notifications()]
