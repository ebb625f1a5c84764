"""Store deployments for the semantics suite: in-process, and real processes (`tsukimi
master`, `tsukimi holder`) on loopback. Both give a master, two holders of HOLDER_BYTES each,
and a factory of clients."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import httpx

from tsukimi.config import ClientConfig, Config, MasterConfig
from tsukimi.store.client import StoreClient
from tsukimi.store.master.server import MasterServer
from tsukimi.testing.cluster import TsukimiCluster
from tsukimi.testing.processes import free_port, wait_until

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
        cfg = ClientConfig(master=self.endpoint, segment_bytes=segment_bytes, heartbeat_interval_s=0.5, **client_cfg)  # type: ignore[arg-type]
        client = StoreClient(replace(Config(), client=cfg))
        self.clients.append(client)
        return client

    def segments(self) -> list[dict[str, object]]:
        return httpx.get(self.http_url + "/segments", timeout=5).json()  # type: ignore[no-any-return]

    def kill_holder(self, index: int) -> None:
        """SIGKILL a holder process (multi-process deployments only)."""
        assert self.cluster is not None, "faults need real processes"
        self.cluster.kill_holder(index)

    def restart_master(self) -> None:
        if self.cluster is not None:
            self.cluster.restart_master()
        else:
            assert self.master is not None
            self.master.close()
            self.master = MasterServer(replace(MASTER, rpc_port=self.rpc_port, http_port=self.http_port))

    def close(self) -> None:
        for client in self.clients + self.holders:
            client.close()
        if self.cluster is not None:
            self.cluster.close()
        if self.master is not None:
            self.master.close()


def start(kind: str) -> Deployment:
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
