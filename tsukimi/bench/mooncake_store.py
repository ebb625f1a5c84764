"""The real Mooncake Store as a baseline: a master, holder processes, and an in-process client.

Owns `MooncakeCluster` (one `mooncake_master` plus `num_holders` holder processes, each a
`MooncakeDistributedStore` that mounts `holder_bytes` of memory into the cluster and does
nothing else) and `MooncakeStoreAdapter` (a pure client, `global_segment_size=0`, used inside
whichever process runs the timed loop, with two registered page-aligned buffers).

    parent / bench client                 master (--rpc_port P, 127.0.0.1)
      MooncakeStoreAdapter  --- RPC ---->   object -> replica placement
        src, dst buffers    <-- TCP --->  holder 0 (segment "127.0.0.1:H0", holder_bytes)
                            <-- TCP --->  holder 1 (segment "127.0.0.1:H1", holder_bytes)

Setup that works with 0.3.13.post1: metadata_server="P2PHANDSHAKE" (no metadata server at
all), protocol "tcp", and a distinct `local_hostname` "127.0.0.1:PORT" per store process.
The hostname becomes the segment name on the master, so two processes sharing one name would
collide; with P2P handshake the port in it is a name only (the engine listens on a port of
its own choosing), so a free port is picked just to make the name unique.

Holders speak the JSON-lines protocol of `tsukimi.testing.processes.JsonWorker` on a private
duplicate of stdout: fd 1 is pointed at stderr first so nothing the C++ library prints can
corrupt it. The master logs to stderr (`--logtostderr`, so glog writes no files into /tmp);
each process's stderr goes to a temporary file whose tail is quoted when startup fails.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import logging
import mmap
import os
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Protocol, cast

import numpy as np
import numpy.typing as npt

from tsukimi.bench.mooncake_te import MOONCAKE_ENV
from tsukimi.clock import WallClock
from tsukimi.errors import ClosedError, ConfigError, OutOfBounds
from tsukimi.testing.processes import JsonWorker, WorkerError, child_reply, free_port

logger = logging.getLogger(__name__)

MIB = 1 << 20
LOCAL_BUFFER_BYTES = 16 * MIB  # each store's own staging buffer (setup's local_buffer_size)
_HOST = "127.0.0.1"
_METADATA = "P2PHANDSHAKE"
_MASTER_STARTUP_TIMEOUT_S = 15.0
_HOLDER_STARTUP_TIMEOUT_S = 30.0
_TERM_TIMEOUT_S = 5.0
_KILL_TIMEOUT_S = 5.0
_POLL_S = 0.05
_HOLDER_CLOSE_TIMEOUT_S = 1.5  # below JsonWorker's 2 s exit grace
_STDERR_TAIL_BYTES = 2000


def master_binary() -> Path:
    """Where `mooncake_master` is expected: next to the running interpreter."""
    return Path(sys.executable).parent / "mooncake_master"


def mooncake_store_available() -> bool:
    """Whether `mooncake.store` can be imported (it is not imported here) and the master exists."""
    try:
        found = importlib.util.find_spec("mooncake.store") is not None
    except (ImportError, ValueError):
        return False
    return found and master_binary().is_file()


def _unique_hostname() -> str:
    return f"{_HOST}:{free_port(_HOST)}"


class _ReplicateConfig(Protocol):
    """`mooncake.store.ReplicateConfig`: only the replica count is set."""

    replica_num: int


class _Store(Protocol):
    """The part of `mooncake.store.MooncakeDistributedStore` (pybind11, 0.3.x) that we use."""

    def setup(
        self,
        local_hostname: str,
        metadata_server: str,
        global_segment_size: int,
        local_buffer_size: int,
        protocol: str,
        rdma_devices: str,
        master_server_addr: str,
    ) -> int: ...
    def register_buffer(self, buffer_ptr: int, size: int) -> int: ...
    def unregister_buffer(self, buffer_ptr: int) -> int: ...
    def put_from(self, key: str, buffer_ptr: int, size: int, config: _ReplicateConfig) -> int: ...
    def batch_put_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], config: _ReplicateConfig
    ) -> list[int]: ...
    def get_into(self, key: str, buffer_ptr: int, size: int) -> int: ...
    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]: ...
    def is_exist(self, key: str, /) -> int: ...
    def get_replica_desc(self, key: str) -> list[object]: ...
    def remove(self, key: str, force: bool) -> int: ...
    def remove_all(self, force: bool) -> int: ...
    def close(self) -> int: ...


def _new_store() -> tuple[_Store, Callable[[], _ReplicateConfig]]:
    """A fresh store object and the `ReplicateConfig` constructor."""
    for name, value in MOONCAKE_ENV.items():
        os.environ.setdefault(name, value)  # NOTE: read by the C++ engine during setup().
    module = importlib.import_module("mooncake.store")
    return cast(_Store, module.MooncakeDistributedStore()), module.ReplicateConfig


def _stderr_tail(stream: IO[bytes]) -> str:
    stream.seek(0, os.SEEK_END)
    stream.seek(max(0, stream.tell() - _STDERR_TAIL_BYTES))
    return stream.read().decode(errors="replace").strip()


class MooncakeCluster:
    """A running `mooncake_master` and `num_holders` holder processes on 127.0.0.1.

    Args:
        holder_bytes: memory each holder mounts into the cluster (global_segment_size).
        num_holders: how many holder processes (replica_num can be at most this).

    Raises:
        ConfigError: bad sizes or counts, or the master binary is missing.
        RuntimeError: the master did not start (its stderr is quoted); WorkerError (a
            RuntimeError) when a holder did not.
    """

    def __init__(self, holder_bytes: int, num_holders: int = 2) -> None:
        if holder_bytes <= 0 or num_holders <= 0:
            raise ConfigError(f"need holder_bytes > 0 and num_holders > 0, got {holder_bytes}, {num_holders}")
        if not master_binary().is_file():
            raise ConfigError(f"mooncake_master not found at {master_binary()}")
        self.holder_bytes = holder_bytes
        self.master_addr = f"{_HOST}:{free_port(_HOST)}"
        self._clock = WallClock()
        self._master_stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        self._master: subprocess.Popen[bytes] | None = None
        self._holders: list[JsonWorker] = []
        try:
            self._start_master()
            for index in range(num_holders):
                self._start_holder(index)
        except WorkerError as exc:
            # NOTE: a foreign listener on the master's port passes the readiness probe; the
            # master then exits and the holder hangs: blame the master, quoting its stderr.
            rc = self._master.poll() if self._master is not None else None
            message = self._master_error(f"exited (rc={rc})") if rc is not None else None
            self.close()
            if message is not None:
                raise RuntimeError(message) from exc
            raise
        except BaseException:
            self.close()
            raise

    def _start_master(self) -> None:
        port = self.master_addr.rpartition(":")[2]
        args = [
            str(master_binary()),
            f"--rpc_port={port}",
            f"--rpc_address={_HOST}",
            f"--metrics_host={_HOST}",
            "--metrics_port=0",  # NOTE: the default, 9003 on 0.0.0.0, would collide; 0 = any.
            "--enable_metric_reporting=false",
            "--logtostderr",
        ]
        logger.debug("starting %s", " ".join(args))
        self._master = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=self._master_stderr, stderr=subprocess.STDOUT
        )
        deadline = self._clock.now() + _MASTER_STARTUP_TIMEOUT_S
        while not self._accepts(int(port)):
            if self._master.poll() is not None:
                raise RuntimeError(self._master_error(f"exited (rc={self._master.returncode})"))
            if self._clock.now() >= deadline:
                raise RuntimeError(self._master_error(f"no RPC listener within {_MASTER_STARTUP_TIMEOUT_S:.0f} s"))
            self._clock.sleep(_POLL_S)
        logger.info("mooncake master up: pid %d, %s", self._master.pid, self.master_addr)

    @staticmethod
    def _accepts(port: int) -> bool:
        with contextlib.suppress(OSError), socket.create_connection((_HOST, port), timeout=1.0):
            return True
        return False

    def _master_error(self, what: str) -> str:
        pid = self._master.pid if self._master is not None else -1
        return f"mooncake_master (pid {pid}): {what}\n--- stderr tail ---\n{_stderr_tail(self._master_stderr)}"

    def _start_holder(self, index: int) -> None:
        hostname = _unique_hostname()
        args = ["tsukimi.bench.mooncake_store", "holder", self.master_addr, hostname, str(self.holder_bytes)]
        worker = JsonWorker(f"mooncake holder {index}", args, _HOLDER_STARTUP_TIMEOUT_S, env=MOONCAKE_ENV)
        self._holders.append(worker)
        logger.info("mooncake holder %d up: pid %d, segment %s", index, worker.pid, hostname)

    def close(self) -> None:
        """Stop the holders (close stdin, then kill), then the master (SIGTERM, then SIGKILL).

        Every wait is bounded. Idempotent.
        """
        holders, self._holders = self._holders, []
        for worker in reversed(holders):
            worker.stop()
        master, self._master = self._master, None
        if master is not None:
            master.terminate()
            try:
                master.wait(timeout=_TERM_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                master.kill()
                try:
                    master.wait(timeout=_KILL_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    logger.warning("mooncake_master pid %d survived SIGKILL", master.pid)
        self._master_stderr.close()

    def __enter__(self) -> MooncakeCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class MooncakeStoreAdapter:
    """A Mooncake Store client inside this process, over two registered buffers `src`, `dst`.

    Puts read from `src`, gets write into `dst`; offsets are byte offsets into those buffers.
    The caller should have pointed fd 1 away from any protocol stream it uses (the C++ library
    may print to stdout). Sets the `MOONCAKE_ENV` variables in this process if unset.

    Args:
        master_addr: "127.0.0.1:PORT" of the master (`MooncakeCluster.master_addr`).
        buffer_bytes: size of each of `src` and `dst`.

    Raises:
        ConfigError: bad `buffer_bytes`. RuntimeError: setup or registration failed (the code).
    """

    def __init__(self, master_addr: str, buffer_bytes: int) -> None:
        if buffer_bytes <= 0:
            raise ConfigError(f"buffer_bytes must be > 0, got {buffer_bytes}")
        self.buffer_bytes = buffer_bytes
        self._store, self._new_config = _new_store()
        self._configs: dict[int, _ReplicateConfig] = {}
        self._registered: list[int] = []
        self.hostname = _unique_hostname()
        # NOTE: global_segment_size=0 is accepted: the client mounts nothing ("skip mounting").
        _check(self._store.setup(self.hostname, _METADATA, 0, LOCAL_BUFFER_BYTES, "tcp", "", master_addr), "setup")
        self._closed = False
        # NOTE: the mmaps are never closed explicitly: numpy views export their buffers, so
        # mmap.close() would raise while a caller still holds `src`/`dst`; GC unmaps them.
        self.src: npt.NDArray[np.uint8] = np.frombuffer(mmap.mmap(-1, buffer_bytes), dtype=np.uint8)
        self.dst: npt.NDArray[np.uint8] = np.frombuffer(mmap.mmap(-1, buffer_bytes), dtype=np.uint8)
        self.src.fill(0)  # fault every page in before anything is timed
        self.dst.fill(0)
        self._src_addr, self._dst_addr = int(self.src.ctypes.data), int(self.dst.ctypes.data)
        try:
            for addr in (self._src_addr, self._dst_addr):
                _check(self._store.register_buffer(addr, buffer_bytes), "register_buffer")
                self._registered.append(addr)
        except BaseException:
            self.close()
            raise

    def _config(self, replicas: int) -> _ReplicateConfig:
        if replicas not in self._configs:
            config = self._new_config()
            config.replica_num = replicas
            self._configs[replicas] = config
        return self._configs[replicas]

    def _live(self) -> None:
        if self._closed:
            raise ClosedError("MooncakeStoreAdapter is closed")

    def _span(self, offset: int, size: int) -> None:
        self._live()
        if offset < 0 or size <= 0 or offset + size > self.buffer_bytes:
            raise OutOfBounds(f"[{offset}, {offset}+{size}) outside the {self.buffer_bytes}-byte buffer")

    def put_from(self, key: str, offset: int, size: int, replicas: int) -> None:
        """Store `src[offset:offset+size]` under `key` with `replicas` copies. Raises RuntimeError."""
        self._span(offset, size)
        rc = self._store.put_from(key, self._src_addr + offset, size, self._config(replicas))
        _check(rc, f"put_from({key!r}, {size} B, replicas={replicas})")

    def batch_put_from(self, keys: list[str], offsets: list[int], size: int, replicas: int) -> None:
        """Store `src[offsets[i]:offsets[i]+size]` under `keys[i]`. Raises RuntimeError on any failure."""
        for offset in offsets:
            self._span(offset, size)
        ptrs = [self._src_addr + offset for offset in offsets]
        rcs = self._store.batch_put_from(keys, ptrs, [size] * len(keys), self._config(replicas))
        for key, rc in zip(keys, rcs, strict=True):
            _check(rc, f"batch_put_from: {key!r} ({size} B, replicas={replicas})")

    def get_into(self, key: str, offset: int, size: int) -> int:
        """Read `key` into `dst[offset:offset+size]`; returns bytes read. Raises RuntimeError."""
        self._span(offset, size)
        nbytes = self._store.get_into(key, self._dst_addr + offset, size)
        _check(min(nbytes, 0), f"get_into({key!r}, {size} B)")
        return nbytes

    def batch_get_into(self, keys: list[str], offsets: list[int], size: int) -> list[int]:
        """Read `keys[i]` into `dst[offsets[i]:...]`; returns bytes read per key. Raises RuntimeError."""
        for offset in offsets:
            self._span(offset, size)
        ptrs = [self._dst_addr + offset for offset in offsets]
        results = self._store.batch_get_into(keys, ptrs, [size] * len(keys))
        for key, nbytes in zip(keys, results, strict=True):
            _check(min(nbytes, 0), f"batch_get_into: {key!r} ({size} B)")
        return list(results)

    def exists(self, key: str) -> bool:
        """Whether `key` is stored. Raises RuntimeError on an error code."""
        self._live()
        rc = self._store.is_exist(key)
        _check(min(rc, 0), f"is_exist({key!r})")
        return rc == 1

    def num_replicas(self, key: str) -> int:
        """How many replicas the master lists for `key` (0 when absent)."""
        self._live()
        return len(self._store.get_replica_desc(key))

    def remove(self, key: str) -> None:
        """Remove `key` (force=True: ignores leases). Raises RuntimeError, also when it is absent."""
        self._live()
        _check(self._store.remove(key, True), f"remove({key!r})")

    def remove_all(self) -> None:
        """Remove every object (force=True). Raises RuntimeError."""
        self._live()
        _check(min(self._store.remove_all(True), 0), "remove_all")

    def close(self) -> None:
        """Unregister the buffers and close the store. Idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for addr in self._registered:
            rc = self._store.unregister_buffer(addr)
            if rc != 0:
                logger.warning("unregister_buffer(%#x) returned %d", addr, rc)
        self._registered = []
        rc = self._store.close()
        if rc != 0:
            logger.warning("MooncakeDistributedStore.close() returned %d", rc)

    def __enter__(self) -> MooncakeStoreAdapter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"mooncake store {what} returned {rc}")


