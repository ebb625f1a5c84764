"""The Mooncake store API's calls beyond put/get on tsukimi's facade: setup's forms and
hostnames, ReplicateConfig and soft pins, the upsert family, buffers, replica descriptors,
clearing, patterns, copy / move tasks, ranges, garbage collection. Mooncake's own test files
(../shared/mooncake-tests) cover the same calls end to end; these pin tsukimi's answers to
bad input and the exact outcomes."""

from __future__ import annotations

import ctypes
import gc

import pytest

from tsukimi.compat.mooncake import setup_args
from tsukimi.compat.mooncake.store import (
    BufferHandle,
    MooncakeDistributedStore,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
    TaskStatus,
    TaskType,
)
from tsukimi.netio import free_port
from tsukimi.store.master.server import MasterServer
from tsukimi.testing.processes import wait_until

pytestmark = [pytest.mark.timeout(60), pytest.mark.master(lease_ttl_s=0.2)]
MIB = 1 << 20


def store_of(
    master: MasterServer, hostname: str = "localhost", local_buffer: int = 4 * MIB
) -> MooncakeDistributedStore:
    store = MooncakeDistributedStore()
    address = master.endpoint.removeprefix("tcp://")
    assert store.setup(hostname, "P2PHANDSHAKE", 16 * MIB, local_buffer, "tcp", "", address) == 0
    return store


def test_setup_takes_mooncakes_dictionary_with_human_sizes(master: MasterServer) -> None:
    address = master.endpoint.removeprefix("tcp://")
    config: dict[str, object] = {
        "local_hostname": "127.0.0.1",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": "16MB",
        "local_buffer_size": "1.5 MB",
        "master_server_addr": address,
    }
    store = MooncakeDistributedStore()
    assert store.setup(config) == 0
    assert store.put("k", b"v" * (MIB + MIB // 2)) == 0 and store.put("k2", b"v" * (2 * MIB)) == -600
    assert store.close() == 0
    for bad in (
        {"global_segment_size": "50%"},
        {"global_segment_size": "1GiB"},
        {"local_buffer_size": -1},
        {"global_segment_size": 100},
        {"local_hostname": 7},
        {"device_name": "mlx5_0"},
        {"protocol": "ib"},
        {"tenant_id": "team-a"},
        {"master_server_addr": "no-port"},
    ):
        assert MooncakeDistributedStore().setup({**config, **bad}) == -600, bad
    with pytest.raises(TypeError):
        MooncakeDistributedStore().setup(config, "P2PHANDSHAKE")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "size"), [("16MB", 16 * MIB), ("16 mb", 16 * MIB), ("1.5 GB", 3 << 29), (" 4096 ", 4096), (8, 8)]
)
def test_sizes_are_read_the_way_mooncake_writes_them(text: object, size: int) -> None:
    assert setup_args.parse_size("global_segment_size", text) == size


def test_the_hostname_names_the_segment_and_binds_its_port(master: MasterServer) -> None:
    store = store_of(master)
    host, port = store.get_hostname().split(":")
    assert host == "localhost" and 12300 <= int(port) <= 14300
    fixed = free_port()
    other = store_of(master, f"127.0.0.1:{fixed}")
    assert other.get_hostname() == f"127.0.0.1:{fixed}"
    assert (
        MooncakeDistributedStore().setup(
            f"127.0.0.1:{fixed}", "P2PHANDSHAKE", MIB, MIB, "tcp", "", master.endpoint.removeprefix("tcp://")
        )
        == -600
    )
    assert MooncakeDistributedStore().get_hostname() == ""
    store.close()
    other.close()


def test_replicate_config_checks_types_and_soft_pins_follow_mooncakes_codes(master: MasterServer) -> None:
    config = ReplicateConfig()
    assert (config.replica_num, config.soft_pin_action, config.soft_pin_ttl_ms) == (1, SoftPinAction.PRESERVE, None)
    for name, value in [
        ("soft_pin_ttl_ms", -1),
        ("soft_pin_ttl_ms", 1 << 64),
        ("soft_pin_action", 1),
        ("preferred_segment", 5),
        ("preferred_segments", "ab"),
        ("replica_num", -1),
    ]:
        with pytest.raises(TypeError):
            setattr(config, name, value)
    with pytest.raises(AttributeError):
        config.replica_nums = 2  # type: ignore[attr-defined]
    config.replica_num = 3
    assert "replica_num: 3" in str(config)
    store = store_of(master)
    enable = ReplicateConfig()
    enable.soft_pin_action, enable.soft_pin_ttl_ms = SoftPinAction.ENABLE, 1000
    assert store.put("pinned", b"v", enable) == 0
    for action in (SoftPinAction.PRESERVE, SoftPinAction.DISABLE):
        ttl_without_enable = ReplicateConfig()
        ttl_without_enable.soft_pin_action, ttl_without_enable.soft_pin_ttl_ms = action, 1000
        assert store.upsert("pinned", b"w", ttl_without_enable) == -600
    nof = ReplicateConfig()
    nof.nof_replica_num = 1
    assert store.put("nof", b"v", nof) == -600
    with pytest.raises(TypeError):
        store.put("k", b"v", config="replica_num=2")  # type: ignore[arg-type]
    store.close()


