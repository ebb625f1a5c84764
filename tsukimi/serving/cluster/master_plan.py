"""The store masters `tsukimi up` starts in mode "pd" (tsukimi/serving/cluster/up.py's `plan`):
one master, or with `[master] ha = N` etcd and N masters that elect their leader through it.

    ha = 0:  master                                   workers' master: tcp://HOST:RPC_PORT
    ha = N:  etcd  ->  master-0 .. master-(N-1)       workers' master: etcd://HOST:ETCD_PORT
                       (master.ha_etcd = etcd://...)  (the store client follows the leader)

etcd is Debian's etcd-server (`make` installs it), a single member keeping its data under
DATA_DIR/etcd-data; the supervisor runs it under `python -m tsukimi.lifeline`, so that it stops
with `tsukimi up` even when that is SIGKILLed (tsukimi/lifeline.py).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from tsukimi.config import ClusterConfig
from tsukimi.errors import ConfigError
from tsukimi.serving.cluster.process_spec import ProcessSpec


def master_groups(
    config: ClusterConfig, pick: Callable[[], int], data_dir: Path
) -> tuple[list[list[ProcessSpec]], str]:
    """The groups of processes that serve the store master, in start order, and the address
    the workers join it by (pure, apart from `pick`).

    Raises:
        ConfigError: `ha` asks for etcd and no `etcd` is on PATH.
    """
    h, m = config.host, config.master
    url_host = f"[{h}]" if ":" in h else h
    if m.ha == 0:
        rpc, http = m.rpc_port or pick(), m.http_port or pick()
        return [[_master("master", config, rpc, http, ())]], f"tcp://{url_host}:{rpc}"
    client_port, peer_port = m.etcd_port or pick(), pick()
    etcd_url = f"etcd://{url_host}:{client_port}"
    masters = [
        _master(
            f"master-{i}",
            config,
            (i == 0 and m.rpc_port) or pick(),
            (i == 0 and m.http_port) or pick(),
            (f'master.ha_etcd="{etcd_url}"',),
        )
        for i in range(m.ha)
    ]
    return [[_etcd(url_host, client_port, peer_port, data_dir)], masters], etcd_url


def _master(name: str, config: ClusterConfig, rpc: int, http: int, extra: tuple[str, ...]) -> ProcessSpec:
    h = config.host
    url_host = f"[{h}]" if ":" in h else h
    sets = (
        f'master.host="{h}"',
        f"master.rpc_port={rpc}",
        f"master.http_port={http}",
        *config.master.settings(),
        *extra,
    )
    return ProcessSpec(name, "master", ("master", *(f"--set={s}" for s in sets)), f"http://{url_host}:{http}")


def _etcd(url_host: str, client_port: int, peer_port: int, data_dir: Path) -> ProcessSpec:
    binary = shutil.which("etcd")
    if binary is None:
        raise ConfigError("master.ha needs etcd on PATH: apt-get install etcd-server (or `make`)")
    client, peer = f"http://{url_host}:{client_port}", f"http://{url_host}:{peer_port}"
    argv = (
        binary,
        "--name=tsukimi-up",
        f"--data-dir={data_dir / 'etcd-data'}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=tsukimi-up={peer}",
        "--initial-cluster-state=new",
        "--log-level=warn",
    )
    return ProcessSpec("etcd", "etcd", (), client, argv=argv, health="http")
