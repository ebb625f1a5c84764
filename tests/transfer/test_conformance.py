"""One conformance suite, run against every transport: shm, tcp with 1 and with 4 connections.

Each test states a property every transport must have; the `pair` fixture supplies the
transport (see conftest.TRANSPORT_CASES).
"""

from __future__ import annotations

import asyncio
import random
import signal
import threading
import time

import numpy as np
import pytest

from tests.transfer.conftest import KIB, MIB, TARGET_BYTES, EnginePair, initiator_config
from tsukimi.errors import OutOfBounds, SegmentNotFound
from tsukimi.testing.processes import JsonWorker
from tsukimi.transfer import OpCode, RequestState, TransferEngine, TransferRequest


def _remote(pair: EnginePair) -> np.ndarray:
    return np.frombuffer(pair.buf.view, np.uint8)


def test_random_round_trips_are_byte_exact(pair: EnginePair) -> None:
    rng = random.Random(1234)
    seg = pair.initiator.open_segment("target")
    remote = _remote(pair)
    for _ in range(1000):
        length = rng.choice([1, 7, 4096, rng.randrange(1, 300 * KIB)])  # 300 KiB spans several slices
        offset = rng.randrange(0, TARGET_BYTES - length + 1)
        data = np.frombuffer(rng.randbytes(length), np.uint8)
        pair.initiator.write(seg, pair.buf.base + offset, data)
        assert np.array_equal(remote[offset : offset + length], data)  # landed in the owner's memory
        back = np.zeros(length, np.uint8)
        pair.initiator.read(seg, pair.buf.base + offset, back)
        assert np.array_equal(back, data)


def test_hundred_async_requests_in_one_batch(pair: EnginePair) -> None:
    rng = np.random.default_rng(7)
    blocks = [rng.integers(0, 256, 16 * KIB, dtype=np.uint8) for _ in range(100)]
    seg = pair.initiator.open_segment("target")

    async def go() -> list[RequestState]:
        writes = [TransferRequest(OpCode.WRITE, seg, pair.buf.base + i * 16 * KIB, b) for i, b in enumerate(blocks)]
        statuses = await pair.initiator.transfer_async(writes)
        return [s.state for s in statuses]

    assert asyncio.run(go()) == [RequestState.COMPLETED] * 100
    backs = [np.zeros(16 * KIB, np.uint8) for _ in range(100)]
    batch = pair.initiator.allocate_batch(100)
    pair.initiator.submit(
        batch, [TransferRequest(OpCode.READ, seg, pair.buf.base + i * 16 * KIB, b) for i, b in enumerate(backs)]
    )
    status = asyncio.run(pair.initiator.wait_async(batch))
    pair.initiator.free_batch(batch)
    assert status.done and all(r.state is RequestState.COMPLETED for r in status.requests)
    assert all(r.transferred_bytes == 16 * KIB for r in status.requests)
    assert all(np.array_equal(a, b) for a, b in zip(blocks, backs, strict=False))


def test_out_of_bounds_fails_and_the_peer_keeps_serving(pair: EnginePair) -> None:
    seg = pair.initiator.open_segment("target")
    end = pair.buf.base + TARGET_BYTES
    statuses = pair.initiator.transfer(
        [
            TransferRequest(OpCode.WRITE, seg, end - 10, b"x" * 20),  # straddles the end
            TransferRequest(OpCode.READ, seg, end + MIB, bytearray(10)),  # beyond every buffer
            TransferRequest(OpCode.WRITE, seg, pair.buf.base, b"fine"),
        ]
    )
    assert [s.state for s in statuses] == [RequestState.FAILED, RequestState.FAILED, RequestState.COMPLETED]
    assert all(s.error_code == "out_of_bounds" and "outside" in s.reason for s in statuses[:2])
    assert isinstance(statuses[0].error(), OutOfBounds)
    assert bytes(_remote(pair)[end - pair.buf.base - 10 :]) == bytes(10)  # nothing was touched
    with pytest.raises(OutOfBounds):
        pair.initiator.read(seg, end, bytearray(1))
    back = bytearray(4)
    pair.initiator.read(seg, pair.buf.base, back)
    assert back == b"fine"


