"""The Transfer Engine conformance suite: properties every transport must have, as checks
that run against any factory of engine pairs (after trio's `check_half_closeable_stream`).

Each check takes a PairMaker (`engine_pairs`) and makes the pairs it needs; TRANSPORT_CHECKS
lists them in order; `check_transport(make_pair)` runs them all:

    from tsukimi.testing.engine_pairs import pair_maker
    from tsukimi.testing.transport_checks import check_transport
    check_transport(pair_maker("tcp-4"))

The pair's initiator should force its transport ("shm", "cma" or "tcp", not "auto"): where
they word a failure differently (a released buffer), the check expects the forced one's words.
Properties that need the peer in another process (SIGKILL, SIGSTOP) stay in
tests/transfer/test_conformance.py.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from tsukimi.errors import OutOfBounds, SegmentNotFound
from tsukimi.testing.assertions import raises, run_checks
from tsukimi.testing.engine_pairs import KIB, MIB, TARGET_BYTES, Pair, PairMaker
from tsukimi.transfer import Notification, OpCode, RequestState, TransferRequest, first_error


def _remote(pair: Pair) -> npt.NDArray[np.uint8]:
    return np.frombuffer(pair.buf.view, np.uint8)


def random_round_trips_are_byte_exact(make_pair: PairMaker) -> None:
    """1000 writes then reads of random lengths (1 B to 300 KiB: several slices) at random
    offsets land in the owner's memory and read back byte-exact."""
    rng = random.Random(1234)
    with make_pair() as pair:
        seg = pair.initiator.open_segment("target")
        remote = _remote(pair)
        for _ in range(1000):
            length = rng.choice([1, 7, 4096, rng.randrange(1, 300 * KIB)])
            offset = rng.randrange(0, TARGET_BYTES - length + 1)
            data = np.frombuffer(rng.randbytes(length), np.uint8)
            pair.initiator.write(seg, pair.buf.base + offset, data)
            assert np.array_equal(remote[offset : offset + length], data), f"write of {length} B at {offset}"
            back = np.zeros(length, np.uint8)
            pair.initiator.read(seg, pair.buf.base + offset, back)
            assert np.array_equal(back, data), f"read of {length} B at {offset}"


def hundred_async_requests_in_one_batch(make_pair: PairMaker) -> None:
    """100 writes through transfer_async, then 100 reads in one submitted batch awaited with
    wait_async: all complete, each moves its 16 KiB, and the data round-trips."""
    rng = np.random.default_rng(7)
    blocks = [rng.integers(0, 256, 16 * KIB, dtype=np.uint8) for _ in range(100)]
    with make_pair() as pair:
        seg = pair.initiator.open_segment("target")

        async def go() -> list[RequestState]:
            writes = [TransferRequest(OpCode.WRITE, seg, pair.buf.base + i * 16 * KIB, b) for i, b in enumerate(blocks)]
            statuses = await pair.initiator.transfer_async(writes)
            return [s.state for s in statuses]

        assert asyncio.run(go()) == [RequestState.COMPLETED] * 100
        backs = [np.zeros(16 * KIB, np.uint8) for _ in range(100)]
        batch = pair.initiator.submit(
            [TransferRequest(OpCode.READ, seg, pair.buf.base + i * 16 * KIB, b) for i, b in enumerate(backs)]
        )
        statuses = asyncio.run(batch.wait_async())
    assert batch.done and all(r.state is RequestState.COMPLETED for r in statuses)
    assert all(r.transferred_bytes == 16 * KIB for r in statuses)
    assert all(np.array_equal(a, b) for a, b in zip(blocks, backs, strict=False))


def out_of_bounds_fails_and_the_peer_keeps_serving(make_pair: PairMaker) -> None:
    """Requests straddling the buffer's end or beyond every buffer fail as out_of_bounds and
    touch nothing; the valid request of the same batch completes; the peer keeps serving."""
    with make_pair() as pair:
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
        assert all(s.error_code == "out_of_bounds" and "outside" in s.reason for s in statuses[:2]), statuses
        assert isinstance(statuses[0].error(), OutOfBounds)
        assert bytes(_remote(pair)[end - pair.buf.base - 10 :]) == bytes(10)  # nothing was touched
        with raises(OutOfBounds):
            pair.initiator.read(seg, end, bytearray(1))
        back = bytearray(4)
        pair.initiator.read(seg, pair.buf.base, back)
        assert back == b"fine"


