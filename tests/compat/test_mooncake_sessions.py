"""Put and get sessions with their `*_multi_buffer_ranges` calls on tsukimi's facade (what
SGLang's direct linker and vLLM-Ascend's layer-wise store call: one ranges call per layer).
The codes are those of mooncake-transfer-engine-non-cuda 0.3.13.post1 and its
`mooncake_master` (sessions.py lists them and where tsukimi differs): `run_script` makes the
same calls on both, and where the real wheel is installed it runs against it too."""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tsukimi.compat.mooncake.master_flags import parse
from tsukimi.compat.mooncake.store import MooncakeDistributedStore, ReplicateConfig
from tsukimi.config import MasterConfig
from tsukimi.device import EMULATED, EmulatedDevice
from tsukimi.store import ranges
from tsukimi.store.master.server import MasterServer

pytestmark = pytest.mark.timeout(60)
MIB = 1 << 20
SIZE = 3000  # every object: 3 layers of 1000 bytes


def _store(lease_ttl_s: float) -> Iterator[MooncakeDistributedStore]:
    master = MasterServer(MasterConfig(rpc_port=0, http_port=0, lease_ttl_s=lease_ttl_s))
    store = MooncakeDistributedStore()
    address = master.endpoint.removeprefix("tcp://")
    assert store.setup("localhost", "P2PHANDSHAKE", 16 * MIB, MIB, "tcp", "", address) == 0
    yield store
    store.close()
    master.close()


@pytest.fixture(scope="module")
def store() -> Iterator[MooncakeDistributedStore]:
    yield from _store(lease_ttl_s=30.0)


def buffer(data: bytes) -> tuple[ctypes.Array[ctypes.c_char], int]:
    array = (ctypes.c_char * len(data)).from_buffer_copy(data)
    return array, ctypes.addressof(array)


def value(n: int) -> bytes:
    return bytes((n * 7 + i) % 251 for i in range(SIZE))


def run_script(store: Any, prefix: str) -> list[object]:
    """The same calls on the facade or the real wheel: each call's answer, in order (the wheel
    is typed Any: it has no stubs)."""
    src, ps = buffer(bytes(range(250)) * 12)
    out, po = buffer(bytes(SIZE))
    s1, s2, s3, nope = (prefix + name for name in ("s1", "s2", "s3", "nope"))
    put = store.batch_put_from_multi_buffer_ranges
    get = store.batch_get_into_multi_buffer_ranges
    answers: list[object] = [
        store.batch_put_session_start([s1, s2], [SIZE, SIZE]),
        store.batch_put_session_start([s1], [SIZE]),
        store.batch_put_session_start([s3, nope], [SIZE]),
        store.batch_put_session_start([s3], [0]),
    ]
    for at in (0, 1000, 2000):
        answers.append(put([s1, s2], [[ps + at, ps + at + 600]] * 2, [[600, 400]] * 2, [[at, at + 600]] * 2))
    answers += [
        put([s1], [[ps]], [[100]], [[SIZE - 50]]),  # past the end
        put([nope, s1], [[ps], [ps]], [[10], [10]], [[0], [0]]),  # no session, alone
        put([s1, s2], [[ps]], [[10]], [[0]]),  # ragged
        put([s1], [[ps, ps]], [[10]], [[0]]),  # a key's lists are ragged
        put([s1], [[]], [[]], [[]]),
        put([s1], [[ps]], [[0]], [[0]]),
        store.is_exist(s1),
        store.batch_put_session_end([s1, nope]),
        store.batch_put_session_end([s1]),
        store.batch_put_session_revoke([s2]),
        store.batch_put_session_revoke([s2]),
        store.is_exist(s2),
        store.batch_put_session_start([s1], [SIZE]),  # the object exists
        get([s1], [[po]], [[10]], [[0]]),  # no session
        store.batch_get_session_start([s1, nope]),
    ]
    for at in (0, 1000, 2000):
        answers.append(get([s1], [[po + at + 500, po + at]], [[500, 500]], [[at, at + 500]]))
    answers += [
        out.raw == b"".join(src.raw[at + 500 : at + 1000] + src.raw[at : at + 500] for at in (0, 1000, 2000)),
        get([s1], [[po]], [[100]], [[SIZE - 50]]),  # past the end
        get([s1, s1], [[po]], [[10]], [[0]]),  # ragged
        get([s1], [[po, po]], [[10]], [[0]]),
        get([s1], [[]], [[]], [[]]),
        get([s1], [[po]], [[0]], [[0]]),
        get([s1, s1], [[po], [po + 10]], [[10], [10]], [[0], [10]]),
        store.remove(s1),  # the session's read lease
        store.batch_get_session_start([s1]),  # again
        store.batch_get_session_end([s1, nope]),
        store.batch_get_session_end([s1]),
        get([s1], [[po]], [[10]], [[0]]),  # ended
    ]
    return answers


