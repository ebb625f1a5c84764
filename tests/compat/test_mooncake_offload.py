"""Mooncake's SSD offload on tsukimi's disk tier: the master's offload flags, where a
`MooncakeDistributedStore` keeps its disk, replica descriptors and the offload read count."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tsukimi.compat import mooncake as compat
from tsukimi.compat.mooncake.master_flags import parse
from tsukimi.config import MasterConfig
from tsukimi.errors import ConfigError
from tsukimi.store.master.server import MasterServer
from tsukimi.testing.processes import wait_until

pytestmark = pytest.mark.timeout(60)
MIB = 1 << 20


def test_offload_flags_map_onto_the_disk_tier() -> None:
    assert parse([]).master.offload == "off"
    evict = parse(["--enable_offload", "--offload_on_evict=true", "--root_fs_dir", "/ssd"]).master
    assert (evict.offload, evict.disk_root, evict.promotion_on_hit) == ("on_evict", "/ssd", False)
    at_put = parse(["--enable_offload=1", "--promotion_on_hit", "--promotion_admission_threshold=3"]).master
    assert (at_put.offload, at_put.promotion_on_hit, at_put.promotion_admission_threshold) == ("on_put", True, 3)
    assert parse(["--offload_on_evict"]).master.offload == "off"  # needs --enable_offload
    with pytest.raises(ConfigError, match="promotion_admission_threshold"):
        parse(["--enable_offload", "--promotion_admission_threshold=0"])


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MasterServer]:
    config = MasterConfig(rpc_port=0, http_port=0, lease_ttl_s=0.5, disk_root=str(tmp_path / "root"))
    server = MasterServer(config)
    yield server
    server.close()


def _setup(master: MasterServer, segment_bytes: int, *args: object) -> compat.MooncakeDistributedStore:
    store = compat.MooncakeDistributedStore()
    address = master.endpoint.removeprefix("tcp://")
    assert store.setup("localhost", "P2PHANDSHAKE", segment_bytes, 16 * MIB, "tcp", "", address, *args) == 0
    return store


def test_clients_take_their_own_disk_under_the_root_and_read_from_it(master: MasterServer, tmp_path: Path) -> None:
    first, second = _setup(master, 2 * MIB), _setup(master, 2 * MIB)
    reader = _setup(master, 0)  # mounts nothing: no disk
    try:
        assert sorted(p.name for p in (tmp_path / "root").iterdir()) == ["tsukimi-disk-0", "tsukimi-disk-1"]
        values = {f"k{i}": os.urandom(256 << 10) for i in range(24)}  # 6 MiB: 1.5x the pool
        config = compat.ReplicateConfig()
        config.preferred_segment = first.get_hostname()
        for key, value in values.items():
            assert first.put(key, value, config) == 0
        descs = reader.batch_get_replica_desc([*values, "missing"])
        assert "missing" not in descs
        kinds = {key: [("MEMORY" if d.is_memory_replica() else "LOCAL_DISK") for d in descs[key]] for key in values}
        assert kinds["k23"] == ["MEMORY"] and kinds["k0"] == ["LOCAL_DISK"]
        assert descs["k0"][0].get_disk_descriptor().object_size == len(values["k0"])
        assert all(d.is_local_disk_replica() and not d.is_disk_replica() for d in descs["k0"])
        before = reader.get_offload_rpc_read_count()
        assert reader.get("k0") == values["k0"]  # from first's disk: its memory is full
        assert reader.get_offload_rpc_read_count() == before + 1
        # promoted on a hit; NOTE: a promotion that times out on a loaded host is retried by the next hit
        wait_until(
            lambda: (
                reader.get("k0") == values["k0"] and any(d.is_memory_replica() for d in reader.get_replica_desc("k0"))
            )
        )
        assert all(reader.get(key) == value for key, value in values.items())
    finally:
        for store in (first, second, reader):
            store.close()


def test_a_client_asked_for_a_disk_uses_its_own_path(master: MasterServer, tmp_path: Path) -> None:
    store = _setup(master, MIB, None, True, str(tmp_path / "mine"))
    try:
        assert [p.name for p in (tmp_path / "mine").iterdir()] == ["tsukimi-disk-0"]
    finally:
        store.close()
