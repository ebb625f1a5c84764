"""Segments mounted after setup on the facade (tsukimi/compat/mooncake/segments.py): the
answers the real wheel gave against `mooncake_master`, and the memory behind each segment."""

from __future__ import annotations

from pathlib import Path

import pytest

from tsukimi.compat.mooncake.store import MooncakeDistributedStore
from tsukimi.store.master.server import MasterServer

pytestmark = pytest.mark.timeout(60)
MIB = 1 << 20


@pytest.fixture(scope="module")
def master(module_master: MasterServer) -> MasterServer:
    return module_master


def store_of(master: MasterServer, segment: int = 0, **extra: object) -> MooncakeDistributedStore:
    store = MooncakeDistributedStore()
    address = master.endpoint.removeprefix("tcp://")
    config = {
        "local_hostname": "127.0.0.1",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": segment,
        "local_buffer_size": 4 * MIB,
        "master_server_addr": address,
        **extra,
    }
    assert store.setup(config) == 0
    return store


def shm_file(tmp_path: Path, size: int) -> str:
    path = tmp_path / "segment"
    with path.open("wb") as f:
        f.truncate(size)
    return str(path)


def test_allocated_segment_holds_objects_until_unmounted_and_freed(master: MasterServer) -> None:
    store, reader = store_of(master), store_of(master)
    try:
        assert store.put("before", b"x" * 1000) != 0  # no segment anywhere yet
        mounted = store.allocate_and_mount_segment(100)
        assert mounted["ret"] == 0 and mounted["allocated_size"] == 16 * MIB
        ids = mounted["segment_ids"]
        assert isinstance(ids, list) and len(ids) == 1
        assert store.allocate_and_mount_segment(17 * MIB)["allocated_size"] == 32 * MIB
        assert store.put("k", b"v" * 100_000) == 0
        assert reader.get("k") == b"v" * 100_000  # read from the mounted memory over the engine
        assert store.unmount_segment(ids) == -1  # the other kind's call: not its segment
        assert store.unmount_and_free_segment(ids) == 0
        assert store.unmount_and_free_segment(ids) == -1
        assert store.unmount_and_free_segment([]) == 0
        assert store.allocate_and_mount_segment(0) == {"ret": -1, "segment_ids": [], "allocated_size": 0}
        with pytest.raises(TypeError):
            store.allocate_and_mount_segment(-1)
        with pytest.raises(TypeError):
            store.unmount_and_free_segment(ids, -1)
    finally:
        store.close()
        reader.close()


def test_unmount_drops_the_objects_on_the_segment(master: MasterServer) -> None:
    store = store_of(master)
    try:
        ids = store.allocate_and_mount_segment(MIB)["segment_ids"]
        assert isinstance(ids, list)
        for i in range(5):
            assert store.put(f"gone{i}", b"y" * 10_000) == 0
        assert store.unmount_and_free_segment(ids, 5) == 0  # NOTE: returns at once; the memory goes later
        assert [store.is_exist(f"gone{i}") for i in range(5)] == [0] * 5
        assert store.put("nowhere", b"z") != 0
    finally:
        store.close()  # frees the memory still in its grace period


def test_mount_segment_maps_a_file_range(master: MasterServer, tmp_path: Path) -> None:
    path = shm_file(tmp_path, 32 * MIB)
    store, reader = store_of(master), store_of(master)
    try:
        first = store.mount_segment(path, 16 * MIB, 0)
        second = store.mount_segment(path, 8 * MIB, 16 * MIB, "rdma", "cpu:0")
        assert first["ret"] == 0 and second["ret"] == 0
        assert store.mount_segment(path, 0) == {"ret": 0, "segment_ids": []}
        for bad in ((str(tmp_path / "missing"), MIB, 0), (path, 64 * MIB, 0), (path, MIB, 100)):
            assert store.mount_segment(*bad) == {"ret": -1, "segment_ids": []}, bad
        assert store.put("mapped", b"m" * 50_000) == 0
        assert reader.get("mapped") == b"m" * 50_000
        ids, more = first["segment_ids"], second["segment_ids"]
        assert isinstance(ids, list) and isinstance(more, list)
        assert store.unmount_and_free_segment(ids) == -1  # mount_segment's ids go by unmount_segment
        assert store.unmount_segment(["bad", *ids]) == -1  # every id is tried: the good one goes
        assert store.unmount_segment(ids) == -1
        assert store.unmount_segment(more * 2) == -600  # named twice
        assert store.unmount_segment([]) == 0
        with pytest.raises(TypeError):
            store.unmount_segment("not-a-list")  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            store.mount_segment(path, -1)
    finally:
        store.close()
        reader.close()


def test_calls_before_setup_fail(tmp_path: Path) -> None:
    store = MooncakeDistributedStore()
    assert store.mount_segment(shm_file(tmp_path, MIB), MIB)["ret"] == -1
    assert store.allocate_and_mount_segment(MIB)["ret"] == -1
    assert store.unmount_segment(["x"]) == -1
    assert store.unmount_local_disk_segment() == -1


def test_unmount_local_disk_withdraws_the_disk_tier(master: MasterServer, tmp_path: Path) -> None:
    plain = store_of(master, 16 * MIB)
    disk = store_of(master, 16 * MIB, enable_ssd_offload=True, ssd_offload_path=str(tmp_path / "ssd"))
    try:
        assert plain.unmount_local_disk_segment() == 0  # no disk: a warning, as the wheel
        client = disk._connection.client
        assert client is not None and client.disk is not None
        assert disk.unmount_local_disk_segment(0) == 0
        assert client.disk is None
        assert disk.unmount_local_disk_segment(0) == 0
        assert disk.put("still", b"memory") == 0
        with pytest.raises(TypeError):
            disk.unmount_local_disk_segment(-1)
    finally:
        plain.close()
        disk.close()
