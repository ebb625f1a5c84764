"""One conformance suite for device memory in the Transfer Engine, on the emulated device (CI
has no GPU; the same code runs on CUDA): every transport x local host/device x remote host
(shared memory, plain)/device x READ/WRITE, sizes from 1 byte to several staging chunks,
engine to engine in one process. Every case proves the device path ran by the emulated
device's copy counters. Two-process cases and faults are in test_device_processes.py."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np
import pytest

from tsukimi.config import Config, MetadataConfig, TransferConfig
from tsukimi.device import EMULATED, EmulatedDevice, EmulatedMemory
from tsukimi.errors import ConfigError, InvalidBufferError, OutOfBounds
from tsukimi.transfer import OpCode, RequestState, TransferEngine, TransferRequest
from tsukimi.transfer.segment import BufferDescriptor, decode_descriptor, encode_descriptor
from tsukimi.transfer.staging import CHUNK_BYTES

REMOTE_BYTES = 3 * CHUNK_BYTES
SIZES = [1, 4097, CHUNK_BYTES + 3, 2 * CHUNK_BYTES + 4099]
OFFSET = 3  # remote ranges start off any alignment


@dataclass
class Remote:
    """A remote buffer of the owner engine: its base, and how the test reads it directly."""

    base: int
    read: Callable[[int, int], bytes]


def _initiator(transport: str, url: str) -> TransferEngine:
    config = Config(transfer=TransferConfig(transport=transport), metadata=MetadataConfig(url=url))
    return TransferEngine("user", config)


def _remote(owner: TransferEngine, kind: str, keep: list[object]) -> Remote:
    if kind == "shm":
        buf = owner.allocate(REMOTE_BYTES)
        return Remote(buf.base, lambda o, n: bytes(buf.view[o - buf.base : o - buf.base + n]))
    if kind == "host":
        array = np.zeros(REMOTE_BYTES, np.uint8)
        keep.append(array)
        base = owner.register(array)
        return Remote(base, lambda o, n: array[o - base : o - base + n].tobytes())
    memory = EmulatedDevice(0).alloc(REMOTE_BYTES)
    keep.append(memory)
    base = owner.register(memory)
    return Remote(base, lambda o, n: memory.read(o - base, n))


def _device_bytes() -> int:
    return sum(EMULATED.stats[f"{what}_bytes"] for what in ("to_host", "from_host", "copy"))


# transport -> which (local, remote) it serves; the others must fail, not land anywhere
SERVES = {
    "auto": {(lo, re) for lo in ("host", "device") for re in ("shm", "host", "device")},
    "tcp": {(lo, re) for lo in ("host", "device") for re in ("shm", "host", "device")},
    "shm": {("host", "shm"), ("device", "shm")},
    "device_ipc": {("host", "device"), ("device", "device")},
    "cma": {("host", "shm"), ("host", "host")},
}


@pytest.mark.parametrize("remote_kind", ["shm", "host", "device"])
@pytest.mark.parametrize("local_kind", ["host", "device"])
@pytest.mark.parametrize("transport", list(SERVES))
def test_every_transport_moves_every_combination(transport: str, local_kind: str, remote_kind: str) -> None:
    url = f"memory://{uuid.uuid4().hex}"
    keep: list[object] = []
    with TransferEngine("owner", Config(metadata=MetadataConfig(url=url))) as owner, _initiator(transport, url) as user:
        remote = _remote(owner, remote_kind, keep)
        rng = np.random.default_rng(7)
        served = (local_kind, remote_kind) in SERVES[transport]
        for size in SIZES if served else SIZES[:1]:
            data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            before = _device_bytes()
            if local_kind == "device":
                memory = EmulatedDevice(1).alloc(size)
                keep.append(memory)
                memory.write(0, data)
                local: object = memory
            else:
                local = np.frombuffer(bytearray(data), np.uint8)
            write = user.transfer([TransferRequest(OpCode.WRITE, "owner", remote.base + OFFSET, local)])[0]
            if not served:
                assert write.state is RequestState.FAILED and "cannot reach" in write.reason
                assert remote.read(remote.base + OFFSET, size) == bytes(size)
                return
            assert write.state is RequestState.COMPLETED, write.reason
            assert remote.read(remote.base + OFFSET, size) == data
            if local_kind == "device":
                back: object = EmulatedDevice(1).alloc(size)
                keep.append(back)
            else:
                back = np.zeros(size, np.uint8)
            user.read("owner", remote.base + OFFSET, back)
            got = back.read(0, size) if isinstance(back, EmulatedMemory) else bytes(memoryview(back))  # type: ignore[call-overload]
            assert got == data
            if local_kind == "device" or remote_kind == "device":  # the device path ran, both ways
                assert _device_bytes() - before >= 2 * size
        for memory in keep:
            if isinstance(memory, EmulatedMemory):
                memory.close()


def test_a_batch_mixes_host_and_device_requests() -> None:
    url = f"memory://{uuid.uuid4().hex}"
    with (
        TransferEngine("owner", Config(metadata=MetadataConfig(url=url))) as owner,
        _initiator("auto", url) as user,
        EmulatedDevice(0).alloc(REMOTE_BYTES) as remote_dev,
        EmulatedDevice(1).alloc(REMOTE_BYTES) as local_dev,
    ):
        shm = owner.allocate(REMOTE_BYTES)
        dev_base = owner.register(remote_dev)
        data = np.random.default_rng(3).integers(0, 256, 3 * CHUNK_BYTES, dtype=np.uint8)
        local_dev.write(0, data)
        host = data.copy()
        n = CHUNK_BYTES
        statuses = user.transfer(
            [
                TransferRequest(OpCode.WRITE, "owner", dev_base, host[:n]),  # host -> device
                TransferRequest(OpCode.WRITE, "owner", shm.base, local_dev, length=n, local_offset=n),  # dev -> shm
                TransferRequest(OpCode.WRITE, "owner", dev_base + n, local_dev, length=n, local_offset=2 * n),
                TransferRequest(OpCode.WRITE, "owner", shm.base + n, host[n : 2 * n]),  # host -> shm
            ]
        )
        assert [s.state for s in statuses] == [RequestState.COMPLETED] * 4, statuses
        assert remote_dev.read(0, n) == data[:n].tobytes()
        assert bytes(shm.view[:n]) == data[n : 2 * n].tobytes()
        assert remote_dev.read(n, n) == data[2 * n :].tobytes()
        assert bytes(shm.view[n : 2 * n]) == data[n : 2 * n].tobytes()


def test_a_raw_pointer_inside_a_registered_device_buffer_is_device_memory() -> None:
    """Mooncake's callers pass (ptr, len) of their registered GPU buffers as local memory."""
    url = f"memory://{uuid.uuid4().hex}"
    with (
        TransferEngine("owner", Config(metadata=MetadataConfig(url=url))) as owner,
        _initiator("auto", url) as user,
        EmulatedDevice(0).alloc(1 << 20) as local_dev,
    ):
        shm = owner.allocate(1 << 20)
        user.register((local_dev.range.address, 1 << 20))  # a device pointer: found by locate
        assert user.describe().buffers[0].device == "emu:0"
        local_dev.write(100, b"from the device")
        before = EMULATED.stats["to_host_bytes"]
        user.write("owner", shm.base, (local_dev.range.address + 100, 15))
        assert bytes(shm.view[:15]) == b"from the device"
        assert EMULATED.stats["to_host_bytes"] == before + 15


