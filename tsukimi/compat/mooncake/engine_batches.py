"""The batch-id part of `mooncake.engine.TransferEngine` (`BatchTransfers`): asynchronous
submits that return a batch id (0 when nothing was submitted), and the two ways of collecting
one, over tsukimi.compat.batches.BatchTable, which this part owns:

    batch_id = te.batch_transfer_async_write(peer, buffers, peer_addresses, lengths)
    te.get_batch_transfer_status([batch_id])  # waits; 0 when every request completed; frees the ids
    batch_id = te.transfer_submit_write(peer, buffer, peer_address, length)
    te.transfer_check_status(batch_id)        # 0 pending, 1 completed, -1 failed (then freed)
"""

from __future__ import annotations

import logging

from tsukimi.compat.batches import BatchId, BatchTable
from tsukimi.compat.mooncake.engine_codes import FAILED, OK, failed
from tsukimi.compat.mooncake.engine_transfers import TransferBatch, build_requests
from tsukimi.errors import ConfigError, TsukimiError
from tsukimi.transfer import RequestState, RequestStatus, TransferEngine

logger = logging.getLogger(__name__)

NO_BATCH = 0  # what an asynchronous submit returns when it submitted nothing
CHECK_PENDING, CHECK_COMPLETED = 0, 1


class BatchTransfers:
    """The batches submitted through the engine `initialize` started (None: every call fails
    as Mooncake's uninitialized engine does); the facade replaces this part at close."""

    def __init__(self, engine: TransferEngine | None) -> None:
        self._engine = engine
        self._table = BatchTable(engine) if engine is not None else None

    def submit(self, batch: TransferBatch) -> int:
        """Start the transfers; their batch id, or 0 when nothing was started (an unknown
        peer, bad arguments, not initialized)."""
        engine, table = self._engine, self._table
        if engine is None or table is None:
            logger.error("batch_transfer_async: call initialize() first")
            return NO_BATCH
        try:
            requests = build_requests(engine, batch)
        except TsukimiError as exc:
            failed(f"submitting to {batch.target}", exc)
            return NO_BATCH
        batch_id = table.allocate(max(1, len(requests)))
        try:
            table.submit(batch_id, requests)
        except TsukimiError as exc:  # a caller error: nothing started
            table.free(batch_id)
            failed(f"submitting to {batch.target}", exc)
            return NO_BATCH
        return batch_id

    def wait(self, batch_ids: list[int]) -> int:
        """Wait for every batch (each bounded by its requests' deadline) and free it: 0 when
        every request of every batch completed, -1 otherwise (an unknown id included)."""
        table = self._table
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

    def check(self, batch_id: int) -> int:
        """0 while the batch is pending; once it ended (the id is then freed) 1 when every
        request completed, -1 when one failed; -1 for an unknown id."""
        table = self._table
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