SCRIPT_ANSWERS: list[object] = [
    *([0, 0], [-600], [-600, -600], [-600]),
    *([[1000, 1000]] * 3),
    *([-600], [-600, 10], [-600, -600], [-600], [-702], [0], 0),
    *([0, -600], [-600], [0], [-600], 0, [-705], [-600], [0, -704]),
    *([[1000]] * 3),
    *(True, [-600], [-600, -600], [-600], [0], [0], [10, 10], -706, [0], 0, 0, [-600]),
]


def test_the_wheels_answers(store: MooncakeDistributedStore) -> None:
    assert run_script(store, "facade-") == SCRIPT_ANSWERS


@pytest.mark.skipif(
    importlib.util.find_spec("mooncake") is None, reason="the real mooncake wheel is not installed here"
)
def test_the_real_wheel_answers_the_same() -> None:
    from tsukimi.bench.mooncake_cluster import MooncakeCluster, mooncake_store_available, new_store, unique_hostname

    if not mooncake_store_available():
        pytest.skip("the real mooncake wheel or its mooncake_master is missing here")
    with MooncakeCluster(16 * MIB, num_holders=1) as cluster:
        wheel, _config = new_store()
        assert wheel.setup(unique_hostname(), "P2PHANDSHAKE", 16 * MIB, MIB, "tcp", "", cluster.master_addr) == 0
        try:
            assert run_script(wheel, "wheel-") == SCRIPT_ANSWERS
        finally:
            wheel.close()


def test_a_layer_wise_put_in_three_range_calls_then_end_is_readable(store: MooncakeDistributedStore) -> None:
    keys = [f"lw{n}" for n in range(4)]
    sources = [buffer(value(n)) for n in range(4)]
    assert store.batch_put_session_start(keys, [SIZE] * 4, ReplicateConfig()) == [0] * 4
    assert store.batch_is_exist(keys) == [0] * 4 and store.get(keys[0]) == b""  # not readable yet
    for layer in range(3):  # one call per layer; a layer's two halves are two fragments
        at = layer * 1000
        ptrs = [[ptr + at, ptr + at + 600] for _, ptr in sources]
        assert (
            store.batch_put_from_multi_buffer_ranges(keys, ptrs, [[600, 400]] * 4, [[at, at + 600]] * 4) == [1000] * 4
        )
    assert store.batch_put_session_end(keys) == [0] * 4
    assert [store.get(k) for k in keys] == [value(n) for n in range(4)]
    assert store.batch_put_session_end(keys[:1]) == [-600]  # ended already
    assert store.batch_put_session_start(keys[:1], [SIZE]) == [-705]  # the object exists


def test_revoke_drops_the_object(store: MooncakeDistributedStore) -> None:
    _src, ptr = buffer(value(9))
    assert store.batch_put_session_start(["rv"], [SIZE]) == [0]
    assert store.batch_put_from_multi_buffer_ranges(["rv"], [[ptr]], [[SIZE]], [[0]]) == [SIZE]
    assert store.batch_put_session_revoke(["rv", "never"]) == [0, -600]
    assert store.batch_put_session_revoke(["rv"]) == [-600] and store.batch_put_session_end(["rv"]) == [-600]
    assert store.is_exist("rv") == 0 and store.get("rv") == b""
    assert store.batch_put_session_start(["rv"], [SIZE]) == [0]  # the key is free again
    assert store.batch_put_session_revoke(["rv"]) == [0]


