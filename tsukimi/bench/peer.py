"""Worker processes of `tsukimi bench transfer`, driven by line-delimited JSON on stdin/stdout.

Roles (`python -m tsukimi.bench.child transfer-peer ROLE`, tsukimi/bench/child.py):
  target SIZE [METADATA_URL]     a Transfer Engine owning a shared-memory buffer and a plain
                                numpy one; prints {"name", "base", "anon_base", "pid"};
                                answers "digest" commands.
  initiator SIZE [METADATA_URL]  Transfer Engines (one per connection count and slice size)
                                that run `measure` and `verify` commands.
  sink        a raw-socket baseline: accepts one connection and recv_into()s a 4 MiB buffer.
  source      the other end of the baseline: sendall()s 4 MiB blocks for a duration.
Every process exits when its stdin closes.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import time
from typing import Any

import numpy as np

from tsukimi.bench.measure import rate
from tsukimi.config import Config, MetadataConfig, TransferConfig
from tsukimi.testing.processes import child_reply as _reply
from tsukimi.transfer import OpCode, TransferEngine, TransferRequest

BASELINE_BLOCK = 4 << 20
_DEFAULT_SLICE_BYTES = TransferConfig().slice_bytes


def _commands() -> Any:
    for line in sys.stdin:
        if line.strip():
            yield json.loads(line)


def _config(metadata_url: str, **transfer: int) -> Config:
    nixl = os.environ.get("TSUKIMI_BENCH_NIXL") == "1"  # NOTE: the driver turns the nixl transport on
    return Config(transfer=TransferConfig(nixl=nixl, **transfer), metadata=MetadataConfig(url=metadata_url))  # type: ignore[arg-type]


def run_target(size: int, metadata_url: str) -> None:
    name = None if metadata_url == "p2p" else f"bench-target-{os.getpid()}"
    with TransferEngine(name, _config(metadata_url, num_connections=1)) as engine:
        buf = engine.allocate(size)
        memory = np.frombuffer(buf.view, np.uint8)
        memory[:] = 7
        # NOTE: plain process memory too (what an inference engine's KV cache is): the cma
        # cells use it, as NIXL's target does; shared memory goes faster over shm
        anon = np.full(size, 7, np.uint8)
        anon_base = engine.register(anon)
        _reply({"name": engine.name, "base": buf.base, "anon_base": anon_base, "pid": os.getpid()})
        for cmd in _commands():  # "digest": what landed in our memory, for the demo's check
            chunk = memory[cmd["offset"] : cmd["offset"] + cmd["nbytes"]]
            _reply({"sha256": hashlib.sha256(chunk.data).hexdigest()})


def measure(engine: TransferEngine, cmd: dict[str, Any], local: np.ndarray) -> float:
    """Run whole batches for cmd["duration_s"] after cmd["warmup_s"]; GB/s (1e9 B/s)."""
    transport, _, mode = cmd["transport"].partition("+")  # "cma+prepared": prepared once, run each batch
    handle = engine.open_segment(cmd["name"], transport=transport)
    op = OpCode(cmd["op"])
    block, batch = cmd["block_bytes"], cmd["batch"]
    requests = [
        TransferRequest(op, handle, cmd["base"] + i * block, local[i * block : (i + 1) * block]) for i in range(batch)
    ]
    run = engine.prepare(requests).run if mode == "prepared" else lambda: engine.transfer(requests)

    def step() -> int:
        bad = [r for r in run() if r.state.value != "completed"]
        if bad:
            raise RuntimeError(f"transfer failed: {bad[0]}")
        return int(block * batch)

    return rate(step, cmd["warmup_s"], cmd["duration_s"]) / 1e9


def measure_raw_cma(cmd: dict[str, Any], local: np.ndarray) -> float:
    """The kernel's floor for the cma transport: one process_vm_readv/writev per batch with
    the whole iovec lists, from this process straight into the target's buffer; GB/s."""
    from tsukimi.transfer.transports.cma import raw_call

    block, batch = cmd["block_bytes"], cmd["batch"]
    pairs = [(int(local.ctypes.data) + i * block, cmd["base"] + i * block, block) for i in range(batch)]
    call = raw_call(OpCode(cmd["op"]), cmd["pid"], pairs)

    def step() -> int:
        if call() != block * batch:
            raise RuntimeError("process_vm_readv/writev moved less than asked")
        return int(block * batch)

    return rate(step, cmd["warmup_s"], cmd["duration_s"]) / 1e9


def verify(engine: TransferEngine, cmd: dict[str, Any]) -> dict[str, Any]:
    """Write random bytes, read them back into another buffer; report digests."""
    handle = engine.open_segment(cmd["name"], transport=cmd["transport"])
    data = np.random.default_rng(cmd["seed"]).integers(0, 256, cmd["nbytes"], dtype=np.uint8)
    engine.write(handle, cmd["base"], data)
    back = np.zeros_like(data)
    engine.read(handle, cmd["base"], back)
    return {"sha256": hashlib.sha256(data.data).hexdigest(), "read_back_equal": bool(np.array_equal(data, back))}


def run_initiator(size: int, metadata_url: str) -> None:
    engines: dict[tuple[int, int], TransferEngine] = {}
    local = np.full(size, 3, np.uint8)
    _reply({})
    try:
        for cmd in _commands():
            key = (cmd["connections"], cmd.get("slice_bytes", _DEFAULT_SLICE_BYTES))
            if key not in engines:
                name = None if metadata_url == "p2p" else f"bench-initiator-{os.getpid()}-{len(engines)}"
                config = _config(metadata_url, num_connections=key[0], slice_bytes=key[1])
                engines[key] = TransferEngine(name, config)
            try:
                if cmd.get("cmd") == "verify":
                    _reply(verify(engines[key], cmd))
                elif cmd.get("transport") == "cma-raw":
                    _reply({"gbps": measure_raw_cma(cmd, local)})
                else:
                    _reply({"gbps": measure(engines[key], cmd, local)})
            except Exception as exc:  # report to the driver, which raises it there
                _reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        for engine in engines.values():
            engine.close()


def run_sink() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        _reply({"port": server.getsockname()[1]})
        conn, _ = server.accept()
        buf = memoryview(bytearray(BASELINE_BLOCK))
        total, start = 0, None
        while (got := conn.recv_into(buf)) > 0:
            if start is None:
                start = time.perf_counter()
            total += got
        seconds = time.perf_counter() - (start or time.perf_counter())
        _reply({"gbps": total / seconds / 1e9 if seconds > 0 else 0.0})


def run_source(port: int, duration_s: float) -> None:
    data = memoryview(bytearray(BASELINE_BLOCK))
    _reply({})
    with socket.create_connection(("127.0.0.1", port)) as conn:
        end = time.perf_counter() + duration_s
        while time.perf_counter() < end:
            conn.sendall(data)
    _reply({"done": True})


def main(argv: list[str]) -> None:
    """Run the role `argv[0]` (see the module) until stdin closes."""
    role = argv[0]
    metadata_url = argv[2] if len(argv) > 2 else "p2p"
    if role == "target":
        run_target(int(argv[1]), metadata_url)
    elif role == "initiator":
        run_initiator(int(argv[1]), metadata_url)
    elif role == "sink":
        run_sink()
    elif role == "source":
        run_source(int(argv[1]), float(argv[2]))
    else:
        raise SystemExit(f"unknown role {role}")
