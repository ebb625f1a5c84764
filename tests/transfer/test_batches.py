"""Mooncake's batch-id API (tsukimi/compat/batches.py) and the engine's submit contract:
capacity, validation before anything starts, free, close."""

from __future__ import annotations

import signal

import pytest

from tsukimi.compat.batches import BatchTable
from tsukimi.errors import ClosedError, ConfigError, InvalidBufferError, MetadataError, OutOfBounds, TransferError
from tsukimi.testing.engine_pairs import MIB, EnginePair, initiator_config
from tsukimi.testing.processes import JsonWorker
from tsukimi.transfer import OpCode, RequestState, TransferEngine, TransferRequest
from tsukimi.transfer.metadata.memory import MemoryMetadata


def test_capacity_and_validation_come_before_any_transfer(pair: EnginePair) -> None:
    table = BatchTable(pair.initiator)
    seg = pair.initiator.open_segment("target")
    batch = table.allocate(2)
    ok = TransferRequest(OpCode.WRITE, seg, pair.buf.base, b"one")
    with pytest.raises(OutOfBounds, match="at most 2"):
        table.submit(batch, [ok, ok, ok])
    with pytest.raises(InvalidBufferError, match="writable"):
        table.submit(batch, [ok, TransferRequest(OpCode.READ, seg, pair.buf.base, b"read-only dst")])
    with pytest.raises(InvalidBufferError, match="does not fit"):
        table.submit(batch, [TransferRequest(OpCode.WRITE, seg, pair.buf.base, b"abc", length=10)])
    assert table.status(batch).requests == []  # nothing was started by the refused submits
    assert bytes(pair.buf.view[:3]) == b"\x00\x00\x00"
    table.submit(batch, [ok])
    table.submit(batch, [TransferRequest(OpCode.WRITE, seg, pair.buf.base + 3, b"two")])
    status = table.wait(batch)
    assert status.done and [r.state for r in status.requests] == [RequestState.COMPLETED] * 2
    assert bytes(pair.buf.view[:6]) == b"onetwo"
    with pytest.raises(OutOfBounds, match="at most 2"):  # the capacity counts every submit
        table.submit(batch, [ok])
    table.free(batch)
    with pytest.raises(ConfigError, match="no batch"):
        table.status(batch)


def test_local_offset_and_length_select_part_of_the_buffer(pair: EnginePair) -> None:
    engine = pair.initiator
    local = bytearray(b"0123456789")
    engine.transfer([TransferRequest(OpCode.WRITE, "target", pair.buf.base, local, length=4, local_offset=3)])
    assert bytes(pair.buf.view[:5]) == b"3456\x00"


def test_free_batch_refuses_pending_requests(target_process: JsonWorker) -> None:
    with TransferEngine(config=initiator_config("tcp-1")) as engine:
        seg = engine.open_segment(target_process.ready["name"])
        target_process.send_signal(signal.SIGSTOP)  # the peer cannot answer: the request stays pending
        table = BatchTable(engine)
        try:
            batch = table.allocate(1)
            table.submit(batch, [TransferRequest(OpCode.READ, seg, target_process.ready["base"], bytearray(MIB))])
            assert table.status(batch).requests[0].state is RequestState.PENDING
            with pytest.raises(TransferError, match="pending"):
                table.free(batch)
        finally:
            target_process.send_signal(signal.SIGCONT)
        assert table.wait(batch).requests[0].state is RequestState.COMPLETED
        table.free(batch)


def test_closed_engine_refuses_work(pair: EnginePair) -> None:
    engine = pair.initiator
    engine.close()
    with pytest.raises(ClosedError):
        engine.submit([])
    with pytest.raises(ClosedError):
        engine.open_segment("target")
    engine.close()  # idempotent


def test_bad_arguments(pair: EnginePair) -> None:
    engine = pair.initiator
    with pytest.raises(ConfigError):
        BatchTable(engine).allocate(0)
    with pytest.raises(ConfigError, match="transport"):
        engine.open_segment("target", transport="rdma")
    with pytest.raises(OutOfBounds, match="64-bit address space"):
        engine.write("target", -1, b"x")
    with pytest.raises(ConfigError, match="OpCode"):
        engine.transfer([TransferRequest("write", "target", 0, b"x")])  # type: ignore[arg-type]


class _FailingMetadata(MemoryMetadata):
    """Works until `broken` is set, then every get fails like an unreachable service."""

    broken = False

    def get(self, key: str) -> bytes | None:
        if self.broken:
            raise MetadataError("metadata service unreachable (test)")
        return super().get(key)


def test_regression_metadata_failure_on_refetch_fails_the_request_not_the_batch() -> None:
    """A re-fetch that raised used to leave the request PENDING forever, hanging wait()."""
    store = _FailingMetadata.named(f"flaky-{id(object())}")
    with TransferEngine("owner", metadata=store) as owner, TransferEngine("user", metadata=store) as user:
        buf = owner.allocate(4096)
        seg = user.open_segment("owner")
        store.broken = True
        statuses = user.transfer(
            [
                TransferRequest(OpCode.WRITE, seg, buf.base, b"known range: no fetch"),
                TransferRequest(OpCode.WRITE, seg, buf.base + 8192, b"unknown range: fetch fails"),
            ],
            timeout_s=2.0,
        )
        store.broken = False
    assert [s.state for s in statuses] == [RequestState.COMPLETED, RequestState.FAILED]
    assert statuses[1].error_code == "metadata" and "unreachable" in statuses[1].reason