def test_a_released_buffer_is_not_written(pair: EnginePair) -> None:
    """The initiator's cached descriptor still lists the buffer; the owner must refuse."""
    extra = pair.target.allocate(MIB)
    seg = pair.initiator.open_segment("target")
    pair.initiator.write(seg, extra.base, b"before")
    pair.target.unregister(extra.base)
    status = pair.initiator.transfer([TransferRequest(OpCode.WRITE, seg, extra.base, b"after")])[0]
    assert status.state is RequestState.FAILED
    # shm sees the file unlinked; tcp's server no longer finds the buffer
    assert status.error_code == ("peer" if pair.case == "shm" else "out_of_bounds")
    assert ("released" if pair.case == "shm" else "not inside a registered buffer") in status.reason
    pair.initiator.write(seg, pair.buf.base, b"still serving")


def test_unknown_segment_is_a_clear_error(pair: EnginePair) -> None:
    with pytest.raises(SegmentNotFound, match="no-such-segment"):
        pair.initiator.open_segment("no-such-segment")
    with pytest.raises(SegmentNotFound):
        pair.initiator.write("no-such-segment", 0, b"x")


def test_concurrent_batches_from_several_threads(pair: EnginePair) -> None:
    seg = pair.initiator.open_segment("target")
    errors: list[BaseException] = []
    region = TARGET_BYTES // 8

    def worker(index: int) -> None:
        rng = np.random.default_rng(index)
        try:
            for _ in range(20):
                blocks = [rng.integers(0, 256, region // 4, dtype=np.uint8) for _ in range(4)]
                base = pair.buf.base + index * region
                pair.initiator.batch_write(seg, [(base + i * (region // 4), b) for i, b in enumerate(blocks)])
                backs = [np.zeros(region // 4, np.uint8) for _ in range(4)]
                pair.initiator.batch_read(seg, [(base + i * (region // 4), b) for i, b in enumerate(backs)])
                assert all(np.array_equal(a, b) for a, b in zip(blocks, backs, strict=False))
        except BaseException as exc:  # collected and re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors[0]
    assert not any(t.is_alive() for t in threads)


@pytest.mark.parametrize("case", ["shm", "tcp-1", "tcp-4"])
def test_peer_killed_mid_transfer_fails_within_the_timeout(case: str, target_process: JsonWorker) -> None:
    timeout_s = 2.0
    with TransferEngine(config=initiator_config(case, timeout_s=timeout_s, slice_bytes=MIB)) as engine:
        seg = engine.open_segment(target_process.ready["name"])
        base = target_process.ready["base"]
        data = np.ones(32 * MIB, np.uint8)
        engine.write(seg, base, data)  # the peer works
        outcomes: list[tuple[float, RequestState]] = []
        stop = threading.Event()

        def hammer() -> None:
            while not stop.is_set():
                status = engine.transfer([TransferRequest(OpCode.WRITE, seg, base, data)])[0]
                outcomes.append((time.monotonic(), status.state))

        thread = threading.Thread(target=hammer)
        thread.start()
        wait_until = time.monotonic() + 10
        while not outcomes and time.monotonic() < wait_until:  # kill mid-stream, not before it
            time.sleep(0.01)
        killed_at = time.monotonic()
        target_process.kill()
        time.sleep(0.5)
        stop.set()
        thread.join(timeout=timeout_s * 3)
        assert not thread.is_alive(), "a transfer to a dead peer hung"
    after = [(t, s) for t, s in outcomes if t > killed_at]
    assert after, "no transfer ended after the kill"
    assert after[-1][1] in (RequestState.FAILED, RequestState.TIMED_OUT)
    first_failure = min(t for t, s in after if s is not RequestState.COMPLETED)
    assert first_failure - killed_at < timeout_s + 1.0
    assert any(s is RequestState.COMPLETED for t, s in outcomes if t <= killed_at)


def test_a_stalled_tcp_peer_times_out(target_process: JsonWorker) -> None:
    with TransferEngine(config=initiator_config("tcp-4", timeout_s=1.0)) as engine:
        seg = engine.open_segment(target_process.ready["name"])
        engine.write(seg, target_process.ready["base"], b"warm")
        target_process.send_signal(signal.SIGSTOP)
        try:
            start = time.monotonic()
            status = engine.transfer(
                [TransferRequest(OpCode.WRITE, seg, target_process.ready["base"], bytes(16 * MIB))]
            )[0]
            elapsed = time.monotonic() - start
        finally:
            target_process.send_signal(signal.SIGCONT)
        assert status.state is RequestState.TIMED_OUT
        assert 0.9 < elapsed < 2.5  # the 1 s deadline, plus socket-tick and scheduling slack
