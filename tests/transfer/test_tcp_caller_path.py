"""The tcp transport's caller-thread paths (issue 27): a small list that `transfer()` waits
for is answered on the caller's thread (`submit_waiting`), and one seen before runs as a
prepared call over an idle connection (`TcpTransport.prepare`). Both must leave every
connection's stream in step with whatever else uses it, end by the deadline when the peer
stops (one that dies: test_conformance.py's `small` case), and never run from `submit()`,
which must not wait."""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from tsukimi.config import Config, MetadataConfig, TransferConfig
from tsukimi.testing.engine_pairs import initiator_config
from tsukimi.testing.processes import JsonWorker
from tsukimi.transfer import Batch, OpCode, RequestState, TransferEngine, TransferRequest
from tsukimi.transfer.plan_memo import Remembered

KIB, MIB = 1 << 10, 1 << 20


@pytest.fixture
def tcp_pair() -> Iterator[tuple[TransferEngine, TransferEngine, int, np.ndarray]]:
    """An owner with 4 MiB of plain memory registered, and a user that reaches it over tcp."""
    url = f"memory://{uuid.uuid4().hex}"
    user_cfg = Config(TransferConfig(transport="tcp", timeout_s=5.0), MetadataConfig(url))
    with (
        TransferEngine("owner", Config(metadata=MetadataConfig(url))) as owner,
        TransferEngine("user", user_cfg) as user,
    ):
        memory = np.zeros(4 * MIB, np.uint8)
        yield owner, user, owner.register(memory), memory


def _remembered(user: TransferEngine, requests: list[TransferRequest]) -> Remembered | None:
    keyed = user._memo.key(requests)
    assert keyed is not None
    entry = user._memo._entries.get(keyed[0])
    return entry if isinstance(entry, Remembered) else None


def test_a_small_list_is_prepared_and_a_large_one_striped(
    tcp_pair: tuple[TransferEngine, TransferEngine, int, np.ndarray],
) -> None:
    _, user, base, _ = tcp_pair
    small = np.ones(256 * KIB, np.uint8)
    large = np.ones(4 * MIB, np.uint8)
    four = [
        TransferRequest(OpCode.WRITE, "owner", base + i * 64 * KIB, small[i * 64 * KIB :], 64 * KIB) for i in range(4)
    ]
    nine = [TransferRequest(OpCode.WRITE, "owner", base + i * KIB, small[i * KIB :], KIB) for i in range(9)]
    assert user.prepare(four).fast
    assert not user.prepare([TransferRequest(OpCode.WRITE, "owner", base, large)]).fast  # over COALESCE_BYTES
    assert not user.prepare(nine).fast  # more than pipeline_depth requests: the sender pipelines them


def test_transfer_takes_the_prepared_call_and_submit_never_does(
    tcp_pair: tuple[TransferEngine, TransferEngine, int, np.ndarray],
) -> None:
    _, user, base, memory = tcp_pair
    data = np.arange(128 * KIB, dtype=np.uint32).view(np.uint8)[: 128 * KIB].copy()
    back = np.zeros_like(data)
    writes = [
        TransferRequest(OpCode.WRITE, "owner", base + i * 32 * KIB, data[i * 32 * KIB :], 32 * KIB) for i in range(4)
    ]
    reads = [
        TransferRequest(OpCode.READ, "owner", base + i * 32 * KIB, back[i * 32 * KIB :], 32 * KIB) for i in range(4)
    ]
    for _ in range(3):  # planned, remembered, then the prepared call
        assert all(s.state is RequestState.COMPLETED for s in user.transfer(writes))
        assert all(s.transferred_bytes == 32 * KIB for s in user.transfer(reads))
    entry = _remembered(user, reads)
    assert entry is not None and entry.fast is not None and not entry.inline
    assert np.array_equal(back, data) and np.array_equal(memory[: 128 * KIB], data)
    batch = user._start(reads, None, waiting=False)  # what submit runs: never the blocking call
    assert isinstance(batch, Batch)
    assert all(s.state is RequestState.COMPLETED for s in batch.wait())
    assert isinstance(user._start(reads, None, waiting=True), list)  # transfer's: the prepared call's statuses


