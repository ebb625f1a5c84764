"""The plan memo (tsukimi/transfer/plan_memo.py): a request list submitted again is routed as
planning it anew would route it, takes the prepared call, keeps no caller's memory alive, and
is planned anew after anything it depends on changed (table-driven below)."""

from __future__ import annotations

import gc
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from tsukimi.config import Config, MetadataConfig, TransferConfig
from tsukimi.device import EmulatedDevice
from tsukimi.errors import InvalidBufferError
from tsukimi.transfer import OpCode, RequestState, TransferEngine, TransferRequest, plan_memo
from tsukimi.transfer.batch import Batch
from tsukimi.transfer.plan_memo import Remembered
from tsukimi.transfer.routing import Group
from tsukimi.transfer.transports import shm
from tsukimi.transfer.transports.shares import Latch, Share

KIB = 1 << 10


@pytest.fixture(scope="module", params=["shm", "cma", "tcp"])
def engines(request: pytest.FixtureRequest) -> Iterator[tuple[TransferEngine, TransferEngine, str]]:
    url = f"memory://{uuid.uuid4().hex}"
    user_cfg = Config(TransferConfig(transport=request.param), MetadataConfig(url))
    with (
        TransferEngine("owner", Config(metadata=MetadataConfig(url))) as owner,
        TransferEngine("user", user_cfg) as user,
    ):
        yield owner, user, request.param


def _target(owner: TransferEngine, transport: str, nbytes: int) -> tuple[int, np.ndarray]:
    """A registered buffer of the owner (shared memory for shm) and its bytes."""
    if transport == "shm":
        buf = owner.allocate(nbytes)
        return buf.base, np.frombuffer(buf.view, np.uint8)
    memory = np.zeros(nbytes, np.uint8)
    return owner.register(memory), memory


def _remembered(user: TransferEngine, requests: list[TransferRequest]) -> Remembered | None:
    keyed = user._memo.key(requests)
    assert keyed is not None
    entry = user._memo._entries.get(keyed[0])
    return entry if isinstance(entry, Remembered) else None


def _shape(groups: list[Group]) -> list[tuple[object, ...]]:
    return [
        (id(t), id(d), [(p.op, p.local.tobytes(), len(p.local), p.remote_offset, p.buffer) for p in pieces])
        for t, d, pieces in groups
    ]


def test_the_memo_routes_as_planning_anew_would(engines: tuple[TransferEngine, TransferEngine, str]) -> None:
    owner, user, transport = engines
    base, _ = _target(owner, transport, 1024 * KIB)
    local = np.arange(512 * KIB, dtype=np.uint32).view(np.uint8)[: 512 * KIB]
    requests = [
        TransferRequest(OpCode.WRITE, "owner", base + i * 64 * KIB, local, 48 * KIB, i * 32 * KIB) for i in range(8)
    ] + [TransferRequest(OpCode.READ, "owner", base + 600 * KIB, bytearray(100 * KIB))]
    for _ in range(2):
        assert all(s.state is RequestState.COMPLETED for s in user.transfer(requests))
    entry = _remembered(user, requests)
    assert entry is not None
    keyed = user._memo.key(requests)
    assert keyed is not None
    remembered = entry.slices(Batch([None] * len(requests), 1e18, user._clock).records, requests, keyed[1])
    plans = [user._routes.plan(req) for req in requests]
    anew = user._routes.group(Batch([None] * len(requests), 1e18, user._clock).records, plans)
    assert _shape(remembered) == _shape(anew)
    assert (entry.fast is not None) is (transport != "tcp")


