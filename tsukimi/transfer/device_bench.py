"""Timing the Transfer Engine with device memory between two processes on one host, for the
GPU machine (and, on the emulated device, anywhere):

    python -m tsukimi.transfer.device_bench --device cuda [--transports auto,tcp] [--quick]

prints one JSON object: per transport (auto: device_ipc / shm; tcp: staged on both sides),
op (WRITE, READ), pair (local host -> peer device, local device -> peer host shared memory,
local device -> peer device) and size (64 KiB - 64 MiB), the GB/s (1e9 B/s) of whole
transfers, repeated for `duration_s` after one warm-up. `measure_device_transfers` is the
same as a function (tsukimi bench gpu calls it). The peer is this module run as
`python -m tsukimi.transfer.device_bench --peer KIND SIZE`: it registers SIZE bytes of device
memory and SIZE bytes of shared memory and waits until its stdin closes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from tsukimi.config import Config, MetadataConfig, TransferConfig
from tsukimi.device import backend, device_range
from tsukimi.device.emulated import EmulatedDevice
from tsukimi.transfer.batch import OpCode, RequestState, TransferRequest
from tsukimi.transfer.engine import TransferEngine

SIZES = (64 << 10, 1 << 20, 16 << 20, 64 << 20)
PAIRS = (("host", "device"), ("device", "host"), ("device", "device"))


@dataclass(frozen=True, slots=True)
class DeviceTransferResult:
    """One timed cell: `gbps` of `op` from/into `local` memory here to/from `remote` memory
    of the peer, `size_bytes` per transfer, over `transport` (and the one auto picked)."""

    transport: str
    carried_by: str
    op: str
    local: str
    remote: str
    size_bytes: int
    gbps: float


def _allocate(kind: str, nbytes: int) -> tuple[object, object]:
    """(what keeps it alive, what to register or transfer) for `nbytes` of device memory."""
    if kind == "emu":
        memory = EmulatedDevice(0).alloc(nbytes)
        return memory, memory
    import torch  # NOTE: only on a GPU host, only for this benchmark

    tensor = torch.zeros(nbytes, dtype=torch.uint8, device=kind)
    torch.cuda.synchronize()  # NOTE: the TE's copies are not ordered after torch's kernels
    return tensor, tensor


def measure_device_transfers(
    kind: str = "cuda",
    transports: Sequence[str] = ("auto", "tcp"),
    sizes: Sequence[int] = SIZES,
    duration_s: float = 0.5,
) -> list[DeviceTransferResult]:
    """Time TE transfers with device memory of `kind` ("cuda", or "emu" without a GPU)
    between this process and a peer process it starts (see the module).

    Raises:
        RuntimeError: the peer failed to start, or a transfer failed.
    """
    size = max(sizes)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([p for p in sys.path if p])}
    args = [sys.executable, "-m", "tsukimi.transfer.device_bench", "--peer", kind, str(size)]
    peer = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    assert peer.stdout is not None and peer.stdin is not None
    try:
        ready = json.loads(peer.stdout.readline() or "null")
        if not ready:
            raise RuntimeError("the device benchmark's peer did not start")
        keep, local_device = _allocate(kind, size)
        local_host = np.zeros(size, np.uint8)
        unpin = backend(kind).pin(local_host.data)
        results = []
        try:
            for transport in transports:
                config = Config(transfer=TransferConfig(transport=transport), metadata=MetadataConfig(url="p2p"))
                with TransferEngine(config=config) as engine:
                    seg = engine.open_segment(ready["name"])
                    for local, remote in PAIRS:
                        base = ready["device_base" if remote == "device" else "host_base"]
                        memory = local_device if local == "device" else local_host
                        carried = engine.transport_for(seg, base)
                        for op in (OpCode.WRITE, OpCode.READ):
                            for nbytes in sizes:
                                request = TransferRequest(op, seg, base, memory, length=nbytes)
                                gbps = _rate(engine, request, nbytes, duration_s)
                                results.append(
                                    DeviceTransferResult(transport, carried, op.name, local, remote, nbytes, gbps)
                                )
        finally:
            unpin()
            del keep
        return results
    finally:
        peer.stdin.close()
        peer.wait(timeout=10)


def _rate(engine: TransferEngine, request: TransferRequest, nbytes: int, duration_s: float) -> float:
    def once() -> None:
        status = engine.transfer([request])[0]
        if status.state is not RequestState.COMPLETED:
            raise RuntimeError(f"transfer failed: {status.reason}")

    once()  # warm-up: connections, IPC opens, staging chunks, pinning
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < duration_s or count < 3:
        once()
        count += 1
    return count * nbytes / elapsed / 1e9


def _serve_as_peer(kind: str, size: int) -> None:
    with TransferEngine(config=Config(metadata=MetadataConfig(url="p2p"))) as engine:
        keep, memory = _allocate(kind, size)
        assert kind == "emu" or device_range(memory) is not None
        device_base = engine.register(memory)
        host = engine.allocate(size)
        print(json.dumps({"name": engine.name, "device_base": device_base, "host_base": host.base}), flush=True)
        sys.stdin.read()  # NOTE: until the driver closes our stdin
        del keep


def main(argv: Sequence[str] | None = None) -> None:
    """The command line (see the module)."""
    parser = argparse.ArgumentParser(prog="python -m tsukimi.transfer.device_bench")
    parser.add_argument("--device", default="cuda", help="cuda, or emu (the emulated device)")
    parser.add_argument("--transports", default="auto,tcp")
    parser.add_argument("--quick", action="store_true", help="64 KiB and 1 MiB only, 0.1 s a cell")
    parser.add_argument("--peer", nargs=2, metavar=("KIND", "SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peer:
        _serve_as_peer(args.peer[0], int(args.peer[1]))
        return
    sizes, duration_s = ((64 << 10, 1 << 20), 0.1) if args.quick else (SIZES, 0.5)
    rows = measure_device_transfers(args.device, args.transports.split(","), sizes, duration_s)
    print(json.dumps({"device": args.device, "results": [asdict(row) for row in rows]}, indent=1))


if __name__ == "__main__":
    main()
