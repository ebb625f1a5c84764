"""The store's deployment shapes, for the store semantics suite (`store_checks`) and any test
that wants a store: "inprocess" (a MasterServer and two holder StoreClients in this process)
and "multiprocess" (`tsukimi master` and two `tsukimi holder` processes on loopback, see
`cluster`). Both give a master with short timeouts (MASTER), two holders of HOLDER_BYTES
each, and a factory of clients; `lend` shares one running deployment among checks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace

import httpx

from tsukimi.config import ClientConfig, Config, MasterConfig
from tsukimi.errors import ConfigError
from tsukimi.store.client import StoreClient
from tsukimi.store.master.server import MasterServer
from tsukimi.testing.cluster import TsukimiCluster
from tsukimi.testing.processes import free_port, wait_until

DEPLOYMENT_KINDS = ("inprocess", "multiprocess")
HOLDER_BYTES = 4 << 20
MASTER = MasterConfig(
    rpc_port=0, http_port=0, lease_ttl_s=1.0, client_ttl_s=2.0, heartbeat_interval_s=0.5, put_timeout_s=1.0,
    write_grace_s=0.5, tick_interval_s=0.05,
)  # fmt: skip
CLIENT_SETTINGS = ("client.heartbeat_interval_s=0.5",)
MASTER_SETTINGS = ["lease_ttl_s=1.0", "client_ttl_s=2.0", "heartbeat_interval_s=0.5", "put_timeout_s=1.0",
                   "write_grace_s=0.5", "tick_interval_s=0.05"]  # fmt: skip


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

    def client(self, segment_bytes: int = 0, **client_cfg: object) -> StoreClient:
        """A new client of this store (mounting `segment_bytes`; `client_cfg`: more
        ClientConfig fields), closed when the deployment is."""
        cfg = ClientConfig(master=self.endpoint, segment_bytes=segment_bytes, heartbeat_interval_s=0.5, **client_cfg)  # type: ignore[arg-type]
        client = StoreClient(replace(Config(), client=cfg))
        self.clients.append(client)
        return client

    def segments(self) -> list[dict[str, object]]:
        """The master's `/segments` listing (name, size, used...)."""
        return httpx.get(self.http_url + "/segments", timeout=5).json()  # type: ignore[no-any-return]

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
    deployment for a whole suite, since a multi-process one takes seconds to start."""

    @contextlib.contextmanager
    def borrowed() -> Iterator[Deployment]:
        yield dep

    return borrowed
