"""The P2P store with device memory: payloads published from and received into GPU memory
(the emulated device in CI; CUDA state dicts under `pytest -m gpu`), GPU to GPU where the
peers share a host, crc32c checked through the host."""

from __future__ import annotations

import os
import uuid

import pytest

from tests.p2p.conftest import MakeStore
from tsukimi.device import EMULATED, EmulatedDevice
from tsukimi.errors import InvalidArgument, TooManyRetries

pytestmark = pytest.mark.timeout(90)
KIB = 1024


def test_device_buffers_publish_and_receive_and_serve_later_readers(make_store: MakeStore) -> None:
    origin, first, second = make_store(), make_store(), make_store()
    data = os.urandom(300 * KIB + 5)
    name = f"gpu-{uuid.uuid4().hex[:8]}"
    emu = EmulatedDevice(0)
    with (
        emu.alloc(len(data)) as gold,
        emu.alloc(len(data)) as one,
        emu.alloc(1000) as two_a,
        emu.alloc(len(data) - 1000) as two_b,
    ):
        gold.write(0, data)
        before = dict(EMULATED.stats)
        info = origin.register(name, [gold], 64 * KIB)
        assert EMULATED.stats["to_host_bytes"] - before.get("to_host_bytes", 0) >= len(data)  # crc through the host
        first.get_replica(name, [one])
        assert one.read(0, len(data)) == data
        second.get_replica(name, [two_a, two_b])  # cut differently; device to device from either holder
        assert two_a.read(0, 1000) + two_b.read(0, len(data) - 1000) == data
        assert second.stats.bytes_fetched == info.total_bytes
        assert EMULATED.stats["copy_bytes"] - before.get("copy_bytes", 0) >= 2 * len(data)  # GPU to GPU (IPC)
        assert origin.describe(name).replica_counts == [3] * len(info.shard_sizes)
        second.delete_replica(name)
        first.delete_replica(name)
        origin.unregister(name)


def test_a_corrupted_device_copy_is_caught(make_store: MakeStore) -> None:
    origin, reader = make_store(), make_store()
    data = os.urandom(128 * KIB)
    name = f"gpu-{uuid.uuid4().hex[:8]}"
    with EmulatedDevice(0).alloc(len(data)) as gold, EmulatedDevice(0).alloc(len(data)) as into:
        gold.write(0, data)
        origin.register(name, [gold], 64 * KIB)
        gold.write(10, b"\xff" * 4 if data[10:14] != b"\xff" * 4 else b"\x00" * 4)  # changed after publishing
        with pytest.raises(TooManyRetries) as failed:
            reader.get_replica(name, [into])
        assert all("crc32c" in reason for reason in failed.value.reasons)
        assert reader.stats.crc_failures >= 1
        origin.unregister(name)


@pytest.mark.gpu
def test_cuda_state_dicts_go_gpu_to_gpu(make_store: MakeStore) -> None:
    torch = pytest.importorskip("torch")
    from tsukimi.p2p.weights import publish_state_dict, receive_state_dict

    origin, reader = make_store(), make_store()
    weights = {"a": torch.randn(1024, 257, device="cuda"), "b": torch.randn(33, device="cuda", dtype=torch.bfloat16)}
    weights["tied"] = weights["a"]
    torch.cuda.synchronize()
    name = f"gpu-{uuid.uuid4().hex[:8]}"
    publish_state_dict(origin, name, weights)
    into = {k: torch.zeros_like(v) for k, v in weights.items()}
    torch.cuda.synchronize()  # NOTE: the TE's copies are not ordered after torch's kernels
    into["cpu_ok"] = torch.zeros(1)
    with pytest.raises(InvalidArgument):
        receive_state_dict(reader, name, into)  # an extra tensor: nothing written
    del into["cpu_ok"]
    receive_state_dict(reader, name, into)
    torch.cuda.synchronize()
    assert all(torch.equal(into[k], weights[k]) for k in weights)
    host = {k: torch.zeros_like(v, device="cpu") for k, v in weights.items()}
    receive_state_dict(make_store(), name, host)  # a GPU publisher, a CPU receiver
    assert all(torch.equal(host[k], weights[k].cpu()) for k in weights)