def test_caller_paths_and_the_connection_threads_interleave_byte_exact(
    tcp_pair: tuple[TransferEngine, TransferEngine, int, np.ndarray],
) -> None:
    """Threads that repeat small lists (prepared calls), send fresh ones (answered on their
    own thread) and submit large ones (the connection threads) share one pool: every byte
    lands where it should and every request completes."""
    _, user, base, memory = tcp_pair
    region = 512 * KIB
    failures: list[str] = []

    def repeat(slot: int) -> None:
        at = base + slot * region
        data = np.full(64 * KIB, slot + 1, np.uint8)
        back = np.zeros(4 * 16 * KIB, np.uint8)
        writes = [
            TransferRequest(OpCode.WRITE, "owner", at + i * 16 * KIB, data[i * 16 * KIB :], 16 * KIB) for i in range(4)
        ]
        reads = [
            TransferRequest(OpCode.READ, "owner", at + i * 16 * KIB, back[i * 16 * KIB :], 16 * KIB) for i in range(4)
        ]
        for round_no in range(150):
            data[:] = (slot * 50 + round_no) % 251
            back[:] = 0
            statuses = user.transfer(writes) + user.transfer(reads)
            if any(s.state is not RequestState.COMPLETED for s in statuses):
                failures.append(f"slot {slot}: {statuses}")
            elif not np.array_equal(back, data):
                failures.append(f"slot {slot} round {round_no}: read back other bytes")

    def fresh(slot: int) -> None:
        at = base + slot * region
        for round_no in range(150):
            shift = (round_no % 64) * 64  # a list never seen twice in a row: the waiting-caller path
            data = np.full(8 * KIB, round_no % 200 + 1, np.uint8)
            back = np.zeros_like(data)
            statuses = user.transfer([TransferRequest(OpCode.WRITE, "owner", at + shift, data)])
            statuses += user.transfer([TransferRequest(OpCode.READ, "owner", at + shift, back)])
            if any(s.state is not RequestState.COMPLETED for s in statuses) or not np.array_equal(back, data):
                failures.append(f"fresh slot {slot} round {round_no}: {statuses}")

    def large(slot: int) -> None:
        at = base + slot * region
        data = np.full(region, 9, np.uint8)
        for _ in range(20):
            batch = user.submit([TransferRequest(OpCode.WRITE, "owner", at, data)])
            if any(s.state is not RequestState.COMPLETED for s in batch.wait()):
                failures.append(f"large slot {slot}: {batch.statuses()}")

    threads = [threading.Thread(target=repeat, args=(i,)) for i in range(3)]
    threads += [threading.Thread(target=fresh, args=(3 + i,)) for i in range(2)]
    threads += [threading.Thread(target=large, args=(5,))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a transfer hung"
    assert not failures, failures[:3]
    assert (memory[5 * region : 6 * region] == 9).all()


def test_an_error_answer_to_a_prepared_call_keeps_the_stream_in_step() -> None:
    """The owner releases a range the user still believes registered: the prepared call
    reads the OUT_OF_BOUNDS answer through, the redo reports it, and the same (only)
    connection then serves the next call byte-exact."""
    url = f"memory://{uuid.uuid4().hex}"
    user_cfg = Config(TransferConfig(transport="tcp", num_connections=1, timeout_s=5.0), MetadataConfig(url))
    with (
        TransferEngine("owner", Config(metadata=MetadataConfig(url))) as owner,
        TransferEngine("user", user_cfg) as user,
    ):
        kept, released = np.full(64 * KIB, 5, np.uint8), np.full(64 * KIB, 6, np.uint8)
        kept_base, released_base = owner.register(kept), owner.register(released)
        back = np.zeros(64 * KIB, np.uint8)
        stale = user.prepare([TransferRequest(OpCode.READ, "owner", released_base, back)])
        good = user.prepare([TransferRequest(OpCode.READ, "owner", kept_base, back)])
        assert stale.fast and good.fast
        assert stale.run()[0].state is RequestState.COMPLETED and (back == 6).all()
        owner.unregister(released_base)
        (status,) = stale.run()
        assert status.state is RequestState.FAILED and status.error_code == "out_of_bounds", status
        for _ in range(3):
            back[:] = 0
            assert good.run()[0].state is RequestState.COMPLETED and (back == 5).all()


def _wait_stopped(pid: int) -> None:
    """Until the kernel shows process `pid` stopped (state T), for at most 5 s."""
    until = time.monotonic() + 5
    while time.monotonic() < until:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rpartition(")")[2].split()[0] in ("T", "t"):
                return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop")


def test_a_prepared_call_to_a_stopped_peer_ends_by_its_deadline(target_process: JsonWorker) -> None:
    with TransferEngine(config=initiator_config("tcp-4", timeout_s=1.0)) as engine:
        seg = engine.open_segment(target_process.ready["name"])
        base = target_process.ready["base"]
        back = np.zeros(256 * KIB, np.uint8)
        reads = [
            TransferRequest(OpCode.READ, seg, base + i * 64 * KIB, back[i * 64 * KIB :], 64 * KIB) for i in range(4)
        ]
        for _ in range(3):
            assert all(s.state is RequestState.COMPLETED for s in engine.transfer(reads))
        target_process.send_signal(signal.SIGSTOP)
        try:
            _wait_stopped(target_process.pid)  # NOTE: else it may still answer these reads
            start = time.monotonic()
            statuses = engine.transfer(reads)
            elapsed = time.monotonic() - start
        finally:
            target_process.send_signal(signal.SIGCONT)
        assert {s.state for s in statuses} == {RequestState.TIMED_OUT}, statuses
        assert elapsed < 2.5  # the 1 s deadline, plus socket-tick and scheduling slack
        time.sleep(0.2)
        assert all(s.state is RequestState.COMPLETED for s in engine.transfer(reads))  # it serves again
