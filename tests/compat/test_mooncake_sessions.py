"""Put and get sessions with their `*_multi_buffer_ranges` calls on tsukimi's facade (what
SGLang's direct linker and vLLM-Ascend's layer-wise store call: one ranges call per layer).
The codes were probed against mooncake-transfer-engine-non-cuda 0.3.13.post1 and its
`mooncake_master` (sessions.py lists them and where tsukimi differs)."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import pytest

from tsukimi.compat.mooncake.store import MooncakeDistributedStore, ReplicateConfig
from tsukimi.config import MasterConfig
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
