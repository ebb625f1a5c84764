"""Code written against the `mooncake` Python API runs on tsukimi by changing the import.

`mooncake_style_script` is written the way Mooncake's documentation uses its store; the test
hands it tsukimi's classes instead of `mooncake.store`'s."""

from __future__ import annotations

import ctypes

import pytest

from tsukimi.compat import mooncake as compat
from tsukimi.store.master.server import MasterServer

pytestmark = pytest.mark.timeout(60)


def mooncake_style_script(MooncakeDistributedStore, ReplicateConfig, master_server_addr: str) -> None:  # type: ignore[no-untyped-def]
    store = MooncakeDistributedStore()
    assert (
        store.setup("localhost", "P2PHANDSHAKE", 16 * 1024 * 1024, 16 * 1024 * 1024, "tcp", "", master_server_addr) == 0
    )
    config = ReplicateConfig()
    config.replica_num = 1
    assert store.put("key1", b"hello mooncake", config) == 0
    assert store.get("key1") == b"hello mooncake"
    assert store.get("no-such-key") == b""
    assert store.is_exist("key1") == 1 and store.is_exist("no-such-key") == 0
    assert store.batch_is_exist(["key1", "no-such-key"]) == [1, 0]
    assert store.put("key1", b"again") == 0 and store.get("key1") == b"hello mooncake"  # kept, as Mooncake
    assert store.upsert("key1", b"replaced") == 0 and store.get("key1") == b"replaced"
    assert store.put_batch(["b1", "b2"], [b"one", b"two"], config) == 0
    assert store.get_batch(["b1", "b2", "zz"]) == [b"one", b"two", b""]

    size = 4096
    src = ctypes.create_string_buffer(bytes(range(256)) * 16, size)
    dst = ctypes.create_string_buffer(size)
    src_ptr, dst_ptr = ctypes.addressof(src), ctypes.addressof(dst)
    assert store.register_buffer(src_ptr, size) == 0 and store.register_buffer(dst_ptr, size) == 0
    assert store.put_from("zero-copy", src_ptr, size, config) == 0
    assert store.get_size("zero-copy") == size
    assert store.get_into("zero-copy", dst_ptr, size) == size and dst.raw == src.raw
    assert store.get_into("no-such-key", dst_ptr, size) < 0
    assert store.batch_put_from(["z1", "z2"], [src_ptr, src_ptr + 1024], [1024, 1024], config) == [0, 0]
    got = store.batch_get_into(
        ["z1", "z2", "no-such-key"], [dst_ptr, dst_ptr + 1024, dst_ptr + 2048], [1024, 1024, 1024]
    )
    assert got[:2] == [1024, 1024] and got[2] < 0
    assert dst.raw[1024:2048] == src.raw[1024:2048]

    assert store.remove("zero-copy") == -706  # just read: leased, as in Mooncake
    assert store.remove("zero-copy", True) == 0
    assert store.remove("zero-copy") == -704
    assert store.batch_remove(["z1", "no-such-key"], True) == [0, -704]
    assert store.remove_all(True) >= 4
    assert store.is_exist("key1") == 0
    assert store.close() == 0


def test_a_mooncake_store_script_runs_unchanged(master: MasterServer) -> None:
    address = master.endpoint.removeprefix("tcp://")
    mooncake_style_script(compat.MooncakeDistributedStore, compat.ReplicateConfig, address)


def test_lease_and_error_codes(master: MasterServer) -> None:
    store = compat.MooncakeDistributedStore()
    assert (
        store.setup("localhost", "P2PHANDSHAKE", 1 << 20, 4 << 20, "tcp", "", master.endpoint.removeprefix("tcp://"))
        == 0
    )
    assert store.health_check() == 0
    assert store.put("k", b"v") == 0 and store.get("k") == b"v"  # the get leases it
    assert store.remove("k") == -706
    assert store.remove("k", True) == 0
    assert store.put("", b"v") == -600
    big = compat.ReplicateConfig()
    big.replica_num = 1
    assert store.put("huge", bytes(2 << 20), big) == -200  # more than the 1 MiB pool
    store.close()
    assert compat.MooncakeDistributedStore().put("k", b"v") == -900  # no setup
    assert compat.MooncakeDistributedStore().health_check() == 1


def test_transfer_engine_facade_p2p() -> None:
    a, b = compat.TransferEngine(), compat.TransferEngine()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    remote = b.allocate_managed_buffer(1 << 20)
    local = ctypes.create_string_buffer(b"written by a", 64)
    assert a.register_memory(ctypes.addressof(local), 64) == 0
    target = f"127.0.0.1:{b.get_rpc_port()}"
    assert a.transfer_sync_write(target, ctypes.addressof(local), remote, 64) == 0
    back = ctypes.create_string_buffer(64)
    assert a.transfer_sync_read(target, ctypes.addressof(back), remote, 64) == 0
    assert back.raw == local.raw
    assert a.transfer_sync_read(target, ctypes.addressof(back), remote + (1 << 30), 64) == -1
    assert b.free_managed_buffer(remote, 1 << 20) == 0
    assert a.close() == 0 and b.close() == 0


def test_the_same_script_passes_on_the_real_mooncake(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keeps the facade honest: the script's expectations are Mooncake's own behaviour."""
    from tsukimi.bench.mooncake_cluster import MooncakeCluster, mooncake_store_available
    from tsukimi.bench.mooncake_te import MOONCAKE_ENV

    if not mooncake_store_available():
        pytest.skip("the real Mooncake store is not installed (make mooncake)")
    for name, value in MOONCAKE_ENV.items():
        monkeypatch.setenv(name, value)
    import mooncake.store as real

    with MooncakeCluster(64 << 20, num_holders=1) as cluster:
        mooncake_style_script(real.MooncakeDistributedStore, real.ReplicateConfig, cluster.master_addr)