def a_released_buffer_is_not_written(make_pair: PairMaker) -> None:
    """The initiator's cached descriptor still lists a buffer the owner released; the owner
    must refuse the write as out of bounds (shm sees the file unlinked; cma the owner's
    registration version move; tcp's server no longer finds the buffer), and keep serving its
    other buffers."""
    with make_pair() as pair:
        extra = pair.target.allocate(MIB)
        seg = pair.initiator.open_segment("target")
        pair.initiator.write(seg, extra.base, b"before")
        pair.target.unregister(extra.base)
        status = pair.initiator.transfer([TransferRequest(OpCode.WRITE, seg, extra.base, b"after")])[0]
        tcp = pair.initiator.config.transport == "tcp"
        assert status.state is RequestState.FAILED, status
        assert status.error_code == "out_of_bounds" and isinstance(status.error(), OutOfBounds), status
        assert ("not inside a registered buffer" if tcp else "released") in status.reason, status
        pair.initiator.write(seg, pair.buf.base, b"still serving")


def regression_a_peers_out_of_bounds_arrives_as_out_of_bounds(make_pair: PairMaker) -> None:
    """The peer (not this side's descriptor check) refuses a range it no longer has: the
    caller gets OutOfBounds, not a generic transfer error."""
    with make_pair() as pair:
        extra = pair.target.allocate(MIB)
        seg = pair.initiator.open_segment("target")
        pair.initiator.write(seg, extra.base, b"cached")  # the initiator now believes the range exists
        pair.target.unregister(extra.base)
        with raises(OutOfBounds):
            pair.initiator.read(seg, extra.base, bytearray(6))


def unknown_segment_is_a_clear_error(make_pair: PairMaker) -> None:
    """Opening or writing to a segment nobody published raises SegmentNotFound naming it."""
    with make_pair() as pair:
        with raises(SegmentNotFound, match="no-such-segment"):
            pair.initiator.open_segment("no-such-segment")
        with raises(SegmentNotFound):
            pair.initiator.write("no-such-segment", 0, b"x")


def concurrent_batches_from_several_threads(make_pair: PairMaker) -> None:
    """8 threads, each 20 rounds of a 4-request write batch then read batch on its own region:
    every round-trip is byte-exact and no thread hangs."""
    errors: list[BaseException] = []
    region = TARGET_BYTES // 8
    with make_pair() as pair:
        seg = pair.initiator.open_segment("target")

        def worker(index: int) -> None:
            rng = np.random.default_rng(index)
            try:
                for _ in range(20):
                    blocks = [rng.integers(0, 256, region // 4, dtype=np.uint8) for _ in range(4)]
                    base = pair.buf.base + index * region
                    step = region // 4
                    writes = [TransferRequest(OpCode.WRITE, seg, base + i * step, b) for i, b in enumerate(blocks)]
                    assert first_error(pair.initiator.transfer(writes)) is None
                    backs = [np.zeros(step, np.uint8) for _ in range(4)]
                    reads = [TransferRequest(OpCode.READ, seg, base + i * step, b) for i, b in enumerate(backs)]
                    assert first_error(pair.initiator.transfer(reads)) is None
                    assert all(np.array_equal(a, b) for a, b in zip(blocks, backs, strict=False))
            except BaseException as exc:  # collected and re-raised in the calling thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors[0]
        assert not any(t.is_alive() for t in threads), "a thread hung"


def a_notification_follows_its_transfer(make_pair: PairMaker) -> None:
    """Three rounds of a write then a notification: when the target takes each notification
    (name and message exact, in order), the data it announces is already in its memory; a
    probe of the target answers."""
    with make_pair() as pair:
        seg = pair.initiator.open_segment("target")
        remote = _remote(pair)
        for i in range(3):
            data = np.full(300 * KIB, i + 1, np.uint8)
            pair.initiator.write(seg, pair.buf.base, data)
            pair.initiator.notify(seg, Notification(f"round-{i}", bytes([i]) * 10))
            got = pair.target.notifications(timeout_s=5.0)
            assert got == [Notification(f"round-{i}", bytes([i]) * 10)], got
            assert np.array_equal(remote[: len(data)], data), f"round {i}: notified before the data landed"
        assert pair.initiator.probe(seg) >= 0.0
        assert pair.initiator.notifications() == []  # nothing was sent the other way


TRANSPORT_CHECKS: tuple[Callable[[PairMaker], None], ...] = (
    random_round_trips_are_byte_exact,
    hundred_async_requests_in_one_batch,
    out_of_bounds_fails_and_the_peer_keeps_serving,
    a_released_buffer_is_not_written,
    regression_a_peers_out_of_bounds_arrives_as_out_of_bounds,
    unknown_segment_is_a_clear_error,
    concurrent_batches_from_several_threads,
    a_notification_follows_its_transfer,
)


def check_transport(make_pair: PairMaker) -> None:
    """Run every check of TRANSPORT_CHECKS against `make_pair`, in order.

    Raises:
        AssertionError (or the engine's own error) from the first check that fails, with a
        note naming it.
    """
    run_checks("transport", TRANSPORT_CHECKS, make_pair)