def test_repeated_runs_move_the_current_bytes(engines: tuple[TransferEngine, TransferEngine, str]) -> None:
    owner, user, transport = engines
    base, remote = _target(owner, transport, 256 * KIB)
    data, back = np.zeros(64 * KIB, np.uint8), np.zeros(64 * KIB, np.uint8)
    writes = [
        TransferRequest(OpCode.WRITE, "owner", base + i * 16 * KIB, data[i * 16 * KIB :], 16 * KIB) for i in range(4)
    ]
    reads = [TransferRequest(OpCode.READ, "owner", base, back)]
    for round_no in range(4):
        data[:] = round_no + 1
        batch = user.submit(writes)
        assert [s.transferred_bytes for s in batch.wait()] == [16 * KIB] * 4 and batch.done
        assert all(s.state is RequestState.COMPLETED for s in user.transfer(reads))
        assert np.array_equal(back, data) and np.array_equal(remote[: 64 * KIB], data)


def test_a_remembered_write_from_read_only_memory_cuts_its_slices(
    engines: tuple[TransferEngine, TransferEngine, str],
) -> None:
    """`submit` of a remembered list it may not run as a prepared call (tcp's waits; a list
    of several peers has none) cuts the slices from the requests' buffers: a write's may be
    read-only (bytes), whichever way the key was made (tsukimi/transfer/native.py)."""
    owner, user, transport = engines
    base, remote = _target(owner, transport, 64 * KIB)
    data = bytes(range(256)) * 64
    requests = [
        TransferRequest(OpCode.WRITE, "owner", base + i * 4 * KIB, data[i * 4 * KIB :], 4 * KIB) for i in range(4)
    ]
    for _ in range(4):  # planned, remembered, then the memo: its prepared call, or its slices
        assert [s.state for s in user.submit(requests).wait()] == [RequestState.COMPLETED] * 4
        assert [s.state for s in user.transfer(requests)] == [RequestState.COMPLETED] * 4
    assert _remembered(user, requests) is not None and bytes(remote[: 16 * KIB]) == data[: 16 * KIB]


@pytest.mark.parametrize("transport", ["shm", "cma", "tcp"])
def test_a_list_over_two_peers_runs_each_peers_prepared_call(transport: str) -> None:
    """A store get or put moves one list to several holders: the memo runs each peer's
    prepared call in turn (same-host copies; tcp's slices go to every peer at once), and a
    peer that released its buffer fails its own requests only."""
    url = f"memory://{uuid.uuid4().hex}"
    with (
        TransferEngine("owner", Config(metadata=MetadataConfig(url))) as owner,
        TransferEngine("owner-2", Config(metadata=MetadataConfig(url))) as other,
        TransferEngine("user", Config(TransferConfig(transport=transport), MetadataConfig(url))) as user,
    ):
        base, remote = _target(owner, transport, 64 * KIB)
        base2, remote2 = _target(other, transport, 64 * KIB)
        data = np.zeros(64 * KIB, np.uint8)
        requests = [
            TransferRequest(
                OpCode.WRITE,
                "owner" if i % 2 == 0 else "owner-2",
                (base, base2)[i % 2] + i * 8 * KIB,
                data[i * 8 * KIB :],
                8 * KIB,
            )
            for i in range(4)
        ]
        for round_no in range(4):
            data[:] = np.arange(64 * KIB) % 251 + round_no
            assert [s.state for s in user.transfer(requests)] == [RequestState.COMPLETED] * 4
            for i in range(4):
                landed = (remote, remote2)[i % 2][i * 8 * KIB : (i + 1) * 8 * KIB]
                assert np.array_equal(landed, data[i * 8 * KIB : (i + 1) * 8 * KIB]), (round_no, i)
        entry = _remembered(user, requests)
        assert entry is not None and len(entry.groups) == 2 and (entry.fast is not None) == (transport != "tcp")
        if transport != "tcp":  # NOTE: the prepared calls alone move it: the slices would raise
            routes, hand_off = user._routes, user._routes.hand_off
            routes.hand_off = lambda *args, **kwargs: pytest.fail("the slices path ran")  # type: ignore[method-assign]
            data[:] = 9
            try:
                assert [s.state for s in user.transfer(requests)] == [RequestState.COMPLETED] * 4
            finally:
                routes.hand_off = hand_off  # type: ignore[method-assign]
            assert (remote[: 8 * KIB] == 9).all() and (remote2[24 * KIB : 32 * KIB] == 9).all()
        other.unregister(base2)
        for _ in range(2):
            statuses = user.transfer(requests)
            assert [s.state for s in statuses[::2]] == [RequestState.COMPLETED] * 2
            assert [s.error_code for s in statuses[1::2]] == ["out_of_bounds"] * 2, statuses