# ---- process side ----------------------------------------------------------------------


def _protocol_stream() -> IO[str]:
    """A private duplicate of stdout; fd 1 then points at stderr (C++ prints go there)."""
    stream = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return stream


def _holder(master_addr: str, hostname: str, segment_bytes: int) -> int:
    """Holder main: mount `segment_bytes` into the cluster, then wait for stdin to close."""
    proto = _protocol_stream()
    store, _ = _new_store()
    rc = store.setup(hostname, _METADATA, segment_bytes, LOCAL_BUFFER_BYTES, "tcp", "", master_addr)
    if rc != 0:
        child_reply({"ok": False, "error": f"setup({hostname}) returned {rc}"}, out=proto)
        return 1
    child_reply({"hostname": hostname}, out=proto)
    for _line in sys.stdin:  # no commands: EOF is the signal to exit
        child_reply({"ok": False, "error": "holders take no commands"}, out=proto)
    # NOTE: store.close() takes 1-2 s (background threads wind down), about JsonWorker's exit
    # grace; bound it and leave without interpreter teardown, which could meet those threads.
    closer = threading.Thread(target=store.close, name="mooncake-close", daemon=True)
    closer.start()
    closer.join(_HOLDER_CLOSE_TIMEOUT_S)
    if closer.is_alive():
        logger.warning("store.close() still running after %.1f s; exiting anyway", _HOLDER_CLOSE_TIMEOUT_S)
    proto.flush()
    sys.stderr.flush()
    os._exit(0)


