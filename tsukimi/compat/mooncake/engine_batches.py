"""The batch-id half of `mooncake.engine.TransferEngine`: asynchronous submits that return a
batch id (0 when nothing was submitted), and the two ways of collecting one, over
tsukimi.compat.batches.BatchTable:

    batch_id = te.batch_transfer_async_write(peer, buffers, peer_addresses, lengths)
    te.get_batch_transfer_status([batch_id])  # waits; 0 when every request completed; frees the ids
    batch_id = te.transfer_submit_write(peer, buffer, peer_address, length)
    te.transfer_check_status(batch_id)        # 0 pending, 1 completed, -1 failed (then freed)

Also `build_requests`, which the synchronous calls (engine.py) share: Mooncake's parallel
lists of local addresses, peer addresses and lengths, checked, as tsukimi requests.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable

from tsukimi.compat.batches import BatchId, BatchTable
from tsukimi.compat.mooncake.engine_codes import FAILED, OK, failed
from tsukimi.errors import ConfigError, InvalidArgument, TsukimiError
from tsukimi.transfer import OpCode, RequestState, RequestStatus, TransferRequest
from tsukimi.transfer import TransferEngine as _Engine

logger = logging.getLogger(__name__)

NO_BATCH = 0  # what an asynchronous submit returns when it submitted nothing
CHECK_PENDING, CHECK_COMPLETED = 0, 1
# Mooncake's transport hints, as tsukimi transports ("" keeps the engine's own choice)
_HINTS = {"": "", "tcp": "tcp", "rdma": "nixl", "shm": "shm", "cma": "cma", "nixl": "nixl"}


class TransferOpcode(enum.IntEnum):
    """Which way a transfer goes (Mooncake's values)."""

    Read = 0
    Write = 1


def with_opcode(run: str, opcode: TransferOpcode) -> Callable[..., int]:
    """Mooncake's `*_read` / `*_write` twins of a batch call: the method named `run` with
    `opcode` fixed, taking (target_hostname, buffers, peer_buffer_addresses, lengths,
    transport_hint="") as Mooncake's do."""

    def method(
        self: object,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int:
        call: Callable[..., int] = getattr(self, run)
        return call(target_hostname, buffers, peer_buffer_addresses, lengths, opcode, transport_hint=transport_hint)

    method.__name__ = f"{run}_{opcode.name.lower()}"
    method.__doc__ = f"`{run}` with opcode {opcode.name}."
    return method


def build_requests(
    engine: _Engine,
    target: str,
    buffers: list[int],
    peer_addresses: list[int],
    lengths: list[int],
    opcode: int,
    transport_hint: str = "",
) -> list[TransferRequest]:
    """tsukimi requests for Mooncake's parallel lists (local memory is taken by address).

    Raises:
        InvalidArgument: lists of different lengths, an unknown opcode or transport hint.
        SegmentNotFound / MetadataError / AuthError: the peer cannot be found.
        ConfigError: the hinted transport is not enabled in this engine.
    """
    if not len(buffers) == len(peer_addresses) == len(lengths):
        raise InvalidArgument("buffers, peer_buffer_addresses and lengths have different sizes")
    if opcode not in (TransferOpcode.Read, TransferOpcode.Write):
        raise InvalidArgument(f"opcode must be TransferOpcode.Read or Write, got {opcode!r}")
    if transport_hint not in _HINTS:
        raise InvalidArgument(f"transport_hint must be one of {sorted(_HINTS)}, got {transport_hint!r}")
    handle = engine.open_segment(target, _HINTS[transport_hint])
    op = OpCode.WRITE if opcode == TransferOpcode.Write else OpCode.READ
    return [
        TransferRequest(op, handle, peer, (local, length))
        for local, peer, length in zip(buffers, peer_addresses, lengths, strict=True)
    ]


class BatchTransfers:
    """Mixin of the facade's TransferEngine: `_engine` and `_batches` are set by initialize."""

    _engine: _Engine | None = None
    _batches: BatchTable | None = None

    def batch_transfer_async(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        opcode: int,
        transport_hint: str = "",
    ) -> int:
        """Start the transfers; their batch id, or 0 when nothing was started (an unknown
        peer, bad arguments, not initialized)."""
        engine, table = self._engine, self._batches
        if engine is None or table is None:
            logger.error("batch_transfer_async: call initialize() first")
            return NO_BATCH
        try:
            requests = build_requests(
                engine, target_hostname, buffers, peer_buffer_addresses, lengths, opcode, transport_hint
            )
        except TsukimiError as exc:
            failed(f"submitting to {target_hostname}", exc)
            return NO_BATCH
        batch_id = table.allocate(max(1, len(requests)))
        try:
            table.submit(batch_id, requests)
        except TsukimiError as exc:  # a caller error: nothing started
            table.free(batch_id)
            failed(f"submitting to {target_hostname}", exc)
            return NO_BATCH
        return batch_id

    batch_transfer_async_write = with_opcode("batch_transfer_async", TransferOpcode.Write)

    batch_transfer_async_read = with_opcode("batch_transfer_async", TransferOpcode.Read)

    def transfer_submit_write(
        self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, transport_hint: str = ""
    ) -> int:
        """One asynchronous write; its batch id (0 when not started): see transfer_check_status."""
        return self.batch_transfer_async(
            target_hostname, [buffer], [peer_buffer_address], [length], TransferOpcode.Write, transport_hint
        )

    def get_batch_transfer_status(self, batch_ids: list[int]) -> int:
        """Wait for every batch (each bounded by its requests' deadline) and free it: 0 when
        every request of every batch completed, -1 otherwise (an unknown id included)."""
        table = self._batches
        if table is None:
            return FAILED if batch_ids else OK
        code = OK
        for batch_id in batch_ids:
            try:
                status = table.wait(batch_id)
            except ConfigError as exc:  # never allocated, or already freed
                code = failed("get_batch_transfer_status", exc, FAILED)
                continue
            if not status.done:  # NOTE: past its deadline and grace: kept, so its buffers stay owned
                logger.error("batch %d is still pending after its deadline", batch_id)
                code = FAILED
                continue
            table.free(batch_id)
            if not _completed(batch_id, status.requests):
                code = FAILED
        return code

    def transfer_check_status(self, batch_id: int) -> int:
        """0 while the batch is pending; once it ended (the id is then freed) 1 when every
        request completed, -1 when one failed; -1 for an unknown id."""
        table = self._batches
        try:
            if table is None:
                raise ConfigError("call initialize() first")
            status = table.status(batch_id)
        except ConfigError as exc:
            return failed("transfer_check_status", exc, FAILED)
        if not status.done:
            return CHECK_PENDING
        table.free(batch_id)
        return CHECK_COMPLETED if _completed(batch_id, status.requests) else FAILED


def _completed(batch_id: BatchId, statuses: list[RequestStatus]) -> bool:
    """Whether every request completed (the first failure is logged)."""
    failures = [s for s in statuses if s.state is not RequestState.COMPLETED]
    for status in failures[:1]:
        logger.error("batch %d: a request %s: %s", batch_id, status.state.value, status.reason)
    return not failures
