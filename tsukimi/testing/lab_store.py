"""The store spread over a lab's emulated hosts (tsukimi/lab): `tsukimi master` on one host,
`tsukimi holder`s on others, each serving its segment on its own host's address, and a
`Deployment` (deployments.py) whose clients live in the calling thread's host, so that the
store semantics suite (`store_checks`) runs against it as against any other shape.

    with lab.entered("c"):                                   clients in host c
        store = start_spread_store(lab, "m", ["h1", "h2", "h3"], "c", log_dir)
        check_store(lend(store.deployment))
        store.close()

The plan (`store_plan`) names 127.0.0.1 throughout, as `tsukimi up`'s does; the lab's `place`
moves every address and bind setting to its owner's host. The master runs with
deployments.MASTER's short timeouts (leases of 1 s, a silent holder dropped after 2 s).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from tsukimi.errors import ConfigError, PeerError
from tsukimi.lab import Lab
from tsukimi.lab.cluster import place
from tsukimi.serving.cluster.launcher import LaunchConfig, LaunchedCluster
from tsukimi.serving.cluster.process_spec import ProcessSpec
from tsukimi.testing.deployments import CLIENT_SETTINGS, HOLDER_BYTES, MASTER_SETTINGS, Deployment
from tsukimi.testing.processes import wait_until

MASTER_RPC_PORT = 50051  # NOTE: fresh namespaces: every port is free
MASTER_HTTP_PORT = 8081
_STARTUP_S = 60.0
_LOOPBACK = "127.0.0.1"


def store_plan(
    num_holders: int, holder_bytes: int = HOLDER_BYTES, master_settings: Sequence[str] = ()
) -> list[list[ProcessSpec]]:
    """The master (with `master_settings` after the defaults, e.g. "hot_threshold=2"), then
    `num_holders` holders of `holder_bytes` (a group of their own: they need the master), all
    on 127.0.0.1, for `place` to spread (pure)."""
    env = (("COLUMNS", "200"),)
    master = (
        "master",
        f'--set=master.host="{_LOOPBACK}"',
        f"--set=master.rpc_port={MASTER_RPC_PORT}",
        f"--set=master.http_port={MASTER_HTTP_PORT}",
        *(f"--set=master.{s}" for s in [*MASTER_SETTINGS, *master_settings]),
    )
    holder = (
        "holder",
        "--master",
        f"tcp://{_LOOPBACK}:{MASTER_RPC_PORT}",
        "--segment-bytes",
        str(holder_bytes),
        f'--set=transfer.bind_host="{_LOOPBACK}"',
        *(f"--set={s}" for s in CLIENT_SETTINGS),
    )
    holders = [ProcessSpec(f"holder-{i}", "holder", holder, "", env=env, health="none") for i in range(num_holders)]
    return [[ProcessSpec("master", "master", master, f"http://{_LOOPBACK}:{MASTER_HTTP_PORT}", env=env)], holders]


@dataclass
class SpreadStore:
    """A running spread store: the `deployment` the suite is given (clients in `client_host`),
    the launched processes, and which host each runs on (process name -> host)."""

    deployment: Deployment
    cluster: LaunchedCluster
    hosts: Mapping[str, str]

    def holder_host(self, segment: str) -> str:
        """The host of the holder serving `segment` (a "HOST:PORT" name). Raises KeyError."""
        return {name: self.hosts[f"holder-{i}"] for i, name in enumerate(self.deployment.holder_names)}[segment]

    def close(self) -> None:
        """Close the deployment's clients (call it from `client_host`), then stop the
        processes, holders first. Idempotent."""
        self.deployment.close()
        self.cluster.stop()


def start_spread_store(
    lab: Lab,
    master_host: str,
    holder_hosts: Sequence[str],
    client_host: str,
    log_dir: Path,
    holder_bytes: int = HOLDER_BYTES,
    master_settings: Sequence[str] = (),
) -> SpreadStore:
    """Start the master on `master_host` and one holder on each of `holder_hosts`, checked
    from `client_host`; returns once every holder's segment is mounted. Call it from inside
    `lab.entered(client_host)` (its checks and clients are there).

    Raises:
        ConfigError: a host is not in the lab, or something stayed on 127.0.0.1.
        PeerError / OSError: a process did not come up in time (everything is stopped first).
    """
    placement = {"master": master_host, **{f"holder-{i}": host for i, host in enumerate(holder_hosts)}}
    placed = place(lab, store_plan(len(holder_hosts), holder_bytes, master_settings), placement)
    if placed.missing:
        raise ConfigError(f"the spread store still names 127.0.0.1: {'; '.join(placed.missing)}")
    cluster = LaunchedCluster(placed.groups, LaunchConfig(log_dir, startup_timeout_s=_STARTUP_S))
    try:
        cluster.start()
        master = lab.address(master_host)
        http_url = f"http://{master}:{MASTER_HTTP_PORT}"
        names = _holder_names(lab, http_url, holder_hosts)
    except BaseException:
        cluster.stop()
        raise
    deployment = Deployment(
        "lab",
        f"tcp://{master}:{MASTER_RPC_PORT}",
        http_url,
        holder_names=names,
        transfer_host=lab.address(client_host),
    )
    return SpreadStore(deployment, cluster, placed.hosts)


def _holder_names(lab: Lab, http_url: str, holder_hosts: Sequence[str]) -> list[str]:
    """Each holder's segment name ("ADDRESS:PORT"), in `holder_hosts`' order, once the master
    lists them all. Raises PeerError: not all mounted within the startup time."""
    found: dict[str, str] = {}

    def mounted() -> bool:
        for segment in httpx.get(http_url + "/segments", timeout=2).json():
            host = re.sub(r":\d+$", "", str(segment["te_segment"]))
            found[host] = str(segment["te_segment"])
        return all(lab.address(h) in found for h in holder_hosts)

    try:
        wait_until(mounted, _STARTUP_S, interval_s=0.1)
    except PeerError as exc:
        raise PeerError(f"holders on {', '.join(holder_hosts)} did not all mount: {exc} (found {found})") from exc
    return [found[lab.address(h)] for h in holder_hosts]
