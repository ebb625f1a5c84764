"""One conformance suite, run against every transport: shm, tcp with 1 and with 4 connections,
tcp with a cluster secret.

The suite itself is tsukimi.testing.transport_checks (each check its own test here, per
transport setting of tsukimi.testing.engine_pairs.TRANSPORT_CASES). The two properties below
it need the peer in another process, to SIGKILL or SIGSTOP it, so they stay tests.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from tsukimi.testing.assertions import check_name
from tsukimi.testing.engine_pairs import MIB, TRANSPORT_CASES, PairMaker, initiator_config, pair_maker
from tsukimi.testing.processes import JsonWorker
from tsukimi.testing.transport_checks import TRANSPORT_CHECKS
from tsukimi.transfer import OpCode, RequestState, TransferEngine, TransferRequest


@pytest.mark.parametrize("check", TRANSPORT_CHECKS, ids=check_name)
@pytest.mark.parametrize("case", list(TRANSPORT_CASES))
def test_transport(case: str, check: Callable[[PairMaker], None]) -> None:
    if case == "nixl":
        pytest.importorskip("nixl_cu12", reason="the nixl transport needs `make nixl`")
    check(pair_maker(case))


@pytest.mark.parametrize(
    ("case", "small"), [("shm", False), ("cma", False), ("tcp-1", False), ("tcp-4", False), ("tcp-4", True)]
)
def test_peer_killed_mid_transfer_fails_within_the_timeout(case: str, small: bool, target_process: JsonWorker) -> None:
    """One 32 MiB write after another, or (`small`) the same 64 KiB x 4 reads again and again:
    tcp's prepared call on the caller's thread (tests/transfer/test_tcp_caller_path.py)."""
    timeout_s = 2.0
    with TransferEngine(config=initiator_config(case, timeout_s=timeout_s, slice_bytes=MIB)) as engine:
        seg = engine.open_segment(target_process.ready["name"])
        base = target_process.ready["base"]
        data = np.ones(256 * 1024 if small else 32 * MIB, np.uint8)
        engine.write(seg, base, data)  # the peer works
        step = 64 * 1024
        requests = (
            [TransferRequest(OpCode.READ, seg, base + i * step, data[i * step :], step) for i in range(4)]
            if small
            else [TransferRequest(OpCode.WRITE, seg, base, data)]
        )
        outcomes: list[tuple[float, set[RequestState]]] = []
        stop = threading.Event()

        def hammer() -> None:
            while not stop.is_set():
                outcomes.append((time.monotonic(), {status.state for status in engine.transfer(requests)}))

        thread = threading.Thread(target=hammer)
        thread.start()
        wait_until = time.monotonic() + 10
        while len(outcomes) < (20 if small else 1) and time.monotonic() < wait_until:  # mid-stream, not before
            time.sleep(0.01)
        killed_at = time.monotonic()
        target_process.kill()
        time.sleep(0.5)
        stop.set()
        thread.join(timeout=timeout_s * 3)
        assert not thread.is_alive(), "a transfer to a dead peer hung"
    after = [(t, s) for t, s in outcomes if t > killed_at]
    assert after, "no transfer ended after the kill"
    assert after[-1][1] <= {RequestState.FAILED, RequestState.TIMED_OUT}, after[-1]
    first_failure = min(t for t, s in after if RequestState.COMPLETED not in s)
    assert first_failure - killed_at < timeout_s + 1.0
    assert any(s == {RequestState.COMPLETED} for t, s in outcomes if t <= killed_at)


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
