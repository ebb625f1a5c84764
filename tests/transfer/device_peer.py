"""A Transfer Engine in another process owning device memory and a shared-memory buffer, for
the two-process device tests (`python -m tests.transfer.device_peer KIND SIZE`; KIND "emu",
"cuda", or "fake-cuda": the stand-in driver TSUKIMI_LIBCUDA names). Prints {"name",
"device_base", "host_base", "pid"}; then answers JSON commands:
  {"cmd": "fill", "seed", "nbytes", "offset"}     random bytes into the device memory
  {"cmd": "digest", "where": "device"|"host", "offset", "nbytes"}   their sha256
  {"cmd": "stats"}                                 this process's emulated-device copy counters
  {"cmd": "release"}                               unregister and free the device memory
Exits when stdin closes."""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

from tsukimi.config import Config, MetadataConfig
from tsukimi.device import EMULATED, DeviceRange, EmulatedDevice, backend, device_range
from tsukimi.testing.processes import child_reply
from tsukimi.transfer import TransferEngine


def fake_malloc(size: int) -> int:
    """`size` bytes of the stand-in driver's device memory (the library TSUKIMI_LIBCUDA names)."""
    import ctypes
    import os

    driver = ctypes.CDLL(os.environ["TSUKIMI_LIBCUDA"])
    driver.fakeMalloc.restype, driver.fakeMalloc.argtypes = ctypes.c_uint64, [ctypes.c_size_t]
    address = int(driver.fakeMalloc(size))
    assert address, "the stand-in driver is out of allocations"
    return address


def _allocate(kind: str, size: int) -> tuple[object, DeviceRange]:
    if kind == "emu":
        memory = EmulatedDevice(0).alloc(size)
        return memory, memory.range
    if kind == "fake-cuda":  # NOTE: TSUKIMI_LIBCUDA names the stand-in driver (tests/device/fake_cuda)
        address = fake_malloc(size)
        return (address, size), DeviceRange("cuda:0", address, size)
    import torch

    tensor = torch.zeros(size, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()  # NOTE: peers' copies are not ordered after torch's kernels
    found = device_range(tensor)
    assert found is not None
    return tensor, found


def main(kind: str, size: int) -> None:
    with TransferEngine(config=Config(metadata=MetadataConfig(url="p2p"))) as engine:
        owner, memory = _allocate(kind, size)
        device_base = engine.register(owner)
        host = engine.allocate(size)
        child_reply({"name": engine.name, "device_base": device_base, "host_base": host.base, "pid": 0})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "fill":
                data = np.random.default_rng(cmd["seed"]).integers(0, 256, cmd["nbytes"], dtype=np.uint8)
                backend(memory.device).from_host(memory.sub(cmd["offset"], cmd["nbytes"]), memoryview(data))
                child_reply({})
            elif cmd["cmd"] == "digest":
                out = bytearray(cmd["nbytes"])
                if cmd["where"] == "device":
                    backend(memory.device).to_host(memory.sub(cmd["offset"], cmd["nbytes"]), memoryview(out))
                else:
                    out[:] = host.view[cmd["offset"] : cmd["offset"] + cmd["nbytes"]]
                child_reply({"sha256": hashlib.sha256(out).hexdigest()})
            elif cmd["cmd"] == "stats":
                child_reply({"stats": dict(EMULATED.stats)})
            elif cmd["cmd"] == "release":
                engine.unregister(device_base)
                if hasattr(owner, "close"):
                    owner.close()
                owner = None
                child_reply({})


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
