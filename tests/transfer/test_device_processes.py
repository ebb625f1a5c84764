"""Device memory between two processes on this host: the peer (tests/transfer/device_peer.py)
owns device memory and a shared-memory buffer; this process moves bytes from host and device
memory over auto (device_ipc / shm), device_ipc, shm and tcp forced (the peer's server stages
through its own pinned chunks: its copy counters prove it). Faults: the owner releases its
device memory mid-use, the owner is SIGKILLed. The same cases with CUDA tensors run on a GPU
(`pytest -m gpu`)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.transfer.conftest import CHECKOUT
from tsukimi.config import Config, MetadataConfig, TransferConfig
from tsukimi.device import EMULATED, EmulatedDevice, device_range
from tsukimi.errors import OutOfBounds
from tsukimi.testing.processes import JsonWorker
from tsukimi.transfer import OpCode, RequestState, TransferEngine, TransferRequest
from tsukimi.transfer.staging import CHUNK_BYTES

SIZE = 3 * CHUNK_BYTES
N = 2 * CHUNK_BYTES + 4099  # across staging chunks


def _peer(kind: str) -> JsonWorker:
    return JsonWorker(f"device peer ({kind})", ["tests.transfer.device_peer", kind, str(SIZE)], pythonpath=[CHECKOUT])


@pytest.fixture
def peer() -> Iterator[JsonWorker]:
    worker = _peer("emu")
    try:
        yield worker
    finally:
        worker.stop()


def _engine(transport: str, timeout_s: float = 10.0) -> TransferEngine:
    config = TransferConfig(transport=transport, timeout_s=timeout_s)
    return TransferEngine(config=Config(transfer=config, metadata=MetadataConfig(url="p2p")))


def _sha(data: bytes | np.ndarray) -> str:
    return hashlib.sha256(bytes(memoryview(data))).hexdigest()


@pytest.mark.parametrize("transport", ["auto", "device_ipc", "shm", "tcp"])
def test_host_and_device_memory_move_to_and_from_a_peer_process(transport: str, peer: JsonWorker) -> None:
    name, dev, shm = peer.ready["name"], peer.ready["device_base"], peer.ready["host_base"]
    data = np.random.default_rng(5).integers(0, 256, N, dtype=np.uint8)
    served_before = peer.call(10, cmd="stats")["stats"]
    with _engine(transport) as engine, EmulatedDevice(1).alloc(N) as local_dev:
        seg = engine.open_segment(name)
        local_dev.write(0, data)
        if transport != "shm":  # -> the peer's device memory, from host and from device
            engine.write(seg, dev + 1, data)
            assert peer.call(10, cmd="digest", where="device", offset=1, nbytes=N)["sha256"] == _sha(data)
            peer.call(10, cmd="fill", seed=1, nbytes=N, offset=1)
            engine.write(seg, dev + 1, local_dev)
            assert peer.call(10, cmd="digest", where="device", offset=1, nbytes=N)["sha256"] == _sha(data)
            back = np.zeros(N, np.uint8)
            engine.read(seg, dev + 1, back)
            assert np.array_equal(back, data)
            with EmulatedDevice(1).alloc(N) as into:
                engine.read(seg, dev + 1, into)
                assert into.read(0, N) == data.tobytes()
        if transport != "device_ipc":  # local device memory <-> the peer's shared memory
            engine.write(seg, shm + 5, local_dev)
            assert peer.call(10, cmd="digest", where="host", offset=5, nbytes=N)["sha256"] == _sha(data)
            with EmulatedDevice(1).alloc(N) as into:
                engine.read(seg, shm + 5, into)
                assert into.read(0, N) == data.tobytes()
    served = peer.call(10, cmd="stats")["stats"]
    fill = N if transport != "shm" else 0  # the peer's own "fill" command
    staged = served.get("from_host_bytes", 0) - served_before.get("from_host_bytes", 0) - fill
    if transport == "tcp":  # the peer's server staged the device bytes through its chunks
        assert staged >= 2 * N and served.get("to_host_bytes", 0) >= 2 * N
    else:  # nobody in the peer touched a byte: this process copied everything itself
        assert staged == 0


def test_the_owner_releasing_its_device_memory_fails_writes_instead_of_landing(peer: JsonWorker) -> None:
    with _engine("auto") as engine:
        seg = engine.open_segment(peer.ready["name"])
        base = peer.ready["device_base"]
        engine.write(seg, base, b"before")
        assert engine.transport_for(seg, base) == "device_ipc"
        peer.call(10, cmd="release")
        copies = EMULATED.stats["from_host"]
        with pytest.raises(OutOfBounds, match="released"):
            engine.write(seg, base, b"after")
        assert EMULATED.stats["from_host"] == copies


@pytest.mark.parametrize("transport", ["device_ipc", "tcp"])
def test_a_killed_owner_fails_device_transfers_in_bounded_time(transport: str, peer: JsonWorker) -> None:
    timeout_s = 2.0
    with _engine(transport, timeout_s) as engine, EmulatedDevice(1).alloc(CHUNK_BYTES) as local_dev:
        seg = engine.open_segment(peer.ready["name"])
        base = peer.ready["device_base"]
        engine.write(seg, base, local_dev)  # the peer works
        outcomes: list[tuple[float, RequestState, str]] = []
        stop = threading.Event()

        def hammer() -> None:
            while not stop.is_set():
                status = engine.transfer([TransferRequest(OpCode.WRITE, seg, base, local_dev)])[0]
                outcomes.append((time.monotonic(), status.state, status.error_code))

        thread = threading.Thread(target=hammer)
        thread.start()
        time.sleep(0.2)
        killed_at = time.monotonic()
        peer.kill()
        time.sleep(timeout_s + 1.5)
        stop.set()
        thread.join(timeout=timeout_s * 3)
        assert not thread.is_alive(), "a transfer to a dead owner hung"
    after = [(t, s, c) for t, s, c in outcomes if t > killed_at]
    assert after and after[-1][1] in (RequestState.FAILED, RequestState.TIMED_OUT)
    failures = [t for t, s, _ in after if s is not RequestState.COMPLETED]
    assert min(failures) - killed_at < timeout_s + 1.0
    if transport == "device_ipc":
        assert after[-1][2] == "peer"


def test_cma_refuses_device_memory(peer: JsonWorker) -> None:
    with _engine("cma") as engine, EmulatedDevice(1).alloc(64) as local_dev:
        seg = engine.open_segment(peer.ready["name"])
        status = engine.transfer([TransferRequest(OpCode.WRITE, seg, peer.ready["device_base"], b"x" * 64)])[0]
        assert status.state is RequestState.FAILED and "cannot reach" in status.reason
        status = engine.transfer([TransferRequest(OpCode.WRITE, seg, peer.ready["host_base"], local_dev)])[0]
        assert status.state is RequestState.FAILED and "cannot reach" in status.reason
        assert engine.transport_for(seg, peer.ready["host_base"]) in ("shm", "cma")


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_cuda_tensors_move_between_two_processes(transport: str) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    worker = _peer("cuda")
    try:
        name, dev, shm = worker.ready["name"], worker.ready["device_base"], worker.ready["host_base"]
        data = torch.randint(0, 256, (N,), dtype=torch.uint8)
        local = data.cuda()
        torch.cuda.synchronize()
        assert device_range(local) is not None
        with _engine(transport) as engine:
            seg = engine.open_segment(name)
            engine.write(seg, dev + 1, local)  # GPU -> GPU (CUDA IPC under auto)
            assert worker.call(30, cmd="digest", where="device", offset=1, nbytes=N)["sha256"] == _sha(data.numpy())
            back = torch.zeros(N, dtype=torch.uint8, device="cuda")
            torch.cuda.synchronize()  # NOTE: the TE's copies are not ordered after torch's kernels
            engine.read(seg, dev + 1, back)
            torch.cuda.synchronize()
            assert torch.equal(back.cpu(), data)
            engine.write(seg, shm, local)  # GPU -> the peer's shared memory
            assert worker.call(30, cmd="digest", where="host", offset=0, nbytes=N)["sha256"] == _sha(data.numpy())
            host = torch.zeros(N, dtype=torch.uint8)
            engine.read(seg, dev + 1, host)  # the peer's GPU -> host
            assert torch.equal(host, data)
    finally:
        worker.stop()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_cuda_memory_moves_between_processes_over_a_stand_in_driver(transport: str, fake_driver: Path) -> None:
    """tsukimi/device/cuda.py under the Transfer Engine, in CI: both processes load the stand-in
    driver (TSUKIMI_LIBCUDA), register pointers it reports as device memory, and move them
    GPU to GPU over CUDA IPC (auto: device_ipc) or pinned staging on both sides (tcp)."""
    env = {**os.environ, "TSUKIMI_LIBCUDA": str(fake_driver), "PYTHONPATH": str(CHECKOUT)}
    args = [sys.executable, "-m", "tests.transfer.fake_cuda_pair", transport]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-4000:]