def test_put_session_codes(store: MooncakeDistributedStore) -> None:
    _src, ptr = buffer(value(3))
    put = store.batch_put_from_multi_buffer_ranges
    assert store.batch_put_session_start(["pa", "pb"], [SIZE]) == [-600, -600]  # ragged
    assert store.batch_put_session_start(["pa", "pz"], [SIZE, 0]) == [0, -600]
    assert store.batch_put_session_start(["pa"], [SIZE]) == [-600]  # a session is open
    assert put(["pa", "pa"], [[ptr]], [[10]], [[0]]) == [-600, -600]  # ragged
    assert put(["pa"], [[ptr, ptr]], [[10]], [[0]]) == [-600]  # a key's lists are ragged
    assert put(["pa"], [[ptr]], [[10]], [[SIZE - 5]]) == [-600]  # past the object's end
    assert put(["nope", "pa"], [[ptr], [ptr]], [[10], [10]], [[0], [0]]) == [-600, 10]  # no session: alone
    assert put(["pa"], [[]], [[]], [[]]) == [-702] and put(["pa"], [[ptr]], [[0]], [[0]]) == [0]
    assert put(["pa"], [[0]], [[10]], [[0]]) == [-600]  # a null address
    assert store.batch_put_session_revoke(["pa"]) == [0]
    with pytest.raises(TypeError):
        store.batch_put_session_start(["pc"], [SIZE], "config")  # type: ignore[arg-type]


def test_a_get_session_reads_ranges_byte_exact(store: MooncakeDistributedStore) -> None:
    data = value(5)
    assert store.put("gs", data) == 0
    out, po = buffer(bytes(SIZE))
    assert store.batch_get_session_start(["gs", "missing"]) == [0, -704]
    for layer in range(3):  # reversed halves land in reversed places: every offset is honoured
        at = layer * 1000
        got = store.batch_get_into_multi_buffer_ranges(
            ["gs"], [[po + at + 500, po + at]], [[500, 500]], [[at, at + 500]]
        )
        assert got == [1000]
        assert out.raw[at : at + 1000] == data[at + 500 : at + 1000] + data[at : at + 500]
    assert store.batch_get_into_multi_buffer_ranges(["missing"], [[po]], [[1]], [[0]]) == [-600]  # no session
    assert store.batch_get_into_multi_buffer_ranges(["gs"], [[po]], [[10]], [[SIZE - 5]]) == [-600]  # past the end
    assert store.batch_get_into_multi_buffer_ranges(["gs", "gs"], [[po]], [[1]], [[0]]) == [-600, -600]  # ragged
    assert store.batch_get_into_multi_buffer_ranges(["gs"], [[po, po]], [[1]], [[0]]) == [-600]
    assert store.batch_get_into_multi_buffer_ranges(["gs"], [[]], [[]], [[]]) == [0]
    assert store.remove("gs") == -706  # the session holds a read lease, as on the wheel
    assert store.batch_get_session_start(["gs", 7]) == [0, -600]  # type: ignore[list-item]  # again: afresh
    assert store.batch_get_session_end(["gs", "missing"]) == 0 and store.batch_get_session_end(["gs"]) == 0
    assert store.batch_get_into_multi_buffer_ranges(["gs"], [[po]], [[10]], [[0]]) == [-600]  # ended


