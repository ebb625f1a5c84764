"""The real Mooncake Store's processes, as a baseline: `mooncake_master` and holder processes.

Owns `MooncakeCluster` (one `mooncake_master` plus `num_holders` holder processes, each a
`MooncakeDistributedStore` that mounts `holder_bytes` of memory into the cluster and does
nothing else), the holder process itself (`python -m tsukimi.bench.child mooncake-holder holder`),
and how a store object is made (`new_store`). The client side is bench/mooncake_store.py.

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
import os
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Protocol, cast

from tsukimi.bench.child import module_args
from tsukimi.bench.mooncake_te import MOONCAKE_ENV
from tsukimi.clock import WallClock
from tsukimi.errors import ConfigError
from tsukimi.netio import free_port
from tsukimi.testing.processes import JsonWorker, WorkerError, child_reply

logger = logging.getLogger(__name__)

MIB = 1 << 20
LOCAL_BUFFER_BYTES = 16 * MIB  # each store's own staging buffer (setup's local_buffer_size)
_HOST = "127.0.0.1"
METADATA = "P2PHANDSHAKE"
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


def unique_hostname() -> str:
    return f"{_HOST}:{free_port(_HOST)}"


class ReplicateConfigLike(Protocol):
    """`mooncake.store.ReplicateConfig`: only the replica count is set."""

    replica_num: int


class StoreLike(Protocol):
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
    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfigLike) -> int: ...
    def batch_put_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], config: ReplicateConfigLike
    ) -> list[int]: ...
    def get_into(self, key: str, buffer_ptr: int, size: int) -> int: ...
    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]: ...
    def is_exist(self, key: str, /) -> int: ...
    def get_replica_desc(self, key: str) -> list[object]: ...
    def remove(self, key: str, force: bool) -> int: ...
    def remove_all(self, force: bool) -> int: ...
    def close(self) -> int: ...


def new_store() -> tuple[StoreLike, Callable[[], ReplicateConfigLike]]:
    """A fresh store object and the `ReplicateConfig` constructor."""
    for name, value in MOONCAKE_ENV.items():
        os.environ.setdefault(name, value)  # NOTE: read by the C++ engine during setup().
    module = importlib.import_module("mooncake.store")
    return cast(StoreLike, module.MooncakeDistributedStore()), module.ReplicateConfig


def _stderr_tail(stream: IO[bytes]) -> str:
    stream.seek(0, os.SEEK_END)
    stream.seek(max(0, stream.tell() - _STDERR_TAIL_BYTES))
    return stream.read().decode(errors="replace").strip()


class MooncakeCluster:
    """A running `mooncake_master` and `num_holders` holder processes on 127.0.0.1.

    Args:
        holder_bytes: memory each holder mounts into the cluster (global_segment_size).
        num_holders: how many holder processes (replica_num can be at most this).
        offload_dir: SSD offload on eviction into this directory (master flags
            `--enable_offload --offload_on_evict --root_fs_dir`, holders set up with
            `enable_ssd_offload`, the environment test_promotion_on_hit.py asks for); "": none.

    Raises:
        ConfigError: bad sizes or counts, or the master binary is missing.
        RuntimeError: the master did not start (its stderr is quoted); WorkerError (a
            RuntimeError) when a holder did not.
    """

    def __init__(self, holder_bytes: int, num_holders: int = 2, offload_dir: str = "") -> None:
        if holder_bytes <= 0 or num_holders <= 0:
            raise ConfigError(f"need holder_bytes > 0 and num_holders > 0, got {holder_bytes}, {num_holders}")
        if not master_binary().is_file():
            raise ConfigError(f"mooncake_master not found at {master_binary()}")
        self.holder_bytes = holder_bytes
        self.offload_dir = offload_dir
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
        if self.offload_dir:
            args += ["--enable_offload=true", "--offload_on_evict=true", f"--root_fs_dir={self.offload_dir}"]
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
        hostname = unique_hostname()
        args = module_args("mooncake-holder", "holder", self.master_addr, hostname, str(self.holder_bytes))
        env = {**MOONCAKE_ENV, **offload_env(self.offload_dir)} if self.offload_dir else MOONCAKE_ENV
        worker = JsonWorker(
            f"mooncake holder {index}",
            [*args, *(["--offload"] if self.offload_dir else [])],
            _HOLDER_STARTUP_TIMEOUT_S,
            env=env,
        )
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


# ---- process side ----------------------------------------------------------------------


def protocol_stream() -> IO[str]:
    """A private duplicate of stdout; fd 1 then points at stderr (C++ prints go there)."""
    stream = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return stream


def offload_env(directory: str) -> dict[str, str]:
    """The client environment of Mooncake's SSD offload into `directory`."""
    return {
        "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": directory,
        "MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT": "10",
        "MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES": str(10 << 20),
    }


def _holder(master_addr: str, hostname: str, segment_bytes: int, offload: bool) -> int:
    """Holder main: mount `segment_bytes` into the cluster, then wait for stdin to close."""
    proto = protocol_stream()
    store, _ = new_store()
    setup = cast(Callable[..., int], store.setup)
    rc = setup(hostname, METADATA, segment_bytes, LOCAL_BUFFER_BYTES, "tcp", "", master_addr, None, offload)
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


def main(argv: list[str] | None = None) -> int:
    """`holder MASTER_ADDR HOSTNAME SEGMENT_BYTES`: run one holder process (internal)."""
    parser = argparse.ArgumentParser(prog="python -m tsukimi.bench.child mooncake-holder")
    sub = parser.add_subparsers(dest="command", required=True)
    holder = sub.add_parser("holder", help="internal: run one holder process")
    holder.add_argument("master_addr")
    holder.add_argument("hostname")
    holder.add_argument("segment_bytes", type=int)
    holder.add_argument("--offload", action="store_true", help="setup(..., enable_ssd_offload=True)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    return _holder(args.master_addr, args.hostname, args.segment_bytes, args.offload)
