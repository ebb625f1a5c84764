"""A real single-node etcd for tests: `run_etcd(tmp_path)` starts it on ephemeral loopback ports.

The `etcd` binary must be on PATH (`make` installs Debian's etcd-server); its absence is an
error, not a skip, so that the etcd backend is never silently untested. Test modules define
their own fixture around it:

    @pytest.fixture
    def etcd(tmp_path):
        with run_etcd(tmp_path) as proc:
            yield proc
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tsukimi.netio import free_port

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
_NUM_START_ATTEMPTS = 3


class EtcdNotInstalled(RuntimeError):
    """The `etcd` binary is missing: install it (`make` does, via apt's etcd-server)."""


@dataclass
class EtcdProcess:
    """A running etcd started by `run_etcd`."""

    process: subprocess.Popen[bytes]
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path

    @property
    def url(self) -> str:
        """The `metadata.url` form, `etcd://127.0.0.1:PORT`."""
        return f"etcd://{HOST}:{self.client_port}"

    @property
    def http_url(self) -> str:
        """The client URL etcd itself serves, `http://127.0.0.1:PORT`."""
        return f"http://{HOST}:{self.client_port}"

    def log_tail(self, num_bytes: int = 4000) -> str:
        """The end of etcd's log, for error messages."""
        try:
            return self.log_path.read_bytes()[-num_bytes:].decode(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL etcd and reap it (for fault-injection tests); idempotent."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`; always reaps the process."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                logger.warning("etcd pid %d ignored SIGTERM; killing", self.process.pid)
        self.kill()


def _etcd_binary() -> str:
    path = shutil.which("etcd")
    if path is None:
        raise EtcdNotInstalled("the etcd binary is not on PATH; install it (apt-get install etcd-server, or `make`)")
    return path


def _spawn(binary: str, tmp_path: Path, attempt: int) -> EtcdProcess:
    client_port, peer_port = free_port(HOST), free_port(HOST)
    while peer_port == client_port:
        peer_port = free_port(HOST)
    data_dir = tmp_path / f"etcd-data-{attempt}"
    log_path = tmp_path / f"etcd-{attempt}.log"
    client, peer = f"http://{HOST}:{client_port}", f"http://{HOST}:{peer_port}"
    argv = [
        binary,
        "--name=tsukimi-test",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=tsukimi-test={peer}",
        "--initial-cluster-state=new",
        "--logger=zap",
        "--log-outputs=stderr",
        "--log-level=warn",
    ]
    # NOTE: ETCD_* variables are read as flags by etcd; an inherited one could break the test.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    return EtcdProcess(process, client_port, peer_port, data_dir, log_path)


def _wait_healthy(proc: EtcdProcess, deadline: float) -> bool:
    """True once /health says so; False if etcd exited (e.g. a port clash) or time ran out."""
    with httpx.Client(timeout=1.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if proc.process.poll() is not None:
                return False
            try:
                response = client.get(f"{proc.http_url}/health")
                if response.status_code == 200 and response.json().get("health") == "true":
                    return True
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.05)
    return False


def _start(binary: str, tmp_path: Path, startup_timeout_s: float) -> EtcdProcess:
    deadline = time.monotonic() + startup_timeout_s
    tail = ""
    for attempt in range(_NUM_START_ATTEMPTS):
        proc = _spawn(binary, tmp_path, attempt)
        if _wait_healthy(proc, deadline):
            return proc
        proc.stop()
        tail = proc.log_tail()
        if time.monotonic() >= deadline:
            break
        logger.warning("etcd attempt %d exited during startup; retrying on new ports", attempt)
    raise RuntimeError(f"etcd did not become healthy within {startup_timeout_s} s; log tail:\n{tail}")


@contextlib.contextmanager
def run_etcd(tmp_path: Path, startup_timeout_s: float = 15.0) -> Iterator[EtcdProcess]:
    """Start etcd with its data under `tmp_path`, yield it healthy, stop and reap it on exit.

    Raises:
        EtcdNotInstalled: no `etcd` on PATH.
        RuntimeError: etcd did not become healthy within `startup_timeout_s` (log tail included).
    """
    proc = _start(_etcd_binary(), tmp_path, startup_timeout_s)
    try:
        yield proc
    finally:
        proc.stop()
