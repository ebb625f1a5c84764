"""`ReplicateConfig.group_ids` and `session_ids` on tsukimi's facade: one entry per key of
the put, split into per-key configs the master keeps (replica groups, writer sessions). The
codes for a length mismatch were measured against mooncake-transfer-engine-non-cuda
0.3.13.post1 with its own mooncake_master: -600 for every key of the call, nothing stored;
that wheel has no `session_ids` (newer Mooncake builds do), so its checks follow group_ids."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import pytest
import torch

from tsukimi.compat.mooncake.store import MooncakeDistributedStore, ReplicateConfig
from tsukimi.config import MasterConfig
from tsukimi.errors import InvalidArgument
from tsukimi.store.master.server import MasterServer

pytestmark = pytest.mark.timeout(60)
MIB = 1 << 20


@pytest.fixture(scope="module")
def master() -> Iterator[MasterServer]:
    with MasterServer(MasterConfig(rpc_port=0, http_port=0)) as server:
        yield server


@pytest.fixture(scope="module")
def store(master: MasterServer) -> Iterator[MooncakeDistributedStore]:
    store = MooncakeDistributedStore()
    assert store.setup("localhost", "P2PHANDSHAKE", 16 * MIB, 4 * MIB, "tcp", "", master.endpoint[len("tcp://") :]) == 0
    yield store
    store.close()


def config_of(groups: list[str] | None = None, sessions: list[str] | None = None) -> ReplicateConfig:
    config = ReplicateConfig()
    config.group_ids, config.session_ids = groups, sessions
    return config


def test_the_ids_are_lists_of_str_as_the_wheels_bindings() -> None:
    config = ReplicateConfig()
    assert config.group_ids is None and config.session_ids == []
    config.group_ids = ("a", "b")  # type: ignore[assignment]
    assert config.group_ids == ["a", "b"]
    for name, value in [("group_ids", "ab"), ("group_ids", [1]), ("session_ids", "s"), ("session_ids", [b"s"])]:
        with pytest.raises(TypeError):
            setattr(config, name, value)
    assert [(c.group, c.session) for c in config_of(["g", ""], ["s1", "s2"]).per_key(2)] == [("g", "s1"), ("", "s2")]
    with pytest.raises(InvalidArgument, match="one per key"):
        config_of(["g"]).per_key(2)
    with pytest.raises(InvalidArgument, match="session_ids"):
        config_of(None, ["s1", "s2"]).per_key(3)


def test_puts_split_the_ids_per_key(store: MooncakeDistributedStore, master: MasterServer) -> None:
    data = (ctypes.c_char * 64).from_buffer_copy(b"x" * 64)
    ptr = ctypes.addressof(data)
    grouped = config_of(["page1", "page1", ""], ["writer-a", "writer-a", "writer-b"])
    assert store.batch_put_from(["k1", "k2", "k3"], [ptr] * 3, [64] * 3, grouped) == [0, 0, 0]
    assert store.put("k4", b"v", config_of(["page1"], ["writer-c"])) == 0
    assert store.batch_put_from_multi_buffers(["m1"], [[ptr, ptr]], [[8, 8]], config_of(["page2"])) == [0]
    assert store.batch_put_session_start(["s1", "s2"], [8, 8], config_of(["page5", "page5"])) == [0, 0]
    assert store.batch_put_session_start(["s3"], [8], config_of(["a", "b"])) == [-600]
    assert store.batch_put_session_end(["s1", "s2"]) == [0, 0]
    state = master.state
    assert state.objects.groups == {"page1": {"k1", "k2", "k4"}, "page2": {"m1"}, "page5": {"s1", "s2"}}
    assert [state.describe(k).session for k in ("k1", "k3", "k4", "m1")] == ["writer-a", "writer-b", "writer-c", ""]
    assert store.pub_tensor("t1", torch.arange(4), config_of(["page3"])) == 0
    assert state.objects.groups["page3"] == {"t1"}
    two = [torch.zeros(4), torch.ones(4)]
    assert store.batch_pub_tensor(["t2", "t3"], two, config_of(["a", "b"])) == [0, 0]  # the wheel: [0, 0]
    assert state.objects.groups["a"] == {"t2"} and state.objects.groups["b"] == {"t3"}
    # every object a key is stored as (its TP shards) joins that key's group
    assert store.batch_pub_tensor_with_tp(["w1", "w2"], two, config_of(["c", "d"]), tp_size=2) == [0, 0]
    assert state.objects.groups["c"] == {"w1_tp_0", "w1_tp_1"} and state.objects.groups["d"] == {"w2_tp_0", "w2_tp_1"}
    assert store.batch_pub_tensor(["t4", "t5"], two, config_of(["a"])) == [-600, -600]


def test_a_length_mismatch_fails_every_key_and_stores_nothing(
    store: MooncakeDistributedStore, master: MasterServer
) -> None:
    data = (ctypes.c_char * 16).from_buffer_copy(b"y" * 16)
    ptr = ctypes.addressof(data)
    two = config_of(["a", "b"])
    assert store.batch_put_from(["x1"], [ptr], [16], two) == [-600]
    assert store.put_from("x1", ptr, 16, two) == -600 and store.upsert_from("x1", ptr, 16, two) == -600
    assert store.put("x1", b"v", two) == -600 and store.put_batch(["x1"], [b"v"], two) == -600
    assert store.batch_put_from_multi_buffers(["x1"], [[ptr]], [[16]], two) == [-600]
    assert store.batch_put_from(["x1", "x2", "x3"], [ptr] * 3, [16] * 3, config_of(None, ["s"])) == [-600] * 3
    assert store.batch_is_exist(["x1", "x2", "x3"]) == [0, 0, 0]
    assert not {"x1", "x2", "x3"} & set().union(*master.state.objects.groups.values())
