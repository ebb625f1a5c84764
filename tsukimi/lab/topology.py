"""A lab's topology: which emulated hosts it has, how many NICs each, and how each link is
shaped, read from a small TOML file into frozen dataclasses.

    [links]
    default = { rate = "1gbit", delay = "0ms", jitter = "0ms", loss = "0%" }

    [[hosts]]
    name = "master"                     # 1-12 of a-z, 0-9, "-"; "hub" is the lab's own
    [[hosts]]
    name = "holder-a"
    nics = 2                            # 1 (default) or 2
    link = { rate = "100mbit" }         # over [links].default, for every NIC of this host
    nic = [{}, { delay = "5ms" }]       # over `link`, NIC by NIC (index = NIC)

A link is one host's NIC and its port on the hub; its shape applies to each direction apart
(host -> hub and hub -> host), so two hosts with `delay = "25ms"` each see a 100 ms round trip.
`rate = "unlimited"` leaves a link unshaped. Unknown keys and malformed values are ConfigErrors.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tsukimi.errors import ConfigError

SHAPE_KEYS = ("rate", "delay", "jitter", "loss")
HOST_KEYS = ("name", "nics", "link", "nic")
MAX_NICS = 2
MAX_HOSTS = 200  # NOTE: host i's address ends in i + 1 of a /24 (tsukimi/lab/lab.py)
_HOST_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,11}$")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit)$")
_TIME = re.compile(r"^(\d+(?:\.\d+)?)\s*(us|ms|s)$")
_LOSS = re.compile(r"^(\d+(?:\.\d+)?)\s*%$")
_RATE_UNITS = {"bit": 1, "kbit": 1_000, "mbit": 1_000_000, "gbit": 1_000_000_000}
_TIME_UNITS_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0}


@dataclass(frozen=True, slots=True)
class LinkShape:
    """How one direction of a link behaves: `rate_bps` bits per second (0 = unshaped),
    `delay_ms` added to every packet (with +-`jitter_ms`), `loss_pct` of packets dropped."""

    rate_bps: int = 1_000_000_000
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_bps < 0 or self.delay_ms < 0 or self.jitter_ms < 0:
            raise ConfigError(f"a link's rate, delay and jitter cannot be negative: {self}")
        if not 0.0 <= self.loss_pct <= 100.0:
            raise ConfigError(f"a link's loss is a percentage in [0, 100], got {self.loss_pct}")
        if self.jitter_ms > self.delay_ms:
            raise ConfigError(f"a link's jitter ({self.jitter_ms} ms) exceeds its delay ({self.delay_ms} ms)")

    @property
    def delayed(self) -> bool:
        """Whether this shape delays packets (a delay line carries such a link: the kernels the
        lab runs on have no netem; tsukimi/lab/delay_line.py)."""
        return self.delay_ms > 0 or self.jitter_ms > 0

    @property
    def summary(self) -> str:
        """One line for people: "100 Mbit/s, 25 ms +- 5 ms delay, 1 % loss" (pure)."""
        parts = [f"{self.rate_bps / 1e6:g} Mbit/s" if self.rate_bps else "unshaped"]
        if self.delayed:
            parts.append(f"{self.delay_ms:g} ms" + (f" +- {self.jitter_ms:g} ms" if self.jitter_ms else "") + " delay")
        if self.loss_pct:
            parts.append(f"{self.loss_pct:g} % loss")
        return ", ".join(parts)

    def with_settings(self, settings: Mapping[str, object], where: str) -> LinkShape:
        """This shape with some of `rate`, `delay`, `jitter`, `loss` given as strings
        ("100mbit", "50ms", "1%"; pure).

        Raises:
            ConfigError: an unknown key or a malformed value (naming `where`).
        """
        unknown = sorted(set(settings) - set(SHAPE_KEYS))
        if unknown:
            raise ConfigError(f"{where}: unknown link keys {unknown}; valid: {', '.join(SHAPE_KEYS)}")
        rate_bps, delay_ms, jitter_ms, loss_pct = self.rate_bps, self.delay_ms, self.jitter_ms, self.loss_pct
        for key, value in settings.items():
            if not isinstance(value, str):
                raise ConfigError(f"{where}: {key} must be a string such as {_EXAMPLES[key]!r}, got {value!r}")
            text = value.strip().lower()
            if key == "rate":
                rate_bps = parse_rate(text, where)
            elif key == "loss":
                loss_pct = _number(_LOSS, text, where, key)
            else:
                match = _TIME.match(text)
                if match is None:
                    raise ConfigError(f"{where}: {key} must look like {_EXAMPLES[key]!r}, got {value!r}")
                if key == "delay":
                    delay_ms = float(match[1]) * _TIME_UNITS_MS[match[2]]
                else:
                    jitter_ms = float(match[1]) * _TIME_UNITS_MS[match[2]]
        return LinkShape(rate_bps, delay_ms, jitter_ms, loss_pct)  # NOTE: checked once, all set


_EXAMPLES = {"rate": "1gbit", "delay": "50ms", "jitter": "5ms", "loss": "1%"}


def parse_rate(text: str, where: str = "rate") -> int:
    """Bits per second of "100mbit", "1gbit", "1.5gbit", "800kbit"; "unlimited" is 0 (pure).

    Raises:
        ConfigError: anything else.
    """
    if text == "unlimited":
        return 0
    match = _RATE.match(text)
    if match is None:
        raise ConfigError(f"{where}: rate must look like '100mbit' or '1gbit' (or 'unlimited'), got {text!r}")
    return int(float(match[1]) * _RATE_UNITS[match[2]])


def _number(pattern: re.Pattern[str], text: str, where: str, key: str) -> float:
    match = pattern.match(text)
    if match is None:
        raise ConfigError(f"{where}: {key} must look like {_EXAMPLES[key]!r}, got {text!r}")
    return float(match[1])


@dataclass(frozen=True, slots=True)
class HostSpec:
    """One emulated host: its name and the shape of each of its NICs' links (index = NIC)."""

    name: str
    links: tuple[LinkShape, ...]

    def __post_init__(self) -> None:
        if not _HOST_NAME.match(self.name) or self.name == "hub":
            raise ConfigError(f"host name must be 1-12 of a-z, 0-9 and '-' (not 'hub'), got {self.name!r}")
        if not 1 <= len(self.links) <= MAX_NICS:
            raise ConfigError(f"host {self.name!r}: nics must be 1 or {MAX_NICS}, got {len(self.links)}")

    @property
    def num_nics(self) -> int:
        return len(self.links)