def test_the_upsert_family_parts_and_buffer_handles(master: MasterServer) -> None:
    store = store_of(master)
    assert store.put_parts("parts", b"ab", bytearray(b"cd"), memoryview(b"ef")) == 0
    assert store.put_parts("parts", b"zz") == 0 and store.get("parts") == b"abcdef"  # kept, as Mooncake
    assert store.upsert_parts("parts", b"12", b"345") == 0 and store.get("parts") == b"12345"
    assert store.put_parts("none") == -600 and store.put_parts("str", "abc") == -600
    assert store.upsert_batch(["u1", "u2"], [b"1", b"22"]) == 0 and store.upsert_batch(["u1"], [b"1", b"2"]) == -600
    source = ctypes.create_string_buffer(b"from-a-pointer", 14)
    address = ctypes.addressof(source)
    assert store.batch_upsert_from(["u1", "p"], [address, address], [14, 4]) == [0, 0]
    assert store.batch_upsert_from(["a"], [address, address], [1]) == [-600]
    assert store.upsert_from("zero", 0, 4) == -600
    handles = store.batch_get_buffer(["u1", "p", "missing"])
    assert isinstance(handles[0], BufferHandle) and bytes(handles[0]) == b"from-a-pointer" and handles[2] is None
    assert handles[1] is not None and handles[1].size() == 4
    assert ctypes.string_at(handles[1].ptr(), 4) == b"from"
    assert store.get_buffer("missing") is None
    store.close()


def test_a_zero_local_buffer_allows_zero_copy_calls_only(master: MasterServer) -> None:
    store = store_of(master, local_buffer=0)
    assert store.put("k", b"v") == -600 and store.is_exist("k") == 0
    value = ctypes.create_string_buffer(b"zero-copy", 9)
    assert store.put_from("k", ctypes.addressof(value), 9) == 0
    assert store.get("k") == b"" and store.get_buffer("k") is None
    back = ctypes.create_string_buffer(9)
    assert store.get_into("k", ctypes.addressof(back), 9) == 9 and back.raw == b"zero-copy"
    store.close()


def test_replica_descriptors_clearing_and_patterns(master: MasterServer) -> None:
    a, b = store_of(master), store_of(master)
    two = ReplicateConfig()
    two.replica_num = 2
    assert a.put("both", b"x" * 100, two) == 0 and a.put("one", b"y") == 0
    described = a.batch_get_replica_desc(["both", "one", "missing"])
    assert sorted(described) == ["both", "one"] and a.get_replica_desc("missing") == []
    endpoints = sorted(d.get_memory_descriptor().buffer_descriptor.transport_endpoint for d in described["both"])
    assert endpoints == sorted([a.get_hostname(), b.get_hostname()])
    replica = described["one"][0]
    assert replica.is_memory_replica() and not replica.is_disk_replica() and replica.status is ReplicaStatus.COMPLETE
    assert replica.get_memory_descriptor().buffer_descriptor.size == 1
    with pytest.raises(RuntimeError):
        replica.get_disk_descriptor()
    assert a.get("both") == b"x" * 100  # leased for 0.2 s: not cleared
    assert a.batch_replica_clear(["both"], b.get_hostname()) == []
    wait_until(lambda: a.batch_replica_clear(["both"], b.get_hostname()) == ["both"], timeout_s=5)
    assert [d.get_memory_descriptor().buffer_descriptor.transport_endpoint for d in a.get_replica_desc("both")] == [
        a.get_hostname()
    ]
    assert a.batch_replica_clear(["", "one", "one"]) == ["one"] and a.is_exist("one") == 0
    for key in ("job/1", "job/2", "other"):
        assert a.put(key, b"v") == 0
    assert a.remove_by_regex("^job/") == 2 and a.is_exist("other") == 1 and a.remove_by_regex("([") == -600
    a.close()
    b.close()


