"""The names test_mooncake_surface.py found missing and the facade now has, with the wheel's
answers (probed on mooncake-transfer-engine-non-cuda 0.3.13.post1 against its own master):
BufferPool and its leases, ObjectDataType and the store's enum values, put_from_with_metadata,
safetensors files, InnerTransferEngine, get_local_topology, http_metadata_server.parse_args."""

from __future__ import annotations

import ctypes
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import tsukimi.compat.mooncake as facade
from tsukimi.compat.mooncake import buffer_pool, engine, http_metadata_server, store
from tsukimi.compat.mooncake.safetensor_files import TENSOR_NOT_FOUND
from tsukimi.config import MasterConfig
from tsukimi.store.master.server import MasterServer
from tsukimi.transfer import TransferEngine as TsukimiEngine

pytestmark = pytest.mark.timeout(60)
MIB = 1 << 20


@pytest.fixture(scope="module")
def client() -> Iterator[store.MooncakeDistributedStore]:
    with MasterServer(MasterConfig(rpc_port=0, http_port=0)) as master:
        made = store.MooncakeDistributedStore()
        address = master.endpoint.removeprefix("tcp://")
        assert made.setup("127.0.0.1", "P2PHANDSHAKE", 32 * MIB, 8 * MIB, "tcp", "", address) == 0
        yield made
        made.close()


def test_buffer_pool_leases_answer_as_the_wheel(client: store.MooncakeDistributedStore) -> None:
    assert facade.BufferPool is buffer_pool.BufferPool is store.BufferPool is store.RegisteredBufferPool
    assert store.RegisteredBufferLease is store.BufferLease
    pool = store.BufferPool(client, min_size_class=4096, alignment=MIB)
    lease = pool.acquire(1000)
    assert lease.size == 1000 and lease.ptr % 64 == 0
    view = lease.buffer
    assert isinstance(view, memoryview) and len(view) == 1000 and not view.readonly
    view[:5] = b"hello"
    assert client.put_from("pooled", lease.ptr, 5) == 0 and client.get("pooled") == b"hello"
    with pytest.raises(RuntimeError, match="exported views exist"):
        lease.release()
    del view
    ptr = lease.ptr
    lease.release()
    lease.release()  # idempotent
    assert lease.size == 1000
    with pytest.raises(RuntimeError, match="buffer lease is closed"):
        _ = lease.ptr
    again = pool.acquire(1000)
    assert again.ptr == ptr  # the slot came back
    with pool.buffer(5000) as held:
        assert client.get_into("pooled", held.ptr, held.size) == 5
        assert ctypes.string_at(held.ptr, 5) == b"hello"
    with pytest.raises(RuntimeError, match="closed"):
        _ = held.buffer
    with pytest.raises(RuntimeError, match="active leases"):
        pool.close()
    again.release()
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire(1)


def test_buffer_pool_limits_wait_for_a_release(client: store.MooncakeDistributedStore) -> None:
    pool = store.BufferPool(client, min_size_class=4096, alignment=4096, max_regions=1, block_on_exhaustion=False)
    first = pool.acquire(4096)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.acquire(4096)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.acquire(4096, block=True, timeout=0)
    served: list[store.BufferLease] = []
    waiter = threading.Thread(target=lambda: served.append(pool.acquire(4096, block=True, timeout=30)))
    waiter.start()
    first.release()  # NOTE: before or after the waiter blocks: either way it is served by this slot
    waiter.join()
    assert [lease.size for lease in served] == [4096]
    served[0].release()
    pool.close()
    capped = store.BufferPool(client, max_bytes=MIB)
    with pytest.raises(RuntimeError, match="exceeds pool capacity"):
        capped.acquire(2 * MIB)


def test_buffer_pool_refuses_what_the_wheel_refuses(client: store.MooncakeDistributedStore) -> None:
    with pytest.raises(RuntimeError, match="store parameter"):
        store.BufferPool(object())
    with pytest.raises(RuntimeError, match="not initialized"):
        store.BufferPool(store.MooncakeDistributedStore())
    pool = store.BufferPool(client)
    with pytest.raises(TypeError):
        pool.acquire(-1)
    assert pool.acquire(0).size == 0
    with pytest.raises(TypeError, match="No constructor"):
        store.BufferLease()