def test_registration_locations_and_descriptors() -> None:
    url = f"memory://{uuid.uuid4().hex}"
    with (
        TransferEngine("owner", Config(metadata=MetadataConfig(url=url))) as owner,
        EmulatedDevice(2).alloc(8192) as dev,
    ):
        pointer = (dev.range.address, 8192)
        with pytest.raises(InvalidBufferError):
            owner.register(pointer, location="cuda:0")  # the memory is on emu:2
        with pytest.raises(ConfigError):
            owner.register(pointer, location="tpu:0")
        with pytest.raises(InvalidBufferError):
            owner.register(dev, location="cpu")
        with pytest.raises(InvalidBufferError):
            owner.register(np.zeros(16, np.uint8), location="emu:2")
        base = owner.register(pointer, location="*")
        desc = owner.describe()
        (buf,) = desc.buffers
        assert (buf.base, buf.length, buf.device, buf.shm_name) == (base, 8192, "emu:2", "")
        assert buf.device_export and decode_descriptor(encode_descriptor(desc)) == desc
        with pytest.raises(InvalidBufferError, match="emu:2"):
            owner.local_view(base, 16)  # never a view over device memory
        owner.unregister(base)
        assert owner.describe().buffers == []
        host_base = owner.register(np.zeros(4096, np.uint8), location="cpu")
        assert owner.describe().buffers[0].device == ""
        assert owner.local_view(host_base, 16).nbytes == 16


def test_descriptors_without_device_fields_still_decode_and_bad_ones_do_not() -> None:
    old = b'{"name":"x","host_id":"h","pid":1,"version":1,"endpoints":[],"buffers":[{"base":4096,"length":10}]}'
    assert decode_descriptor(old).buffers == [BufferDescriptor(4096, 10)]
    for bad in (
        {"base": 4096, "length": 10, "device": "cuda"},  # no index
        {"base": 4096, "length": 10, "device": "cuda:0", "shm_name": "tsukimi-1-0000000000000000"},
        {"base": 4096, "length": 10, "device_export": "AAAA"},  # an export of no device
        {"base": 4096, "length": 10, "device": "emu:0", "device_export": "A" * 4000},  # oversized
    ):
        raw = old.replace(b'{"base":4096,"length":10}', msgspec.json.encode(bad))
        with pytest.raises(msgspec.ValidationError):
            decode_descriptor(raw)


def test_an_unregistered_device_range_is_out_of_bounds() -> None:
    url = f"memory://{uuid.uuid4().hex}"
    with (
        TransferEngine("owner", Config(metadata=MetadataConfig(url=url))) as owner,
        _initiator("auto", url) as user,
        EmulatedDevice(0).alloc(8192) as dev,
    ):
        base = owner.register(dev)
        with pytest.raises(OutOfBounds):
            user.write("owner", base + 8000, b"x" * 500)  # runs past the buffer
        owner.unregister(base)
        with pytest.raises(OutOfBounds):
            user.write("owner", base, b"gone")


@pytest.mark.parametrize("transport", ["device_ipc", "tcp"])
def test_a_released_device_buffer_fails_instead_of_being_written(transport: str) -> None:
    url = f"memory://{uuid.uuid4().hex}"
    with TransferEngine("owner", Config(metadata=MetadataConfig(url=url))) as owner, _initiator(transport, url) as user:
        dev = EmulatedDevice(0).alloc(8192)
        base = owner.register(dev)
        user.write("owner", base, b"before")
        owner.unregister(base)
        copies = EMULATED.stats["from_host"]
        with pytest.raises(OutOfBounds):
            user.write("owner", base, b"after")
        assert EMULATED.stats["from_host"] == copies  # nothing was copied into the released range
        assert dev.read(0, 6) == b"before"
        dev.close()
