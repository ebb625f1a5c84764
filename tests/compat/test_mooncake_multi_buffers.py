"""`batch_put_from_multi_buffers` / `batch_get_into_multi_buffers` on tsukimi's facade (what
vLLM's MooncakeStoreConnector calls for every KV block): round trips in any split, the codes
for lists that do not line up (those the real wheel answers alike were measured against
mooncake-transfer-engine-non-cuda 0.3.13: see multi_buffers.py for where tsukimi is
stricter), and that every buffer moves in place."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import pytest

from tsukimi.compat.mooncake.store import MooncakeDistributedStore, ReplicateConfig
from tsukimi.config import MasterConfig
from tsukimi.store.master.server import MasterServer
from tsukimi.transfer import OpCode, TransferRequest
from tsukimi.transfer.segment import byte_view

pytestmark = pytest.mark.timeout(60)
MIB = 1 << 20


@pytest.fixture
def store() -> Iterator[MooncakeDistributedStore]:
    master = MasterServer(MasterConfig(rpc_port=0, http_port=0, lease_ttl_s=0.2))
    store = MooncakeDistributedStore()
    address = master.endpoint.removeprefix("tcp://")
    assert store.setup("localhost", "P2PHANDSHAKE", 16 * MIB, 0, "tcp", "", address) == 0
    yield store
    store.close()
    master.close()


def buffer(data: bytes) -> tuple[ctypes.Array[ctypes.c_char], int]:
    array = (ctypes.c_char * len(data)).from_buffer_copy(data)
    return array, ctypes.addressof(array)


def test_round_trips_in_any_split_and_a_zero_local_buffer(store: MooncakeDistributedStore) -> None:
    _a, pa = buffer(b"A" * 100)
    _b, pb = buffer(b"B" * 50)
    out, po = buffer(bytes(300))
    assert store.register_buffer(po, 300) == 0  # NOTE: as vLLM does; not needed by tsukimi
    assert store.batch_put_from_multi_buffers(["k1", "k2"], [[pa, pb], [pb]], [[100, 50], [50]]) == [0, 0]
    assert store.get_size("k1") == 150 and store.batch_is_exist(["k1", "k2", "k3"]) == [1, 1, 0]
    assert store.batch_get_into_multi_buffers(["k1", "k2"], [[po, po + 100], [po + 200]], [[100, 50], [50]]) == [
        150,
        50,
    ]
    assert out.raw[:150] == b"A" * 100 + b"B" * 50 and out.raw[200:250] == b"B" * 50
    assert store.batch_get_into_multi_buffers(["k1"], [[po, po + 120]], [[120, 30]]) == [150]
    assert out.raw[:150] == b"A" * 100 + b"B" * 50


def test_codes_for_what_does_not_line_up(store: MooncakeDistributedStore) -> None:
    _a, pa = buffer(b"A" * 100)
    out, po = buffer(bytes(300))
    config = ReplicateConfig()
    put = store.batch_put_from_multi_buffers
    assert put(["k"], [[pa, pa]], [[100, 50]], config) == [0]
    assert put(["k"], [[pa]], [[100]], config) == [0]  # an existing key keeps its value, as Mooncake
    assert put(["k3"], [[pa, pa]], [[100]], config) == [-600]  # the wheel: the same
    assert put(["k4", "k5"], [[pa]], [[100]], config) == [-600, -600]
    assert put(["k6"], [[pa]], [[0]], config) == [-600] and put(["k7"], [[]], [[]], config) == [-600]
    assert put(["k8", "k9"], [[0], [pa]], [[10], [10]], config) == [-600, 0]  # a null address fails alone
    get = store.batch_get_into_multi_buffers
    assert get(["k"], [[po, po + 100]], [[100, 100]]) == [-600]  # the wheel: -800 (tried, then failed)
    assert get(["k"], [[po, po + 100]], [[100, 20]]) == [-600]  # the wheel: the same
    assert get(["nope", "k9"], [[po], [po]], [[10], [10]]) == [-704, 10]
    assert get(["k9"], [[po, po]], [[10]]) == [-600]  # the wheel ignores the extra address
    assert get(["k9", "k"], [[po]], [[10]]) == [-600, -600] and get(["k9"], [[]], [[]]) == [-600]
    assert out.raw[10:] == bytes(290)
    with pytest.raises(TypeError):
        put(["k"], [[pa]], [[100]], "config")  # type: ignore[arg-type]


def test_before_setup_every_key_is_an_rpc_failure() -> None:
    store = MooncakeDistributedStore()
    assert store.batch_put_from_multi_buffers(["a", "b"], [[1], [1]], [[1], [1]]) == [-900, -900]
    assert store.batch_get_into_multi_buffers(["a"], [[1]], [[1]]) == [-900]


def test_every_buffer_moves_in_place(store: MooncakeDistributedStore) -> None:
    """A client that holds no memory: one Transfer Engine request per buffer, on the caller's
    own address (no staging copy). The holder itself, whose segment has the replica, moves the
    same buffers with a memcpy and no request at all (tsukimi/store/local_replicas.py)."""
    parts = [buffer(bytes([i]) * 4096) for i in range(4)]
    dests = [buffer(bytes(8192)) for _ in range(2)]
    holder = store._ready()
    assert holder is not None
    reader = MooncakeDistributedStore()
    master = holder.config.client.master.removeprefix("tcp://")
    assert reader.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", master) == 0
    try:
        seen = {"holder": _record_requests(store), "reader": _record_requests(reader)}
        assert reader.batch_put_from_multi_buffers(["kv"], [[p for _, p in parts]], [[4096] * 4]) == [0]
        assert [(r.op, byte_view(r.local)[1]) for r in seen["reader"]] == [(OpCode.WRITE, p) for _, p in parts]
        seen["reader"].clear()
        assert reader.batch_get_into_multi_buffers(["kv"], [[p for _, p in dests]], [[8192, 8192]]) == [16384]
        assert [(r.op, byte_view(r.local)[1]) for r in seen["reader"]] == [(OpCode.READ, p) for _, p in dests]
        expected = b"".join(bytes([i]) * 4096 for i in range(4))
        assert b"".join(d.raw for d, _ in dests) == expected
        for d, _ in dests:
            ctypes.memset(ctypes.addressof(d), 0, 8192)
        assert store.batch_get_into_multi_buffers(["kv"], [[p for _, p in dests]], [[8192, 8192]]) == [16384]
        assert b"".join(d.raw for d, _ in dests) == expected
        assert seen["holder"] == []
    finally:
        reader.close()


def _record_requests(facade: MooncakeDistributedStore) -> list[TransferRequest]:
    """The requests `facade`'s Transfer Engine is given from now on (the list fills up)."""
    client = facade._ready()
    assert client is not None
    seen: list[TransferRequest] = []
    transfer = client.engine.transfer

    def recording(requests: list[TransferRequest], **kw: float) -> list[object]:
        seen.extend(requests)
        return transfer(requests, **kw)  # type: ignore[return-value]

    client.engine.transfer = recording  # type: ignore[assignment, method-assign]
    return seen