def _check_roundtrip(adapter: MooncakeStoreAdapter, size: int, replicas: int, rng: np.random.Generator) -> None:
    """Put one value and a batch of four, read them back, compare bytes, remove them."""
    key = f"selftest-{size}-{replicas}"
    adapter.src[:size] = rng.integers(0, 256, size, dtype=np.uint8)
    adapter.put_from(key, 0, size, replicas)
    if not adapter.exists(key) or adapter.num_replicas(key) != replicas:
        raise RuntimeError(f"{key}: exists={adapter.exists(key)}, replicas={adapter.num_replicas(key)}")
    if adapter.get_into(key, size, size) != size or not np.array_equal(
        adapter.dst[size : 2 * size], adapter.src[:size]
    ):
        raise RuntimeError(f"{key}: bytes read back differ")
    adapter.remove(key)
    if adapter.exists(key):
        raise RuntimeError(f"{key}: still there after remove")
    keys, offsets = [f"{key}-{i}" for i in range(4)], [i * size for i in range(4)]
    adapter.src[: 4 * size] = rng.integers(0, 256, 4 * size, dtype=np.uint8)
    adapter.batch_put_from(keys, offsets, size, replicas)
    if adapter.batch_get_into(keys, offsets, size) != [size] * 4:
        raise RuntimeError(f"{key}: batch_get_into short read")
    if not np.array_equal(adapter.dst[: 4 * size], adapter.src[: 4 * size]):
        raise RuntimeError(f"{key}: batch bytes read back differ")
    adapter.remove_all()


