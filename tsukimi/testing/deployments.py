"""The store, deployed for tests and benchmarks.

`TsukimiCluster`: `tsukimi master` and holders (`tsukimi holder`) in real processes on
loopback, each a `python -m tsukimi.cli` child started by the cluster launcher
(tsukimi/serving/cluster/launcher.py, as `tsukimi up` starts its own), for anything that wants
a store it can SIGKILL parts of (`tsukimi bench store` too).

`Deployment`: the shapes the store semantics suite (`store_checks`) runs on, "inprocess" (a
MasterServer and two holder StoreClients in this process) and "multiprocess" (a
TsukimiCluster). Both give a master with short timeouts (MASTER), two holders of HOLDER_BYTES
each, and a factory of clients; `lend` shares one running deployment among checks.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from tsukimi.config import ClientConfig, Config, MasterConfig
from tsukimi.errors import ConfigError, PeerError
from tsukimi.netio import free_port
from tsukimi.serving.cluster.launcher import LaunchConfig, LaunchedCluster
from tsukimi.serving.cluster.process_spec import ProcessSpec
from tsukimi.store.client import StoreClient
from tsukimi.store.master.server import MasterServer
from tsukimi.testing.processes import wait_until

_STARTUP_S = 30.0
_ANNOUNCED = re.compile(r"^holder (\S+):", re.MULTILINE)
DEPLOYMENT_KINDS = ("inprocess", "multiprocess")
HOLDER_BYTES = 4 << 20
MASTER = MasterConfig(
    rpc_port=0,
    http_port=0,
    lease_ttl_s=1.0,
    client_ttl_s=2.0,
    heartbeat_interval_s=0.5,
    put_timeout_s=1.0,
    write_grace_s=0.5,
    tick_interval_s=0.05,
)
CLIENT_SETTINGS = ("client.heartbeat_interval_s=0.5",)
MASTER_SETTINGS = [
    "lease_ttl_s=1.0",
    "client_ttl_s=2.0",
    "heartbeat_interval_s=0.5",
    "put_timeout_s=1.0",
    "write_grace_s=0.5",
    "tick_interval_s=0.05",
]


class TsukimiCluster:
    """A master and `num_holders` holders of `holder_bytes` each, launched as `tsukimi up`
    launches its processes (tsukimi/serving/cluster/launcher.py), logging under a temporary
    directory. `master_addr` is the RPC endpoint; `settings` are extra `--set` overrides for
    every process (e.g. force tcp); `disk_dir`: each holder gets a disk of `disk_bytes` in its
    own directory under it."""

    def __init__(
        self,
        holder_bytes: int,
        num_holders: int = 2,
        settings: tuple[str, ...] = (),
        disk_dir: str = "",
        disk_bytes: int = 1 << 30,
    ) -> None:
        self.rpc_port, self.http_port = free_port(), free_port()
        self.master_addr = f"tcp://127.0.0.1:{self.rpc_port}"
        self.http_url = f"http://127.0.0.1:{self.http_port}"
        self.settings = settings
        self.holder_names: list[str] = []
        self._logs = tempfile.TemporaryDirectory(prefix="tsukimi-store-")
        self._cluster = LaunchedCluster(
            _store_plan(self, holder_bytes, num_holders, disk_dir, disk_bytes),
            LaunchConfig(Path(self._logs.name), startup_timeout_s=_STARTUP_S),
        )
        try:
            self._cluster.start()
            self.holder_names = [self._announced_name(f"holder-{i}") for i in range(num_holders)]
            wait_until(lambda: len(httpx.get(self.http_url + "/segments", timeout=1).json()) == num_holders)
        except BaseException:
            self.close()
            raise

    @property
    def master(self) -> subprocess.Popen[bytes]:
        """The master's current process (fault tests may SIGKILL it)."""
        return self._cluster.supervisor.children[0].proc

    def restart_master(self) -> None:
        """SIGTERM the master and start a new one on the same ports (its state is lost)."""
        self._cluster.restart("master")

    def kill_holder(self, index: int) -> None:
        """SIGKILL holder `index` (0-based, in start order)."""
        self._cluster.kill(f"holder-{index}")

    def _announced_name(self, name: str) -> str:
        """A holder prints "holder NAME: ..." once its segment is mounted (in its log).

        Raises:
            PeerError: it exited or said nothing of the kind within the startup time.
        """
        log = self._cluster.process(name).log
        found: list[str] = []

        def announced() -> bool:
            self._cluster.supervisor.check_alive()
            found.extend(m.group(1) for m in _ANNOUNCED.finditer(log.read_text(errors="replace")))
            return bool(found)

        try:
            wait_until(announced, _STARTUP_S)
        except PeerError as exc:
            raise PeerError(f"{name} did not start: {exc}; see {log}") from exc
        return found[0]

    def wait_drained(self, timeout_s: float = 10.0) -> None:
        """Wait until no segment holds any block (removed objects' leases have ended)."""
        segments = self.http_url + "/segments"
        wait_until(lambda: not any(int(s["used"]) for s in httpx.get(segments, timeout=5).json()), timeout_s)

    def close(self) -> None:
        """Stop the holders (they unmount while the master still answers), then the master;
        SIGTERM, then SIGKILL; idempotent."""
        self._cluster.stop()
        self._logs.cleanup()

    def __enter__(self) -> TsukimiCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _store_plan(
    cluster: TsukimiCluster, holder_bytes: int, num_holders: int, disk_dir: str, disk_bytes: int
) -> list[list[ProcessSpec]]:
    """The master, then the holders (a group of their own: they need the master), as
    ProcessSpecs (pure). NOTE: COLUMNS keeps the holder's announcement on one line."""
    env = (("COLUMNS", "200"),)
    sets = tuple(f"--set={s}" for s in cluster.settings)
    ports = (f"--set=master.rpc_port={cluster.rpc_port}", f"--set=master.http_port={cluster.http_port}")
    groups = [[ProcessSpec("master", "master", ("master", *ports, *sets), cluster.http_url, env=env)]]
    holders = []
    for i in range(num_holders):
        disk = (f"--set=client.ssd_dir={disk_dir}/holder-{i}", f"--set=client.ssd_bytes={disk_bytes}")
        args = ("holder", "--master", cluster.master_addr, "--segment-bytes", str(holder_bytes))
        holders.append(
            ProcessSpec(
                f"holder-{i}", "holder", (*args, *(disk if disk_dir else ()), *sets), "", env=env, health="none"
            )
        )
    return groups + ([holders] if holders else [])


