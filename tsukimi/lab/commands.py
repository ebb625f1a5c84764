"""`tsukimi lab ...`: a lab of emulated hosts from the command line (docs/lab.md).

tsukimi lab up --topology FILE     build it, print each host's namespace and addresses,
                                   keep it until Ctrl-C or SIGTERM, then tear it down
tsukimi lab down [--all]           delete what dead runners left (--all: every lab, live too)
tsukimi lab run HOST -- CMD ...    (with `up` running elsewhere: `ip netns exec` the namespace
                                   `up` printed; this runs CMD in a one-host lab of its own)
"""

from __future__ import annotations

import argparse
import signal
import threading

from rich.console import Console
from rich.table import Table

from tsukimi.lab import netns
from tsukimi.lab.lab import Lab
from tsukimi.lab.topology import Topology, load_topology


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `tsukimi lab` on the CLI's subparsers (mutates `sub`)."""
    lab = sub.add_parser("lab", help="emulated hosts on this machine: network namespaces with shaped links (root)")
    verbs = lab.add_subparsers(dest="lab_command", required=True)
    up = verbs.add_parser("up", help="build a lab from a topology and keep it until Ctrl-C")
    up.add_argument("--topology", required=True, help="a TOML topology (docs/lab.md)")
    down = verbs.add_parser("down", help="delete the namespaces of dead runners")
    down.add_argument("--all", action="store_true", help="every lab's, live runners' too")
    run = verbs.add_parser("run", help="run a command in a one-host lab of its own, then tear it down")
    run.add_argument("host", help="the host's name")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS")


def run(args: argparse.Namespace, console: Console) -> int:
    """Run `tsukimi lab ...`; the exit status.

    Raises:
        ConfigError: a bad topology, or a machine that refuses namespaces.
    """
    if args.lab_command == "down":
        gone = netns.reap_all() if args.all else netns.reap_dead()
        console.print(f"deleted {len(gone)} namespaces{': ' + ', '.join(gone) if gone else ''}", highlight=False)
        return 0
    if args.lab_command == "run":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        with Lab(Topology.of(args.host)) as lab:
            return lab.popen(args.host, cmd).wait()
    with Lab(load_topology(args.topology)) as lab:
        console.print(_table(lab), highlight=False)
        console.print(
            f"run in a host: ip netns exec {lab.namespace(lab.topology.hosts[0].name)} CMD; Ctrl-C ends the lab"
        )
        _wait_for_signal()
    return 0


def _table(lab: Lab) -> Table:
    table = Table(title=f"lab {lab.prefix.rstrip('-')} (hub {lab.hub})")
    for column in ("host", "namespace", "addresses", "host id", "links"):
        table.add_column(column)
    for host in lab.topology.hosts:
        links = "; ".join(shape.summary for shape in host.links)
        table.add_row(
            host.name, lab.namespace(host.name), ", ".join(lab.addresses(host.name)), lab.host_id(host.name), links
        )
    return table


def _wait_for_signal() -> None:
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(0.5):
            pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