def _time_ops(adapter: MooncakeStoreAdapter, size: int, replicas: int, num_ops: int) -> tuple[float, float]:
    """Mean seconds per put_from and per get_into of `size` bytes over `num_ops` fresh keys."""
    clock = WallClock()
    put_s = get_s = 0.0
    for i in range(num_ops + 10):  # the first 10 are warm-up
        key = f"timed-{replicas}-{i}"
        start = clock.now()
        adapter.put_from(key, 0, size, replicas)
        mid = clock.now()
        adapter.get_into(key, 0, size)
        if i >= 10:
            put_s, get_s = put_s + mid - start, get_s + clock.now() - mid
    adapter.remove_all()
    return put_s / num_ops, get_s / num_ops


def _selftest(num_ops: int) -> None:
    out = _protocol_stream()
    rng = np.random.default_rng(0)
    with MooncakeCluster(256 * MIB) as cluster, MooncakeStoreAdapter(cluster.master_addr, 16 * MIB) as adapter:
        for replicas in (1, 2):
            for size in (MIB, 4 << 10):
                _check_roundtrip(adapter, size, replicas, rng)
                out.write(f"ok: {size} B x replicas={replicas} (single and batch of 4, bytes verified)\n")
        for replicas in (1, 2):
            put_s, get_s = _time_ops(adapter, MIB, replicas, num_ops)
            out.write(
                f"1 MiB replicas={replicas}: put_from {put_s * 1e6:.0f} us, get_into {get_s * 1e6:.0f} us, "
                f"put+get {(put_s + get_s) * 1e6:.0f} us per op ({num_ops} ops)\n"
            )


def main(argv: list[str] | None = None) -> int:
    """`selftest [--num-ops N]`, or `holder MASTER_ADDR HOSTNAME SEGMENT_BYTES` (internal)."""
    parser = argparse.ArgumentParser(prog="python -m tsukimi.bench.mooncake_store")
    sub = parser.add_subparsers(dest="command", required=True)
    selftest = sub.add_parser("selftest", help="start a cluster, check round trips, time 1 MiB ops")
    selftest.add_argument("--num-ops", type=int, default=100)
    holder = sub.add_parser("holder", help="internal: run one holder process")
    holder.add_argument("master_addr")
    holder.add_argument("hostname")
    holder.add_argument("segment_bytes", type=int)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.command == "selftest" else logging.WARNING)
    if args.command == "holder":
        return _holder(args.master_addr, args.hostname, args.segment_bytes)
    if not mooncake_store_available():
        print("mooncake.store or mooncake_master is not installed", file=sys.stderr)
        return 1
    _selftest(args.num_ops)
    return 0


if __name__ == "__main__":
    sys.exit(main())