def test_the_memo_keeps_no_buffer_alive(engines: tuple[TransferEngine, TransferEngine, str]) -> None:
    owner, user, transport = engines
    if transport == "tcp":
        pytest.skip("tcp's connections keep views of their last slices (as before the memo)")
    base, _ = _target(owner, transport, 64 * KIB)
    local = np.ones(64 * KIB, np.uint8)
    ref = weakref.ref(local)
    requests = [TransferRequest(OpCode.WRITE, "owner", base, local)]
    for _ in range(3):
        user.transfer(requests)
    assert _remembered(user, requests) is not None
    del requests, local
    gc.collect()
    assert ref() is None


def test_a_read_into_read_only_memory_still_raises(engines: tuple[TransferEngine, TransferEngine, str]) -> None:
    owner, user, transport = engines
    base, _ = _target(owner, transport, 4 * KIB)
    memory = np.zeros(4 * KIB, np.uint8)
    user.transfer([TransferRequest(OpCode.READ, "owner", base, memory)])
    user.transfer([TransferRequest(OpCode.READ, "owner", base, memory)])
    frozen = memory.view()
    frozen.flags.writeable = False  # the same address and length, read-only
    with pytest.raises(InvalidBufferError):
        user.transfer([TransferRequest(OpCode.READ, "owner", base, frozen)])


# -- invalidation: each change, then the same list must be planned anew and say what planning says


def _peer_released(owner: TransferEngine, user: TransferEngine, base: int) -> None:
    owner.unregister(base)


def _peer_reregistered(owner: TransferEngine, user: TransferEngine, base: int) -> None:
    owner.register(np.zeros(4 * KIB, np.uint8))  # a new descriptor object once the user re-fetches
    user.lookup("owner", fresh=True)


def _local_registered(owner: TransferEngine, user: TransferEngine, base: int) -> None:
    user.register(np.zeros(4 * KIB, np.uint8))


def _local_unregistered(owner: TransferEngine, user: TransferEngine, base: int) -> None:
    user.unregister(user.register(np.zeros(4 * KIB, np.uint8)))


# (change, the state the same list then ends in, whether the memo sees the change at once:
# a release is noticed by the transport, which drops the stale descriptor)
CHANGES: list[tuple[Callable[[TransferEngine, TransferEngine, int], None], RequestState, bool]] = [
    (_peer_released, RequestState.FAILED, False),
    (_peer_reregistered, RequestState.COMPLETED, True),
    (_local_registered, RequestState.COMPLETED, True),
    (_local_unregistered, RequestState.COMPLETED, True),
]


