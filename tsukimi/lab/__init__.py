"""The lab: several emulated hosts on one machine (network namespaces, shaped veth links on
bridges, or delay lines where a link has delay or jitter, link faults), and a `tsukimi up`
cluster spread over them. Tooling, as testing/ and bench/ are: only they and the CLI import it
(tsukimi/testing/layers.py). docs/lab.md.

    topology.py   the TOML topology -> Topology, HostSpec, LinkShape
    lab.py        Lab: build, processes in hosts, faults, teardown
    netns.py      namespaces: names, `ip`/`tc`, reaping, entering one
    shaping.py    the tc commands of one link end (tbf, a classic-BPF drop filter)
    delay_line.py    the process that delays a link's frames (two TAPs; no netem needed)
    delay_handle.py  the lab's handle on one delay line (start, retime, close)
    janitor.py    deletes a dead runner's lab
    cluster.py    a `tsukimi up` plan placed on the lab's hosts
    commands.py   `tsukimi lab up | down | run`
"""

from __future__ import annotations

from tsukimi.lab.lab import Lab
from tsukimi.lab.topology import HostSpec, LinkShape, Topology, load_topology, parse_topology
from tsukimi.transfer.segment import HOST_ID_ENV

__all__ = ["HOST_ID_ENV", "HostSpec", "Lab", "LinkShape", "Topology", "load_topology", "parse_topology"]