def test_object_data_type_and_the_module_s_enum_values(client: store.MooncakeDistributedStore) -> None:
    assert [(t.name, int(t)) for t in store.ObjectDataType][:3] == [("UNKNOWN", 0), ("KVCACHE", 1), ("TENSOR", 2)]
    assert store.GENERAL is store.ObjectDataType.GENERAL and store.ObjectDataType.GENERAL == 9
    assert store.FAILED is store.TaskStatus.FAILED and store.PROCESSING is store.TaskStatus.PROCESSING
    assert store.COMPLETE is store.ReplicaStatus.COMPLETE and store.REPLICA_MOVE is store.TaskType.REPLICA_MOVE
    config = store.ReplicateConfig()
    assert config.data_type is store.ObjectDataType.UNKNOWN
    config.data_type = store.KVCACHE
    with pytest.raises(TypeError):
        config.data_type = 3  # type: ignore[assignment]
    assert client.put("typed", b"kv", config) == 0 and client.get("typed") == b"kv"


def test_put_from_with_metadata_stores_the_metadata_then_the_data(client: store.MooncakeDistributedStore) -> None:
    data, meta = ctypes.create_string_buffer(b"D" * 100, 100), ctypes.create_string_buffer(b"M" * 10, 10)
    assert client.put_from_with_metadata("meta", ctypes.addressof(data), ctypes.addressof(meta), 100, 10) == 0
    assert client.get("meta") == b"M" * 10 + b"D" * 100 and client.get_size("meta") == 110
    assert client.put_from_with_metadata("bare", ctypes.addressof(data), 0, 100, 0, store.ReplicateConfig()) == 0
    assert client.get("bare") == b"D" * 100


def test_safetensors_files(
    client: store.MooncakeDistributedStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert client.put_tensor("w", tensor) == 0 and client.put("raw", b"abc") == 0
    path = str(tmp_path / "w.safetensors")
    assert client.save_tensor_to_safetensor("w", path) == 0
    assert client.save_tensor_to_safetensor("nope", path + "x") == TENSOR_NOT_FOUND == -1100
    assert client.save_tensor_to_safetensor("raw", path + "x") == -1100
    assert client.save_tensor_to_safetensor("w", str(tmp_path / "no" / "dir")) == -600
    monkeypatch.chdir(tmp_path)
    assert client.save_tensor_to_safetensor("w") == 0 and (tmp_path / "w").exists()  # named by the key
    loaded = client.load_tensor_from_safetensor("w2", path)
    assert loaded is not None and torch.equal(loaded, tensor)
    assert torch.equal(client.get_tensor("w2"), tensor)  # type: ignore[arg-type]
    assert torch.equal(client.load_tensor_from_safetensor(file_name=path), tensor)  # type: ignore[arg-type]
    assert torch.equal(client.get_tensor(path), tensor)  # type: ignore[arg-type]  # the file name is the key
    save_file({"x": torch.ones(2), "y": torch.zeros(3)}, str(tmp_path / "two.safetensors"))
    assert torch.equal(client.load_tensor_from_safetensor("y", "two.safetensors"), torch.zeros(3))  # type: ignore[arg-type]
    assert torch.equal(client.load_tensor_from_safetensor("z", "two.safetensors"), torch.ones(2))  # type: ignore[arg-type]
    assert client.load_tensor_from_safetensor("q", "missing.safetensors") is None


def test_engine_names() -> None:
    assert engine.InnerTransferEngine is TsukimiEngine
    assert engine.TransferEngine.TransferOpcode is engine.TransferOpcode
    topology = engine.TransferEngine().get_local_topology()
    parsed = json.loads(topology)
    assert parsed and all(name.startswith("cpu:") and lists == [[], []] for name, lists in parsed.items())
    assert engine.TransferEngine().get_local_topology("") == topology
    if list(parsed) == ["cpu:0"]:  # NOTE: the wheel's exact text on a one-node host without RDMA NICs
        assert topology == '{\n\t"cpu:0" : \n\t[\n\t\t[],\n\t\t[]\n\t]\n}\n'


def test_http_metadata_server_parse_args() -> None:
    args = http_metadata_server.parse_args([])
    assert (args.port, args.host, args.log_level) == (8080, "127.0.0.1", "INFO")
    args = http_metadata_server.parse_args(["--port", "9", "--host", "0.0.0.0", "--log-level", "DEBUG"])
    assert (args.port, args.host, args.log_level) == (9, "0.0.0.0", "DEBUG")