@pytest.mark.parametrize(("change", "then", "at_once"), CHANGES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_change_makes_the_list_planned_anew(
    engines: tuple[TransferEngine, TransferEngine, str],
    change: Callable[[TransferEngine, TransferEngine, int], None],
    then: RequestState,
    at_once: bool,
) -> None:
    owner, user, transport = engines
    base, remote = _target(owner, transport, 64 * KIB)
    data = np.full(4 * KIB, 9, np.uint8)
    requests = [TransferRequest(OpCode.WRITE, "owner", base + 4 * KIB, data)]
    for _ in range(2):
        assert user.transfer(requests)[0].state is RequestState.COMPLETED
    keyed = user._memo.key(requests)
    assert keyed is not None and _remembered(user, requests) is not None
    change(owner, user, base)
    if at_once:
        assert user._memo.get(keyed[0])[0] is None
    (status,) = user.transfer(requests)
    assert status.state is then, status
    if then is RequestState.FAILED:
        assert status.error_code == "out_of_bounds"
        for _ in range(2):  # and again: never the stale route
            (status,) = user.transfer(requests)
            assert status.state is RequestState.FAILED and status.error_code == "out_of_bounds"
    else:
        assert np.array_equal(remote[4 * KIB : 8 * KIB], data)


def test_a_large_list_is_copied_by_the_caller_and_the_workers(
    engines: tuple[TransferEngine, TransferEngine, str],
) -> None:
    owner, user, transport = engines
    base, remote = _target(owner, transport, 8192 * KIB)
    data = np.random.default_rng(7).integers(0, 256, 8192 * KIB, dtype=np.uint8)  # above every inline limit
    step = 32 * KIB
    writes = [TransferRequest(OpCode.WRITE, "owner", base + i * step, data[i * step :], step) for i in range(256)]
    user.lookup("owner", fresh=True)  # NOTE: prepare routes with the cached descriptor only
    prepared = user.prepare(writes)
    assert prepared.fast is (transport != "tcp")
    for run in (prepared.run, *[lambda: user.transfer(writes)] * 3):  # planned, remembered, then the memo's call
        remote[:] = 0
        assert all(s.state is RequestState.COMPLETED for s in run())
        assert np.array_equal(remote, data)


def test_requests_to_the_engines_own_segment_are_copied_in_place() -> None:
    url = f"memory://{uuid.uuid4().hex}"
    with TransferEngine("self", Config(metadata=MetadataConfig(url))) as engine:
        memory = np.zeros(1024 * KIB, np.uint8)
        base = engine.register(memory)
        shared = engine.allocate(64 * KIB)
        assert engine.transport_for("self", base) == engine.transport_for("self", shared.base) == "local"
        assert engine.transport_for(engine.open_segment("self", "tcp"), base) == "tcp"
        data = np.random.default_rng(3).integers(0, 256, 512 * KIB, dtype=np.uint8)  # above MEMCPY_BYTES too
        back = np.zeros(4 * KIB, np.uint8)
        for _ in range(3):  # planned, seen, remembered
            assert engine.transfer([TransferRequest(OpCode.WRITE, "self", base + 4 * KIB, data)])[0].transferred_bytes
            engine.write("self", shared.base, data[: 4 * KIB])
            engine.read("self", base + 4 * KIB, back)
        assert np.array_equal(memory[4 * KIB : 516 * KIB], data) and np.array_equal(back, data[: 4 * KIB])
        assert bytes(shared.view[: 4 * KIB]) == data[: 4 * KIB].tobytes()
        engine.unregister(base)
        (status,) = engine.transfer([TransferRequest(OpCode.WRITE, "self", base + 4 * KIB, data)])
        assert status.state is RequestState.FAILED and status.error_code == "out_of_bounds", status


def test_address_buffers_are_remembered_unless_they_are_device_memory(
    engines: tuple[TransferEngine, TransferEngine, str],
) -> None:
    owner, user, transport = engines
    base, remote = _target(owner, transport, 64 * KIB)
    data = np.full(4 * KIB, 5, np.uint8)
    requests = [TransferRequest(OpCode.WRITE, "owner", base, (int(data.ctypes.data), 4 * KIB))]
    for round_no in range(3):
        data[:] = round_no + 5
        assert user.transfer(requests)[0].state is RequestState.COMPLETED
        assert np.array_equal(remote[: 4 * KIB], data)
    entry = _remembered(user, requests)
    assert entry is not None and entry.fast is not None
    with EmulatedDevice(0).alloc(4 * KIB) as device:  # registered device memory, named by address
        user.register(device)
        device.write(0, bytes(range(256)) * 16)
        on_device = [TransferRequest(OpCode.WRITE, "owner", base, (device.range.address, 4 * KIB))]
        states = {user.transfer(on_device)[0].state for _ in range(3)}  # cma refuses device memory
        assert states == {RequestState.FAILED if transport == "cma" else RequestState.COMPLETED}
        assert _remembered(user, on_device) is None
        if transport != "cma":
            assert bytes(remote[: 4 * KIB]) == bytes(range(256)) * 16
        user.unregister(device.range.address)


# -- review findings (each failed before its fix)


def _transport(user: TransferEngine, name: str) -> Any:
    return next(t for t in user._transports if t.name == name)


@pytest.fixture
def same_host(engines: tuple[TransferEngine, TransferEngine, str]) -> tuple[TransferEngine, TransferEngine, str]:
    """The engines where the transport copies with a pidfd and shares its prepared calls
    with copy workers (not tcp: tests/transfer/test_tcp_caller_path.py)."""
    if engines[2] == "tcp":
        pytest.skip("tcp has no pidfd and no copy workers")
    return engines


def test_a_release_between_first_and_second_sighting_is_out_of_bounds(
    engines: tuple[TransferEngine, TransferEngine, str],
) -> None:
    owner, user, transport = engines
    base, _ = _target(owner, transport, 64 * KIB)
    requests = [TransferRequest(OpCode.WRITE, "owner", base, np.ones(4 * KIB, np.uint8))]
    assert user.transfer(requests)[0].state is RequestState.COMPLETED
    owner.unregister(base)
    for _ in range(3):  # the second sighting prepares: it must leave the released file to the slices
        (status,) = user.transfer(requests)
        assert status.state is RequestState.FAILED and status.error_code == "out_of_bounds", status


def test_a_prepare_that_raises_still_hands_the_slices_off(
    same_host: tuple[TransferEngine, TransferEngine, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    owner, user, transport = same_host
    base, remote = _target(owner, transport, 64 * KIB)
    data = np.full(4 * KIB, 3, np.uint8)
    requests = [TransferRequest(OpCode.WRITE, "owner", base, data)]

    def released(*args: object) -> None:  # what a concurrent run's drop() makes prepare meet
        raise ValueError("operation forbidden on released memoryview object")

    monkeypatch.setattr(_transport(user, transport), "prepare", released)
    for _ in range(3):
        assert user.transfer(requests)[0].state is RequestState.COMPLETED
        assert user.prepare(requests).run()[0].state is RequestState.COMPLETED
    assert np.array_equal(remote[: 4 * KIB], data)


@pytest.mark.parametrize("nbytes", [64 * KIB, 2048 * KIB])  # inline, and handed to the workers
def test_a_pidfd_closed_under_a_submit_fails_as_a_peer_error(
    same_host: tuple[TransferEngine, TransferEngine, str], nbytes: int
) -> None:
    owner, user, transport = same_host
    base, _ = _target(owner, transport, nbytes)
    requests = [TransferRequest(OpCode.WRITE, "owner", base, np.ones(nbytes, np.uint8))]
    assert user.transfer(requests)[0].state is RequestState.COMPLETED
    state = _transport(user, transport)._peers.get(user.lookup("owner"))
    pidfd, state.pidfd = state.pidfd, -1  # closed: what PeerTable.close() leaves a straggler with
    try:
        for _ in range(3):  # planned, remembered (prepared), then the memo's fast path
            (status,) = user.submit(requests, timeout_s=5.0).wait()
            assert status.state is RequestState.FAILED and status.error_code == "peer", status
    finally:
        state.pidfd = pidfd
    assert user.transfer(requests)[0].state is RequestState.COMPLETED  # no worker died


def test_the_prepared_call_ends_by_its_deadline_when_the_workers_are_busy(
    same_host: tuple[TransferEngine, TransferEngine, str],
) -> None:
    owner, user, transport = same_host
    base, remote = _target(owner, transport, 8192 * KIB)  # above every inline limit: shared with the workers
    step = 1024 * KIB
    data = np.full(8192 * KIB, 4, np.uint8)
    writes = [TransferRequest(OpCode.WRITE, "owner", base + i * step, data[i * step :], step) for i in range(8)]
    for _ in range(2):
        assert all(s.state is RequestState.COMPLETED for s in user.transfer(writes))
    prepared = user.prepare(writes, timeout_s=0.3)
    assert prepared.fast
    workers = _transport(user, transport)._workers
    release = threading.Event()
    blocked = threading.Timer(8.0, release.set)  # NOTE: only so that a failing run ends
    blocked.start()
    try:
        for _ in range(len(workers._threads)):
            workers.put(Share(lambda: release.wait() or True, Latch(1)))
        for run in (lambda: user.transfer(writes, timeout_s=0.3), prepared.run):
            started = time.monotonic()
            statuses = run()
            assert time.monotonic() - started < 3.0
            assert {s.state for s in statuses} == {RequestState.TIMED_OUT}, statuses
    finally:
        release.set()
        blocked.cancel()
    remote[:] = 0
    assert all(s.state is RequestState.COMPLETED for s in user.transfer(writes))
    assert np.array_equal(remote, data)


def test_submit_takes_the_prepared_call_only_when_it_runs_inline(
    same_host: tuple[TransferEngine, TransferEngine, str],
) -> None:
    owner, user, transport = same_host
    base = _target(owner, transport, 8192 * KIB)[0]
    sizes = (8192 * KIB, 64 * KIB)
    large, small = ([TransferRequest(OpCode.WRITE, "owner", base, np.ones(n, np.uint8))] for n in sizes)
    for requests in (large, small):
        for _ in range(3):
            assert user.transfer(requests)[0].state is RequestState.COMPLETED
    large_entry, small_entry = _remembered(user, large), _remembered(user, small)
    assert large_entry is not None and small_entry is not None
    assert large_entry.fast is not None and not large_entry.inline and small_entry.inline
    batch = user._start(large, None, waiting=False)
    assert isinstance(batch, Batch)  # submit returns before the copy
    assert batch.wait()[0].state is RequestState.COMPLETED
    assert isinstance(user._start(small, None, waiting=False), list)
    assert isinstance(user._start(large, None, waiting=True), list)  # transfer waits anyway


def test_a_list_of_many_slices_is_not_remembered(
    engines: tuple[TransferEngine, TransferEngine, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    owner, user, transport = engines
    monkeypatch.setattr(plan_memo, "MEMO_MAX_SLICES", 4)
    base, _ = _target(owner, transport, 64 * KIB)
    data = np.ones(8 * KIB, np.uint8)
    requests = [TransferRequest(OpCode.WRITE, "owner", base + i * KIB, data[i * KIB :], KIB) for i in range(8)]
    for _ in range(3):
        assert all(s.state is RequestState.COMPLETED for s in user.transfer(requests))
    assert _remembered(user, requests) is None


def test_the_same_address_with_another_length_is_another_list(
    engines: tuple[TransferEngine, TransferEngine, str],
) -> None:
    owner, user, transport = engines
    memory = np.full(4 * KIB, 6, np.uint8)  # then its first half: the same address, another length
    base, remote = _target(owner, transport, 64 * KIB)
    for _ in range(3):
        assert user.transfer([TransferRequest(OpCode.WRITE, "owner", base, memory)])[0].transferred_bytes == 4 * KIB
    for _ in range(3):
        remote[: 4 * KIB] = 0
        (status,) = user.transfer([TransferRequest(OpCode.WRITE, "owner", base, memory[: 2 * KIB])])
        assert status.state is RequestState.COMPLETED and status.transferred_bytes == 2 * KIB
        assert remote[: 2 * KIB].tolist() == [6] * 2 * KIB and not remote[2 * KIB : 4 * KIB].any()


@pytest.mark.parametrize("nbytes", [64 * KIB, 2048 * KIB])
def test_threads_running_one_list_at_once(engines: tuple[TransferEngine, TransferEngine, str], nbytes: int) -> None:
    owner, user, transport = engines
    base, remote = _target(owner, transport, nbytes)
    remote[:] = np.random.default_rng(11).integers(0, 256, nbytes, dtype=np.uint8)
    back = np.zeros(nbytes, np.uint8)
    quarter = nbytes // 4
    reads = [TransferRequest(OpCode.READ, "owner", base + i * quarter, back[i * quarter :], quarter) for i in range(4)]
    ends: list[list[int]] = []

    def run() -> None:
        for i in range(10):
            statuses = user.submit(reads).wait() if i % 2 else user.transfer(reads)
            ends.append([s.transferred_bytes if s.state is RequestState.COMPLETED else -1 for s in statuses])

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert ends == [[quarter] * 4] * 40
    assert np.array_equal(back, remote)


def test_a_file_dropped_during_a_run_is_unmapped_after_it(
    engines: tuple[TransferEngine, TransferEngine, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    owner, user, transport = engines
    if transport != "shm":
        pytest.skip("shm maps the peer's files")
    buf = owner.allocate(64 * KIB)
    requests = [TransferRequest(OpCode.WRITE, "owner", buf.base, np.ones(4 * KIB, np.uint8))]
    user.lookup("owner", fresh=True)
    state = _transport(user, "shm")._peers.get(user.lookup("owner"))
    copier = shm.copier

    def dropped_meanwhile(copies: Any) -> Callable[[], bool]:  # drop() while the run pins the file
        work = copier(copies)

        def run() -> bool:
            state.drop(buf.shm_name)
            return work()

        return run

    monkeypatch.setattr(shm, "copier", dropped_meanwhile)
    prepared = user.prepare(requests)
    mapping = state.mappings[buf.shm_name]
    assert prepared.run()[0].state is RequestState.COMPLETED  # the pins kept the file mapped for the copy
    assert mapping.mm.closed


def test_a_copy_within_the_engine_from_freed_memory_is_out_of_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"memory://{uuid.uuid4().hex}"
    with TransferEngine("self", Config(metadata=MetadataConfig(url))) as engine:
        base = engine.register(np.zeros(64 * KIB, np.uint8))
        freed = memoryview(bytearray(4 * KIB))
        freed.release()
        monkeypatch.setattr(engine._segment, "resolve", lambda address, length: freed)  # freed after resolve()
        (status,) = engine.transfer([TransferRequest(OpCode.WRITE, "self", base, np.ones(4 * KIB, np.uint8))])
        assert status.state is RequestState.FAILED and status.error_code == "out_of_bounds", status


def test_a_list_seen_once_is_not_keyed_and_a_rebuilt_one_is_remembered(
    engines: tuple[TransferEngine, TransferEngine, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    owner, user, transport = engines
    base, remote = _target(owner, transport, 64 * KIB)
    keyed: list[int] = []
    key = user._memo.key
    monkeypatch.setattr(user._memo, "key", lambda requests: keyed.append(len(requests)) or key(requests))
    data = np.full(8 * KIB, 2, np.uint8)
    for i in range(1, 5):  # new remote offsets every call (a store put): sighted only, never keyed
        assert user.transfer([TransferRequest(OpCode.WRITE, "owner", base + i * KIB, data)])[0].transferred_bytes
    assert keyed == [] and np.array_equal(remote[KIB : 12 * KIB], np.full(11 * KIB, 2, np.uint8))
    where, memory = base + 4 * KIB + 512, np.zeros(4 * KIB, np.uint8)
    for round_no in range(4):  # the same offsets, a new buffer object each call (a store get)
        memory[:] = 0
        (status,) = user.transfer([TransferRequest(OpCode.READ, "owner", where, memory[:])])
        assert status.state is RequestState.COMPLETED and not (memory - 2).any()
        assert len(keyed) == round_no  # keyed from its second sighting on
    reads = [TransferRequest(OpCode.READ, "owner", where, memory[:])]
    assert _remembered(user, reads) is not None  # the key (addresses) decides, whatever the objects
