"""Two processes moving "CUDA" memory through the Transfer Engine over the stand-in driver
(tests/device/fake_cuda; TSUKIMI_LIBCUDA names it): registration of device pointers found by the
driver, CUDA IPC between processes (device_ipc), pinned staging over tcp on both sides, host
memory to and from a peer's device. Run by tests/transfer/test_device_processes.py as
`python -m tests.transfer.fake_cuda_pair TRANSPORT`; exits 0 when every check held."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np

from tests.transfer.device_peer import fake_malloc
from tsukimi.config import Config, MetadataConfig, TransferConfig
from tsukimi.device import CUDA, DeviceRange
from tsukimi.testing.processes import JsonWorker
from tsukimi.transfer import TransferEngine

SIZE = 6 << 20  # past a few 4 MiB staging chunks


def main(transport: str) -> None:
    assert CUDA.available(), "the stand-in driver did not load"
    checkout = str(Path(__file__).resolve().parents[2])
    peer = JsonWorker("fake-cuda peer", ["tests.transfer.device_peer", "fake-cuda", str(SIZE)], pythonpath=[checkout])
    try:
        name, dev, shm = peer.ready["name"], peer.ready["device_base"], peer.ready["host_base"]
        config = Config(transfer=TransferConfig(transport=transport, timeout_s=30), metadata=MetadataConfig(url="p2p"))
        with TransferEngine(config=config) as engine:
            local = DeviceRange("cuda:0", fake_malloc(SIZE), SIZE)
            base = engine.register((local.address, SIZE))  # found by the driver: device memory
            assert engine.lookup(engine.name).buffers[0].device == "cuda:0"
            data = np.random.default_rng(5).integers(0, 256, SIZE - 3, dtype=np.uint8)
            CUDA.from_host(local.sub(3, SIZE - 3), memoryview(data))
            seg = engine.open_segment(name)
            carried = engine.transport_for(seg, dev)
            assert carried == ("device_ipc" if transport == "auto" else "tcp"), carried
            engine.write(seg, dev + 1, (base + 3, SIZE - 3))  # GPU -> peer GPU
            digest = peer.call(30, cmd="digest", where="device", offset=1, nbytes=SIZE - 3)["sha256"]
            assert digest == hashlib.sha256(data.tobytes()).hexdigest()
            back = DeviceRange("cuda:0", fake_malloc(SIZE), SIZE)
            engine.register((back.address, SIZE))
            engine.read(seg, dev + 1, (back.address, SIZE - 3))  # peer GPU -> GPU
            out = bytearray(SIZE - 3)
            CUDA.to_host(back.sub(0, SIZE - 3), memoryview(out))
            assert bytes(out) == data.tobytes()
            host = np.zeros(SIZE - 3, np.uint8)
            engine.read(seg, dev + 1, host)  # peer GPU -> host memory here
            assert host.tobytes() == data.tobytes()
            engine.write(seg, shm, (base + 3, SIZE - 3))  # GPU -> the peer's shared memory
            digest = peer.call(30, cmd="digest", where="host", offset=0, nbytes=SIZE - 3)["sha256"]
            assert digest == hashlib.sha256(data.tobytes()).hexdigest()
    finally:
        peer.stop()
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1])
