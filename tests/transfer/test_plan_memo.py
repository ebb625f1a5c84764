"""The plan memo (tsukimi/transfer/plan_memo.py): a request list submitted again is routed as
planning it anew would route it, takes the prepared call, keeps no caller's memory alive, and
is planned anew after anything it depends on changed (table-driven below)."""

from __future__ import annotations

import gc
import uuid
import weakref
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from tsukimi.config import Config, MetadataConfig, TransferConfig
from tsukimi.device import EmulatedDevice
from tsukimi.errors import InvalidBufferError
from tsukimi.transfer import OpCode, RequestState, TransferEngine, TransferRequest
from tsukimi.transfer.batch import Batch
from tsukimi.transfer.plan_memo import Remembered
from tsukimi.transfer.routing import Group

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
    for run in (prepared.run, lambda: user.transfer(writes), lambda: user.transfer(writes)):
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
    assert entry is not None and (entry.fast is not None) is (transport != "tcp")
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