@dataclass
class Deployment:
    """A running store: its master's RPC `endpoint` and `http_url`, its holders' Transfer
    Engine segment names, and the clients made through `client()` (closed with it)."""

    kind: str
    endpoint: str = ""
    http_url: str = ""
    master: MasterServer | None = None  # in-process
    cluster: TsukimiCluster | None = None  # real processes
    holders: list[StoreClient] = field(default_factory=list)  # in-process
    clients: list[StoreClient] = field(default_factory=list)
    rpc_port: int = 0
    http_port: int = 0
    holder_names: list[str] = field(default_factory=list)  # each holder's Transfer Engine segment
    transfer_host: str = ""  # where clients serve their segments ("": transfer.bind_host's default)

    def client(self, segment_bytes: int = 0, **client_cfg: object) -> StoreClient:
        """A new client of this store (mounting `segment_bytes`; `client_cfg`: more
        ClientConfig fields), closed when the deployment is."""
        cfg = ClientConfig(master=self.endpoint, segment_bytes=segment_bytes, heartbeat_interval_s=0.5, **client_cfg)  # type: ignore[arg-type]
        client = StoreClient.connect(self.endpoint, segment_bytes, replace(Config(), client=cfg), self.transfer_host)
        self.clients.append(client)
        return client

    def segments(self) -> list[dict[str, object]]:
        """The master's `/segments` listing (name, size, used...)."""
        return httpx.get(self.http_url + "/segments", timeout=5).json()  # type: ignore[no-any-return]

    def copies(self, key: str) -> tuple[int, int]:
        """(memory replicas, disk copies) of `key` by the master's /query_key; (0, 0) if absent."""
        reply = httpx.get(self.http_url + "/query_key", params={"key": key}, timeout=5)
        if reply.status_code == 404:
            return 0, 0
        info = reply.json()
        return len(info["replicas"]), len(info["disk_replicas"])

    def kill_holder(self, index: int) -> None:
        """SIGKILL a holder process (multi-process deployments only)."""
        assert self.cluster is not None, "faults need real processes"
        self.cluster.kill_holder(index)

    def restart_master(self) -> None:
        """Stop the master and start a new one on the same ports (its state is lost)."""
        if self.cluster is not None:
            self.cluster.restart_master()
        else:
            assert self.master is not None
            self.master.close()
            self.master = MasterServer(replace(MASTER, rpc_port=self.rpc_port, http_port=self.http_port))

    def close(self) -> None:
        """Close every client and holder, then the master (or the processes)."""
        for client in self.clients + self.holders:
            client.close()
        if self.cluster is not None:
            self.cluster.close()
        if self.master is not None:
            self.master.close()

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