def test_a_get_session_range_call_asks_no_master(
    store: MooncakeDistributedStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = value(6)
    assert store.put("nm", data) == 0 and store.batch_get_session_start(["nm"]) == [0]

    def no_master(*_args: object) -> None:
        raise AssertionError("a get session's range call went to the master")

    monkeypatch.setattr(ranges, "call_batch", no_master)
    out, po = buffer(bytes(SIZE))
    for layer in range(3):
        at = layer * 1000
        assert store.batch_get_into_multi_buffer_ranges(["nm"], [[po + at]], [[1000]], [[at]]) == [1000]
    assert out.raw == data
    assert store.batch_get_session_end(["nm"]) == 0


def test_device_memory_layer_by_layer_one_copy_per_call(store: MooncakeDistributedStore) -> None:
    keys = ["dev0", "dev1"]
    data = [value(20), value(21)]
    with EmulatedDevice(0).alloc(2 * SIZE) as src, EmulatedDevice(0).alloc(2 * SIZE) as dst:
        src.write(0, data[0] + data[1])
        base, out = src.range.address, dst.range.address
        assert store.batch_put_session_start(keys, [SIZE, SIZE]) == [0, 0]
        assert store.put("devhost", value(22)) == 0 and store.batch_get_session_start(["devhost"]) == [0]
        host, ph = buffer(bytes(SIZE))  # a host object read alongside
        for at in (0, 1000, 2000):
            before = EMULATED.stats["to_host"]
            ptrs = [[base + at], [base + SIZE + at]]
            assert store.batch_put_from_multi_buffer_ranges(keys, ptrs, [[1000]] * 2, [[at]] * 2) == [1000, 1000]
            assert EMULATED.stats["to_host"] == before + 1  # the layer crossed in one copy
        assert store.batch_put_session_end(keys) == [0, 0]
        assert store.batch_get_session_start(keys) == [0, 0]
        for at in (0, 1000, 2000):
            before = EMULATED.stats["from_host"]
            ptrs = [[out + at], [out + SIZE + at], [ph + at]]
            got = store.batch_get_into_multi_buffer_ranges([*keys, "devhost"], ptrs, [[1000]] * 3, [[at]] * 3)
            assert got == [1000] * 3 and EMULATED.stats["from_host"] == before + 1
        assert dst.read(0, 2 * SIZE) == data[0] + data[1] and host.raw == value(22)
        get = store.batch_get_into_multi_buffer_ranges
        assert get(keys[:1], [[out]], [[100]], [[SIZE - 50]]) == [-600]  # past the object
        assert get(keys[:1], [[out]], [[3 * SIZE]], [[0]]) == [-600]  # past the device allocation
        assert dst.read(0, 2 * SIZE) == data[0] + data[1]  # untouched by both
        assert store.batch_get_session_end([*keys, "devhost"]) == 0


def test_an_expired_get_session_is_707_once() -> None:
    for store in _store(lease_ttl_s=1e-6):  # NOTE: the lease is over before the next call: no sleep
        assert store.put("ex", value(1)) == 0
        _out, po = buffer(bytes(SIZE))
        assert store.batch_get_session_start(["ex"]) == [0]
        assert store.batch_get_into_multi_buffer_ranges(["ex"], [[po]], [[10]], [[0]]) == [-707]
        assert store.batch_get_into_multi_buffer_ranges(["ex"], [[po]], [[10]], [[0]]) == [-600]  # dropped


def test_before_setup_and_after_close() -> None:
    store = MooncakeDistributedStore()
    assert store.batch_get_session_start(["a"]) == [-900] and store.batch_put_session_start(["a"], [1]) == [-900]
    assert store.batch_get_into_multi_buffer_ranges(["a"], [[1]], [[1]], [[0]]) == [-900]
    assert store.batch_put_session_end(["a"]) == [-900] and store.batch_get_session_end(["a"]) == 0


def test_mooncakes_put_start_discard_timeout_is_the_put_sessions_limit() -> None:
    assert parse(["--put_start_discard_timeout_sec=120"]).master.put_timeout_s == 120.0
    assert parse([]).master.put_timeout_s == 30.0


def test_a_put_session_past_the_masters_put_timeout_writes_nothing(store: MooncakeDistributedStore) -> None:
    # NOTE: the master reclaims the put then, and its blocks may later hold another object
    data = (ctypes.c_char * 16).from_buffer_copy(b"z" * 16)
    assert store.batch_put_session_start(["late"], [16]) == [0]
    sessions = store._put_sessions  # the facade's part; its deadline is the master's put timeout
    opened = sessions._open["late"]
    assert 25.0 < opened.deadline - time.monotonic() <= 30.0
    sessions._open["late"] = dataclasses.replace(opened, deadline=time.monotonic() - 1.0)
    assert store.batch_put_from_multi_buffer_ranges(["late"], [[ctypes.addressof(data)]], [[16]], [[0]])[0] < 0
    # the next start forgets it: the key reaches the master again (which still holds the put)
    assert store.batch_put_session_start(["late"], [16]) != [-600] and "late" not in sessions._open
