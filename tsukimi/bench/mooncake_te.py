"""The real Mooncake Transfer Engine as a baseline: two worker processes and their protocol.

Owns `MooncakePair`, which starts a *target* and an *initiator* process, each running one
`mooncake.engine.TransferEngine` (TCP transport, P2P handshake, bound to 127.0.0.1) over one
registered buffer, and measures batched reads and writes between them. The timed loop runs
inside the initiator, so the control channel costs nothing in the figures.

Control channel: one JSON object per line, parent -> child on stdin, child -> parent on a
private duplicate of the child's stdout. The child points fd 1 at stderr first, so anything
the C++ library prints cannot corrupt the protocol; stderr (glog noise) goes to a temporary
file whose tail is quoted in errors.

    parent                 initiator (engine, buffer L)           target (engine, buffer T)
      | {"cmd":"measure"} ->  batch_transfer_sync_{read,write}  <-->  TCP, peer "127.0.0.1:PORT"
      | <- {"ok":true,"moved_bytes":...,"elapsed_s":...}

Each batch moves `batch` blocks: local L + i*block_bytes <-> remote T + i*block_bytes.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib
import importlib.util
import json
import logging
import mmap
import os
import random
import sys
from typing import Any, Literal, Protocol, cast

from tsukimi.bench.child import module_args
from tsukimi.clock import WallClock
from tsukimi.errors import ClosedError, ConfigError
from tsukimi.testing.processes import JsonWorker

logger = logging.getLogger(__name__)

Op = Literal["read", "write"]
Role = Literal["target", "initiator"]

MIB = 1 << 20
DEFAULT_BUFFER_BYTES = 64 * MIB
MAX_BUFFER_BYTES = 1 << 30
MOONCAKE_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LEGACY_RPC_PORT_BINDING": "1"}
_HOST = "127.0.0.1"
_STARTUP_TIMEOUT_S = 30.0
# NOTE: Mooncake gives up on its own after 60 s (P2P handshake read against a stuck peer) or
# MC_TRANSFER_TIMEOUT (30 s); waiting a little longer lets its own error, not ours, surface.
_CALL_MARGIN_S = 90.0

_Reply = dict[str, Any]


def mooncake_available() -> bool:
    """Whether `mooncake.engine` can be imported (it is not imported here)."""
    try:
        return importlib.util.find_spec("mooncake.engine") is not None
    except (ImportError, ValueError):
        return False


class _Engine(Protocol):
    """The part of `mooncake.engine.TransferEngine` (pybind11, 0.3.x) that we use."""

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str, /) -> int: ...
    def get_rpc_port(self) -> int: ...
    def register_memory(self, buffer_addr: int, capacity: int) -> int: ...
    def unregister_memory(self, buffer_addr: int, /) -> int: ...
    def batch_transfer_sync_read(
        self, target_hostname: str, buffers: list[int], peer_buffer_addresses: list[int], lengths: list[int]
    ) -> int: ...
    def batch_transfer_sync_write(
        self, target_hostname: str, buffers: list[int], peer_buffer_addresses: list[int], lengths: list[int]
    ) -> int: ...


class MooncakePair:
    """A Mooncake target and initiator in two processes, for throughput measurements.

    Args:
        buffer_bytes: size of the registered buffer on each side; must cover the largest
            `batch * block_bytes` to be measured (at most 1 GiB).

    Raises:
        ConfigError: `buffer_bytes` out of range.
        RuntimeError: a worker failed to start (the message quotes its stderr).
    """

    def __init__(self, buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> None:
        if not 0 < buffer_bytes <= MAX_BUFFER_BYTES:
            raise ConfigError(f"buffer_bytes must be in (0, {MAX_BUFFER_BYTES}], got {buffer_bytes}")
        self.buffer_bytes = buffer_bytes
        self._workers: list[JsonWorker] = []
        try:
            self._target = self._start("target")
            self._initiator = self._start("initiator")
        except BaseException:
            self.close()
            raise

    def _start(self, role: Role) -> JsonWorker:
        args = module_args("mooncake-te", "serve", role, str(self.buffer_bytes))
        worker = JsonWorker(f"mooncake {role}", args, _STARTUP_TIMEOUT_S, env=MOONCAKE_ENV)
        self._workers.append(worker)
        logger.info("mooncake %s up: pid %d, session %s", role, worker.pid, worker.ready["session"])
        return worker

    def measure(self, op: Op, block_bytes: int, batch: int, duration_s: float, warmup_s: float) -> float:
        """Move `batch` blocks of `block_bytes` per batch for `duration_s` after `warmup_s`.

        Returns:
            Throughput in GB/s (1e9 bytes per second) over the measured phase.

        Raises:
            ConfigError: bad op, sizes or durations. ClosedError: after `close()`.
            RuntimeError: Mooncake returned a non-zero code, or a worker died or timed out.
        """
        if duration_s <= 0 or warmup_s < 0:
            raise ConfigError(f"need duration_s > 0 and warmup_s >= 0, got {duration_s}, {warmup_s}")
        reply = self._run(op, block_bytes, batch, duration_s, warmup_s)
        return float(reply["moved_bytes"]) / float(reply["elapsed_s"]) / 1e9

    def verify(self, op: Op, nbytes: int = MIB) -> None:
        """Check that one transfer really moves the bytes (random data, SHA-256 on both sides).

        Mutates the first `nbytes` of both buffers. Raises RuntimeError on a mismatch.
        """
        src, dst = (self._initiator, self._target) if op == "write" else (self._target, self._initiator)
        src.call(_CALL_MARGIN_S, cmd="fill", nbytes=nbytes, seed=nbytes)
        self._run(op, nbytes, 1, 0.0, 0.0)
        want = src.call(_CALL_MARGIN_S, cmd="digest", nbytes=nbytes)["digest"]
        got = dst.call(_CALL_MARGIN_S, cmd="digest", nbytes=nbytes)["digest"]
        if want != got:
            raise RuntimeError(f"mooncake {op} of {nbytes} bytes: digest {got} != source {want}")

    def _run(self, op: Op, block_bytes: int, batch: int, duration_s: float, warmup_s: float) -> _Reply:
        if not self._workers:
            raise ClosedError("MooncakePair is closed")
        if op not in ("read", "write"):
            raise ConfigError(f"op must be 'read' or 'write', got {op!r}")
        if block_bytes <= 0 or batch <= 0 or block_bytes * batch > self.buffer_bytes:
            limit = f"0 < batch * block_bytes <= buffer_bytes ({self.buffer_bytes})"
            raise ConfigError(f"need {limit}, got {batch} * {block_bytes}")
        return self._initiator.call(
            warmup_s + duration_s + _CALL_MARGIN_S,
            cmd="measure",
            op=op,
            peer=self._target.ready["session"],
            peer_addr=self._target.ready["addr"],
            block_bytes=block_bytes,
            batch=batch,
            duration_s=duration_s,
            warmup_s=warmup_s,
        )

    def close(self) -> None:
        """Stop both workers (bounded waits, SIGKILL if needed). Idempotent."""
        workers, self._workers = self._workers, []
        for worker in reversed(workers):
            worker.stop()

    def __enter__(self) -> MooncakePair:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ---- worker process side ---------------------------------------------------------------


def _timed_batches(engine: _Engine, local_addr: int, cmd: _Reply) -> _Reply:
    """Run the warm-up then the measured loop of one `measure` command (inside the initiator)."""
    op, peer, block, batch = cmd["op"], str(cmd["peer"]), int(cmd["block_bytes"]), int(cmd["batch"])
    transfer = engine.batch_transfer_sync_write if op == "write" else engine.batch_transfer_sync_read
    local = [local_addr + i * block for i in range(batch)]
    remote = [int(cmd["peer_addr"]) + i * block for i in range(batch)]
    lengths = [block] * batch
    clock = WallClock()

    def until(deadline: float) -> int:  # always at least one batch
        num_batches = 0
        while True:
            rc = transfer(peer, local, remote, lengths)
            if rc != 0:
                raise RuntimeError(f"batch_transfer_sync_{op}({peer}, {batch} x {block} B) returned {rc}")
            num_batches += 1
            if clock.now() >= deadline:
                return num_batches

    until(clock.now() + float(cmd["warmup_s"]))
    start = clock.now()
    num_batches = until(start + float(cmd["duration_s"]))
    return {"moved_bytes": num_batches * batch * block, "elapsed_s": clock.now() - start}


def _serve(role: Role, buffer_bytes: int) -> int:
    """Worker main loop: set up engine and buffer, then answer commands until EOF."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # NOTE: C++ prints to fd 1 must not corrupt the protocol.

    def reply(**fields: object) -> None:
        proto.write(json.dumps(fields) + "\n")

    engine = cast(_Engine, importlib.import_module("mooncake.engine").TransferEngine())
    rc = engine.initialize(_HOST, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        reply(ok=False, error=f"initialize returned {rc}")
        return 1
    buf = mmap.mmap(-1, buffer_bytes)
    for offset in range(0, buffer_bytes, MIB):  # fault every page in before timing
        chunk_bytes = min(MIB, buffer_bytes - offset)
        buf[offset : offset + chunk_bytes] = b"\x5a" * chunk_bytes
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    rc = engine.register_memory(addr, buffer_bytes)
    if rc != 0:
        reply(ok=False, error=f"register_memory returned {rc}")
        return 1
    reply(ok=True, session=f"{_HOST}:{engine.get_rpc_port()}", addr=addr)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "measure":
            try:
                reply(ok=True, **_timed_batches(engine, addr, cmd))
            except RuntimeError as exc:
                reply(ok=False, error=str(exc))
        elif cmd["cmd"] == "fill":
            buf[: cmd["nbytes"]] = random.Random(cmd["seed"]).randbytes(cmd["nbytes"])
            reply(ok=True)
        elif cmd["cmd"] == "digest":
            reply(ok=True, digest=hashlib.sha256(buf[: cmd["nbytes"]]).hexdigest())
        else:
            reply(ok=False, error=f"unknown command {cmd['cmd']!r}")
    engine.unregister_memory(addr)
    return 0


def _selftest(duration_s: float) -> None:
    blocks, ops, batches = (64 << 10, MIB, 4 * MIB), ("read", "write"), (1, 4)
    cells = [(op, block, batch) for block in blocks for op in ops for batch in batches]
    with MooncakePair(buffer_bytes=4 * 4 * MIB) as pair:
        pair.verify("write")
        pair.verify("read")
        print(f"{'op':<6} {'block':>8} {'batch':>5} {'GB/s':>7}")
        for op, block, batch in cells:
            gbps = pair.measure(cast(Op, op), block, batch, duration_s, warmup_s=0.2)
            print(f"{op:<6} {block >> 10:>6}Ki {batch:>5} {gbps:>7.3f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """`selftest [--duration-s S]`, or `serve ROLE BUFFER_BYTES` (internal: one worker)."""
    parser = argparse.ArgumentParser(prog="python -m tsukimi.bench.child mooncake-te")
    sub = parser.add_subparsers(dest="command", required=True)
    selftest = sub.add_parser("selftest", help="measure a few cells and print them")
    selftest.add_argument("--duration-s", type=float, default=1.0)
    serve = sub.add_parser("serve", help="internal: run one worker process")
    serve.add_argument("role", choices=["target", "initiator"])
    serve.add_argument("buffer_bytes", type=int)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.command == "selftest" else logging.WARNING)
    if args.command == "serve":
        return _serve(args.role, args.buffer_bytes)
    if not mooncake_available():
        print("mooncake.engine is not installed", file=sys.stderr)
        return 1
    _selftest(args.duration_s)
    return 0