DeploymentMaker = Callable[[], AbstractContextManager[Deployment]]
"""What a store check is given: each call gives a running deployment for one `with` block."""


def start_deployment(kind: str) -> Deployment:
    """Start a deployment of shape `kind` (one of DEPLOYMENT_KINDS); close() it when done.

    Raises:
        ConfigError: an unknown kind. PeerError: it did not come up in time.
    """
    if kind not in DEPLOYMENT_KINDS:
        raise ConfigError(f"deployment kind must be one of {', '.join(DEPLOYMENT_KINDS)}, got {kind!r}")
    if kind == "multiprocess":
        settings = tuple(f"master.{s}" for s in MASTER_SETTINGS) + CLIENT_SETTINGS
        cluster = TsukimiCluster(HOLDER_BYTES, settings=settings)
        return Deployment(
            kind, cluster.master_addr, cluster.http_url, cluster=cluster, holder_names=cluster.holder_names
        )
    dep = Deployment(kind, rpc_port=free_port(), http_port=free_port())
    dep.endpoint = f"tcp://127.0.0.1:{dep.rpc_port}"
    dep.http_url = f"http://127.0.0.1:{dep.http_port}"
    try:
        dep.master = MasterServer(replace(MASTER, rpc_port=dep.rpc_port, http_port=dep.http_port))
        dep.holders = [dep.client(HOLDER_BYTES) for _ in range(2)]
        dep.holder_names = [h.engine.name for h in dep.holders]
        dep.clients.clear()
        wait_until(lambda: len(dep.segments()) == 2)
    except BaseException:
        dep.close()
        raise
    return dep


def deployment_maker(kind: str) -> DeploymentMaker:
    """A DeploymentMaker that starts a fresh deployment of `kind` for every check."""
    return lambda: start_deployment(kind)


def lend(dep: Deployment) -> DeploymentMaker:
    """A DeploymentMaker that lends the running `dep` (it stays open after each check): one
    deployment for a whole suite, since a multi-process one takes seconds to start. Clients a
    check made with `dep.client` are closed when it ends, so no extra holder outlives its
    check (one did, and took replicas the next check expected on the deployment's holders)."""

    @contextlib.contextmanager
    def borrowed() -> Iterator[Deployment]:
        before = len(dep.clients)
        try:
            yield dep
        finally:
            for client in dep.clients[before:]:
                client.close()
            del dep.clients[before:]

    return borrowed


@contextlib.contextmanager
def fresh_client(dep: Deployment) -> Iterator[StoreClient]:
    """A fresh client of `dep`; everything in the store is removed (force) after."""
    client = dep.client()
    try:
        yield client
    finally:
        client.remove_all(force=True)