def test_copy_and_move_tasks_are_queried_as_mooncake_does(master: MasterServer) -> None:
    a, b = store_of(master), store_of(master)
    here = ReplicateConfig()
    here.preferred_segment = a.get_hostname()
    assert a.put("k", b"payload", here) == 0
    task_id, code = a.create_copy_task("k", [b.get_hostname()])
    assert code == 0 and task_id != (0, 0)

    def done() -> bool:
        response, code = a.query_task(task_id)
        return code == 0 and response is not None and response.status in (TaskStatus.SUCCESS, TaskStatus.FAILED)

    wait_until(done, timeout_s=10)
    response, _ = a.query_task(task_id)
    assert response is not None and (response.type, response.status) == (TaskType.REPLICA_COPY, TaskStatus.SUCCESS)
    assert response.id == task_id and response.created_at_ms_epoch <= response.last_updated_at_ms_epoch
    assert len(a.get_replica_desc("k")) == 2
    assert a.create_copy_task("missing", [b.get_hostname()]) == ((0, 0), -704)
    assert a.create_copy_task("k", ["nohost:1"]) == ((0, 0), -600)
    assert a.create_move_task("k", a.get_hostname(), b.get_hostname()) == ((0, 0), -600)  # b holds one already
    assert a.query_task((1, 2)) == (None, -1400)
    with pytest.raises(TypeError):
        a.query_task(5)  # type: ignore[arg-type]
    a.close()
    b.close()


def test_get_into_ranges_writes_inside_registered_buffers_only(master: MasterServer) -> None:
    store = store_of(master)
    assert store.put("k1", b"0123456789") == 0 and store.put("k2", b"abcdefghij") == 0
    buf = (ctypes.c_ubyte * 16)()
    ptr = ctypes.addressof(buf)
    assert store.register_buffer(ptr, 16) == 0 and store.register_buffer(ptr + 8, 4) == -600  # overlap
    got = store.get_into_ranges(
        [ptr], [["k1", "k2", "missing"]], [[[0, 4], [8], [14]]], [[[2, 8], [0], [0]]], [[[3, 2], [5], [1]]]
    )
    assert got == [[[3, 2], [5], [-704]]] and bytes(buf[:13]) == b"234\x0089\0\0abcde"
    assert store.get_into_ranges([ptr], [["k1"]], [[[14]]], [[[0]]], [[[4]]]) == [[[-600]]]  # past the buffer
    assert store.get_into_ranges([ptr], [["k1"]], [[[0]]], [[[8]]], [[[4]]]) == [[[-600]]]  # past the object
    assert store.get_into_ranges([ptr], [["k1"]], [[[0]]], [[[0, 1]]], [[[1]]]) == [[[-600]]]  # lists disagree
    assert store.get_into_ranges([ptr + 1], [["k1"]], [[[0]]], [[[0]]], [[[1]]]) == [[[-600]]]  # not registered
    assert store.unregister_buffer(ptr) == 0 and store.unregister_buffer(ptr) == -600
    store.close()


def test_a_store_is_released_when_its_object_is_garbage_collected(master: MasterServer) -> None:
    store = store_of(master)
    assert store.put("k", b"v") == 0
    del store
    gc.collect()
    wait_until(lambda: not master.state.registry.segments, timeout_s=5)
    assert "k" not in master.state.objects


def test_setup_args_refuse_what_tsukimi_does_not_do() -> None:
    asked = setup_args.from_args("localhost", "P2PHANDSHAKE", enable_ssd_offload=True, ssd_offload_path="/d")
    assert asked.enable_ssd_offload and asked.ssd_offload_path == "/d"  # a disk when the master offloads
    assert setup_args.master_url("etcd://a:2379;b:2379") == "etcd://a:2379,b:2379"
    assert setup_args.from_args("h", "10.0.0.1:2379").metadata_url == "etcd://10.0.0.1:2379"


def test_setup_shares_an_engine_given_as_the_facade_or_as_its_get_engine(master: MasterServer) -> None:
    """SGLang's HiCache (`SGLANG_HICACHE_MOONCAKE_REUSE_TE`) passes the PD engine's
    `get_engine()` result; Mooncake's own code passes the TransferEngine itself."""
    from tsukimi.compat.mooncake.engine import TransferEngine as EngineFacade

    address = master.endpoint.removeprefix("tcp://")
    for n, get_engine in enumerate((True, False)):
        engine = EngineFacade()
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        hostname = f"127.0.0.1:{engine.get_rpc_port()}"
        given = engine.get_engine() if get_engine else engine
        store = MooncakeDistributedStore()
        assert store.setup(hostname, "P2PHANDSHAKE", 16 * MIB, 4 * MIB, "tcp", "", address, given) == 0
        assert store.get_hostname() == hostname
        assert store.put(f"shared{n}", b"x" * 1000) == 0 and store.get(f"shared{n}") == b"x" * 1000
        assert store.close() == 0
    wrong = MooncakeDistributedStore().setup("127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 4 * MIB, "tcp", "", address, 7)
    assert wrong == -600
