"""The byte counters of an emulated host's NICs, read from the kernel (`ip -s -j link` in the
host's namespace): how the cross-host suites and benches see which link carried what.

    before = nic_bytes(lab, "a")
    ...                                        traffic
    moved = nic_bytes(lab, "a") - before       {"eth0": NicBytes(rx_bytes=..., tx_bytes=...), ...}
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from tsukimi.errors import ConfigError
from tsukimi.lab import netns


class Namespaces(Protocol):
    """What reading counters needs of a lab (Lab has it)."""

    def namespace(self, host: str) -> str: ...


@dataclass(frozen=True, slots=True)
class NicBytes:
    """Bytes one NIC received and sent (its host's side of the link)."""

    rx_bytes: int
    tx_bytes: int

    def __sub__(self, other: NicBytes) -> NicBytes:
        return NicBytes(self.rx_bytes - other.rx_bytes, self.tx_bytes - other.tx_bytes)


@dataclass(frozen=True, slots=True)
class HostBytes:
    """The counters of every NIC of one host (`eth0`, `eth1`; not `lo`), by device name."""

    nics: Mapping[str, NicBytes]

    def __getitem__(self, device: str) -> NicBytes:
        return self.nics[device]

    def __sub__(self, other: HostBytes) -> HostBytes:
        return HostBytes({name: nic - other.nics[name] for name, nic in self.nics.items()})

    @property
    def tx_bytes(self) -> int:
        """Bytes sent over all NICs."""
        return sum(n.tx_bytes for n in self.nics.values())

    @property
    def rx_bytes(self) -> int:
        """Bytes received over all NICs."""
        return sum(n.rx_bytes for n in self.nics.values())


def nic_bytes(lab: Namespaces, host: str) -> HostBytes:
    """`host`'s NIC counters now (reads the kernel; mutates nothing).

    Raises:
        ConfigError: no such host, or `ip` failed (the namespace is gone).
    """
    out = netns.run_tool("ip", "-n", lab.namespace(host), "-s", "-j", "link", "show")
    try:
        links = json.loads(out)
        return HostBytes(
            {
                link["ifname"]: NicBytes(int(link["stats64"]["rx"]["bytes"]), int(link["stats64"]["tx"]["bytes"]))
                for link in links
                if link["ifname"] != "lo"
            }
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot read {host}'s NIC counters from `ip -s -j link`: {exc}") from exc