@dataclass(frozen=True, slots=True)
class Topology:
    """The hosts of a lab, in order (host i gets address .i+1 on each of its NICs' subnets)."""

    hosts: tuple[HostSpec, ...]

    def __post_init__(self) -> None:
        if not 1 <= len(self.hosts) <= MAX_HOSTS:
            raise ConfigError(f"a lab has 1 to {MAX_HOSTS} hosts, got {len(self.hosts)}")
        names = [h.name for h in self.hosts]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"host names must be unique; given more than once: {', '.join(twice)}")

    def host(self, name: str) -> HostSpec:
        """The host called `name`. Raises ConfigError naming the hosts there are."""
        for host in self.hosts:
            if host.name == name:
                return host
        raise ConfigError(f"no host {name!r} in the lab (hosts: {', '.join(h.name for h in self.hosts)})")

    @property
    def num_nics(self) -> int:
        """The most NICs any host has (the number of bridges)."""
        return max(h.num_nics for h in self.hosts)

    @classmethod
    def of(cls, *names: str, nics: int = 1, link: LinkShape | None = None) -> Topology:
        """Hosts `names`, each with `nics` NICs shaped as `link` (default: 1 Gbit/s; pure)."""
        shape = link or LinkShape()
        return cls(tuple(HostSpec(name, (shape,) * nics) for name in names))


def parse_topology(text: str, where: str = "topology") -> Topology:
    """A topology from TOML text (see the module; pure).

    Raises:
        ConfigError: malformed TOML, unknown keys or tables, bad names, counts or values.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: not valid TOML: {exc}") from exc
    unknown = sorted(set(data) - {"hosts", "links"})
    if unknown:
        raise ConfigError(f"{where}: unknown top-level keys {unknown}; valid: hosts, links")
    links = _table(data.get("links", {}), f"{where} [links]")
    if set(links) - {"default"}:
        raise ConfigError(f"{where} [links]: unknown keys {sorted(set(links) - {'default'})}; valid: default")
    default = LinkShape().with_settings(_table(links.get("default", {}), f"{where} [links].default"), where)
    hosts = data.get("hosts", [])
    if not isinstance(hosts, list) or not hosts:
        raise ConfigError(f"{where}: give at least one [[hosts]] table")
    return Topology(tuple(_host(_table(h, f"{where} [[hosts]]"), default, where) for h in hosts))


def load_topology(path: str | Path) -> Topology:
    """The topology in the TOML file at `path`. Raises ConfigError (unreadable or invalid)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read topology {path}: {exc}") from exc
    return parse_topology(text, str(path))


def _table(value: object, where: str) -> dict[str, object]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a table, got {value!r}")
    return value


def _host(table: dict[str, object], default: LinkShape, where: str) -> HostSpec:
    name = table.get("name")
    if not isinstance(name, str):
        raise ConfigError(f'{where}: every [[hosts]] needs name = "..."')
    here = f"{where} host {name!r}"
    unknown = sorted(set(table) - set(HOST_KEYS))
    if unknown:
        raise ConfigError(f"{here}: unknown keys {unknown}; valid: {', '.join(HOST_KEYS)}")
    nics = table.get("nics", 1)
    if not isinstance(nics, int) or isinstance(nics, bool) or not 1 <= nics <= MAX_NICS:
        raise ConfigError(f"{here}: nics must be 1 or {MAX_NICS}, got {nics!r}")
    base = default.with_settings(_table(table.get("link", {}), f"{here} link"), here)
    per_nic = table.get("nic", [])
    if not isinstance(per_nic, list) or len(per_nic) > nics:
        raise ConfigError(f"{here}: nic must be a list of at most {nics} tables (one per NIC), got {per_nic!r}")
    overrides = [_table(t, f"{here} nic[{i}]") for i, t in enumerate(per_nic)]
    overrides += [{}] * (nics - len(overrides))
    return HostSpec(name, tuple(base.with_settings(o, f"{here} nic[{i}]") for i, o in enumerate(overrides)))
