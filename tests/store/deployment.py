"""Store deployments for the semantics suite: in-process, and real processes (`tsukimi
master`, `tsukimi holder`) on loopback. Both give a master, two holders of HOLDER_BYTES each,
and a factory of clients."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace

import httpx

from tests.etcd_server import free_port
from tsukimi.config import ClientConfig, Config, MasterConfig
from tsukimi.store.client import StoreClient
from tsukimi.store.master.server import MasterServer

HOLDER_BYTES = 4 << 20
MASTER = MasterConfig(
    rpc_port=0, http_port=0, lease_ttl_s=0.5, client_ttl_s=1.5, heartbeat_interval_s=0.3, put_timeout_s=1.0,
    tick_interval_s=0.05,
)  # fmt: skip
MASTER_SETTINGS = ["lease_ttl_s=0.5", "client_ttl_s=1.5", "heartbeat_interval_s=0.3", "put_timeout_s=1.0",
                   "tick_interval_s=0.05"]  # fmt: skip


@dataclass
class Deployment:
    kind: str
    endpoint: str = ""
    http_url: str = ""
    master: MasterServer | None = None
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    holders: list[StoreClient | subprocess.Popen[bytes]] = field(default_factory=list)
    clients: list[StoreClient] = field(default_factory=list)
    rpc_port: int = 0
    http_port: int = 0
    holder_names: list[str] = field(default_factory=list)  # each holder's Transfer Engine segment

    def client(self, segment_bytes: int = 0, **client_cfg: object) -> StoreClient:
        cfg = ClientConfig(master=self.endpoint, segment_bytes=segment_bytes, heartbeat_interval_s=0.3, **client_cfg)  # type: ignore[arg-type]
        client = StoreClient(replace(Config(), client=cfg))
        self.clients.append(client)
        return client

    def segments(self) -> list[dict[str, object]]:
        return httpx.get(self.http_url + "/segments", timeout=5).json()  # type: ignore[no-any-return]

    def kill_holder(self, index: int) -> None:
        """SIGKILL (processes) or abandon without unmounting (in-process) one holder."""
        holder = self.holders[index]
        if isinstance(holder, subprocess.Popen):
            holder.kill()
            holder.wait(timeout=5)
        else:
            holder._stop.set()  # stops heartbeats; its memory stays mapped, like a hung host
            holder._mounts.clear()

    def restart_master(self) -> None:
        if self.master is not None:
            self.master.close()
            self.master = MasterServer(replace(MASTER, rpc_port=self.rpc_port, http_port=self.http_port))
        else:
            master = self.procs.pop(0)
            master.send_signal(signal.SIGTERM)
            master.wait(timeout=10)
            self.procs.insert(0, self._spawn_master())
            _wait_for(lambda: httpx.get(self.http_url + "/health", timeout=1).status_code == 200)

    def _spawn_master(self) -> subprocess.Popen[bytes]:
        sets = [f"--set=master.rpc_port={self.rpc_port}", f"--set=master.http_port={self.http_port}"]
        sets += [f"--set=master.{s}" for s in MASTER_SETTINGS]
        return subprocess.Popen([sys.executable, "-m", "tsukimi.cli", "master", *sets],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip

    def close(self) -> None:
        for client in self.clients + [h for h in self.holders if isinstance(h, StoreClient)]:
            client.close()
        for proc in [h for h in self.holders if isinstance(h, subprocess.Popen)] + self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
        if self.master is not None:
            self.master.close()


def start(kind: str) -> Deployment:
    dep = Deployment(kind, rpc_port=free_port(), http_port=free_port())
    dep.endpoint = f"tcp://127.0.0.1:{dep.rpc_port}"
    dep.http_url = f"http://127.0.0.1:{dep.http_port}"
    try:
        if kind == "inprocess":
            dep.master = MasterServer(replace(MASTER, rpc_port=dep.rpc_port, http_port=dep.http_port))
            dep.holders = [dep.client(HOLDER_BYTES) for _ in range(2)]
            dep.holder_names = [h.engine.name for h in dep.holders]  # type: ignore[union-attr]
            dep.clients.clear()
        else:
            dep.procs.append(dep._spawn_master())
            _wait_for(lambda: httpx.get(dep.http_url + "/health", timeout=1).status_code == 200)
            for _ in range(2):
                cmd = [sys.executable, "-m", "tsukimi.cli", "holder", "--master", dep.endpoint,
                       "--segment-bytes", str(HOLDER_BYTES), "--set=client.heartbeat_interval_s=0.3"]  # fmt: skip
                env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
                dep.holders.append(proc)
                dep.holder_names.append(_read_holder_name(proc))
        _wait_for(lambda: len(dep.segments()) == 2)
    except BaseException:
        dep.close()
        raise
    return dep


def _read_holder_name(proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> str:
    """The holder prints "holder NAME: ..." once it has mounted its segment."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if not ready:
        raise TimeoutError("holder did not start")
    line = proc.stdout.readline().decode()
    assert line.startswith("holder "), line
    return line.split()[1].rstrip(":")


def _wait_for(condition: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if condition():  # type: ignore[operator]
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("deployment did not come up")
        time.sleep(0.05)
