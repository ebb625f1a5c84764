"""A `tsukimi up` cluster spread over a lab's hosts: the plan's processes (up.py `plan`, as
ProcessSpecs) placed by role or name, each started inside its host, every address rewritten
from 127.0.0.1 to the lab address of the host that owns it.

    groups = plan(ClusterConfig(...))                       host 127.0.0.1 (the default)
    placed = place(lab, groups, {"master": "m", "metadata": "m", "prefill": "p", "decode": "d", "router": "r"})
    placed.missing                                          what still binds or names 127.0.0.1
    cluster = launch(lab, placed, LaunchConfig(log_dir), control="r")
    with lab.entered("r"): httpx.post(cluster.api + "/v1/completions", ...)
    cluster.stop()

The rewriting: a port belongs to the process whose URL, `--port`, `*_port=` setting or etcd
`--listen-*-urls` names it; "127.0.0.1:PORT" anywhere becomes its owner's address; a bind
setting (`--host`, `master.host=`, `transfer.bind_host=`) becomes the process's own address
(a worker's store client serves its Transfer Engine on the worker's `--host` too). What
remains on 127.0.0.1 afterwards is listed in `missing`.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from tsukimi.errors import ConfigError
from tsukimi.lab.netns import entered
from tsukimi.serving.cluster.launcher import LaunchConfig, LaunchedCluster
from tsukimi.serving.cluster.process_spec import ProcessSpec

LOOPBACK = "127.0.0.1"
_OWN_PORT = re.compile(r"(?:_port=|--listen-[a-z]+-urls=\S*:)(\d+)$")
_BIND_SET = re.compile(r'^(--set=)?(\w+\.(?:bind_)?host)="?127\.0\.0\.1"?$')
_ADDRESS = re.compile(r"127\.0\.0\.1:(\d+)")


class Hosts(Protocol):
    """What placing needs of a lab (Lab has it): each host's address, the command that runs
    inside it, the identity its processes report, and its namespace's name."""

    def address(self, host: str, nic: int = 0) -> str: ...
    def command(self, host: str, argv: Sequence[str]) -> list[str]: ...
    def host_id(self, host: str) -> str: ...
    def namespace(self, host: str) -> str: ...


@dataclass(frozen=True, slots=True)
class PlacedPlan:
    """A plan placed on hosts: the groups to launch, each process's host, and what could not
    be moved off 127.0.0.1 (one line each, naming the process and the setting)."""

    groups: tuple[tuple[ProcessSpec, ...], ...]
    hosts: Mapping[str, str]
    missing: tuple[str, ...]


def place(lab: Hosts, groups: Sequence[Sequence[ProcessSpec]], placement: Mapping[str, str]) -> PlacedPlan:
    """Place each process of `groups` on the host `placement` gives its name, else its role
    (see the module; pure).

    Raises:
        ConfigError: a process has no host, or a host is not in the lab.
    """
    specs = [spec for group in groups for spec in group]
    hosts = {s.name: placement.get(s.name) or placement.get(s.role) or "" for s in specs}
    unplaced = sorted(f"{name} ({s.role})" for s in specs if not hosts[(name := s.name)])
    if unplaced:
        raise ConfigError(f"no host for {', '.join(unplaced)}: give placement by name or role")
    address = {name: lab.address(host) for name, host in hosts.items()}
    owner: dict[str, str] = {}
    for spec in specs:
        for port in _own_ports(spec):
            owner[port] = address[spec.name]
    missing: list[str] = []
    placed = tuple(tuple(_placed(lab, s, hosts[s.name], address[s.name], owner, missing) for s in g) for g in groups)
    return PlacedPlan(placed, hosts, tuple(missing))


def _own_ports(spec: ProcessSpec) -> list[str]:
    ports = [str(urlsplit(spec.url).port or "")]
    words = [*spec.args, *spec.argv]
    for i, word in enumerate(words):
        if word == "--port" and i + 1 < len(words):
            ports.append(words[i + 1])
        if match := _OWN_PORT.search(word):
            ports.append(match[1])
    return [p for p in ports if p]


def _placed(
    lab: Hosts, spec: ProcessSpec, host: str, own: str, owner: Mapping[str, str], missing: list[str]
) -> ProcessSpec:
    def move(word: str) -> str:
        word = _ADDRESS.sub(lambda m: f"{owner.get(m[1], LOOPBACK)}:{m[1]}", word)
        bind = _BIND_SET.match(word)
        return f'{bind[1] or ""}{bind[2]}="{own}"' if bind else word

    args = [move(a) for a in spec.args]
    for i in range(len(args) - 1):
        if args[i] == "--host" and args[i + 1] == LOOPBACK:
            args[i + 1] = own
    argv = [move(a) for a in spec.argv]
    url = move(spec.url)
    missing += [f"{spec.name}: {w}" for w in (*args, *argv, url) if LOOPBACK in w]
    command = lab.command(host, argv or [sys.executable, "-m", "tsukimi.cli", *args])
    env = (*spec.env, ("TSUKIMI_HOST_ID", lab.host_id(host)))
    return dataclasses.replace(spec, args=tuple(args), argv=tuple(command), url=url, env=env)


def launch(lab: Hosts, placed: PlacedPlan, config: LaunchConfig, control: str) -> LaunchedCluster:
    """Start `placed` group by group, its health checked from the host `control` (the root
    namespace cannot reach the lab); returns the running cluster: `stop()` it, and call its
    `restart` / `start_group` inside `lab.entered(control)` too.

    Raises:
        PeerError / OSError: as LaunchedCluster.start (everything started is stopped first).
        ConfigError: no such host.
    """
    cluster = LaunchedCluster(placed.groups, config)
    with entered(lab.namespace(control)):
        cluster.start()
    return cluster
