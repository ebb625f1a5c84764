"""A lab of emulated hosts on this machine: network namespaces joined by shaped veth links on
bridges, the processes started inside them, runtime link faults, and a teardown that leaves
nothing behind, also when the runner is SIGKILLed.

           hub (tsk<PID>x<N>-hub)
      br0 ---------------- br1                  one bridge per NIC index
       |  h0n0  h1n0        |  h1n1              hub ends of the veth pairs (shaped egress:
       |     |              |                    hub -> host)
     eth0   eth0          eth1                   host ends (shaped egress: host -> hub)
   host "a"    host "b" (2 NICs)                 tsk<PID>x<N>-a, tsk<PID>x<N>-b

    with Lab(topology) as lab:
        lab.address("b", nic=1)                  10.X.Y.2: host i is .i+1 on NIC k's subnet
        proc = lab.popen("a", [sys.executable, "-m", "tsukimi.cli", "master", ...])
        lab.run("b", ["python", "-c", "..."])    started inside the host, TSUKIMI_HOST_ID set
        with lab.entered("a"): httpx.get(...)    this thread's sockets inside host "a"
        lab.set_link("a", 0, rate="100mbit"); lab.link_down("b", 1); lab.partition("a", "b"); lab.heal()

A link with delay or jitter is a delay line instead of a veth pair (tsukimi/lab/delay_line.py):
two TAPs named as the veth ends would be (eth0 in the host, hNnK on the bridge) and a forwarder
process in the hub that holds each frame for the delay; rate, loss and partitions are the same
tc on either kind. `set_link(delay=...)` retimes a delay line, or rebuilds a veth link as one.

Each lab's subnets (10.64.0.0/11, one /24 per NIC index) are derived from its id (runner pid,
serial), so two labs' logs never show the same addresses; being in separate namespaces, two
labs could not reach each other anyway, and no lab has a route out of its namespaces.

Every process started in a host gets TSUKIMI_HOST_ID (tsukimi/transfer/segment.py `host_id`):
the host's own identity, so the Transfer Engine uses shm, CMA and device IPC only between
processes of one emulated host, and tcp between hosts.

Teardown: `close()` kills every process it started (their process groups), then every
process left in its namespaces, then deletes the namespaces (and with them the veth pairs and
bridges). A janitor (`python -m tsukimi.lab.janitor`, its own session) watches this process
through a lifeline pipe (tsukimi/lifeline.py) and does the same when this process dies, even by
SIGKILL; and every new Lab first reaps the namespaces of runners that are gone (netns.py).
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import IO

from tsukimi.errors import ConfigError
from tsukimi.lab import netns
from tsukimi.lab.delay_handle import DelayLine, Timing
from tsukimi.lab.shaping import filter_commands, root_commands
from tsukimi.lab.topology import HostSpec, LinkShape, Topology
from tsukimi.lifeline import Lifeline
from tsukimi.transfer.segment import HOST_ID_ENV

logger = logging.getLogger(__name__)

_SUBNET_BASE = int(ipaddress.IPv4Address("10.64.0.0"))
_NUM_SLOTS = 4096  # NOTE: 2 NIC subnets a slot: 10.64.0.0 .. 10.95.255.0
_STOP_GRACE_S = 3.0
_JANITOR_EXIT_S = 10.0
Stream = int | IO[bytes] | None


class Lab:
    """The emulated hosts of one topology (see the module). A context manager; `close()` is
    idempotent. Not thread-safe.

    Raises (constructor): ConfigError: the machine refuses namespaces (naming what is missing),
    or a command that builds the lab failed (everything made so far is deleted first).
    """

    _serials = itertools.count()

    def __init__(self, topology: Topology) -> None:
        netns.require_namespaces()
        netns.reap_dead()
        self.topology = topology
        self.prefix = netns.lab_prefix(os.getpid(), next(Lab._serials))
        slot = (os.getpid() * 8 + int(self.prefix.rsplit("x", 1)[1].rstrip("-"))) % _NUM_SLOTS
        self._subnets = [ipaddress.IPv4Network((_SUBNET_BASE + (2 * slot + k) * 256, 24)) for k in range(2)]
        self._shapes = {(h.name, k): shape for h in topology.hosts for k, shape in enumerate(h.links)}
        self._blocked: dict[str, set[str]] = {h.name: set() for h in topology.hosts}
        self._procs: list[subprocess.Popen[bytes]] = []
        self._lines: dict[tuple[str, int], DelayLine] = {}
        self._closed = False
        self._lifeline = Lifeline()
        self._janitor = self._start_janitor()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        logger.info("lab %s up: %d hosts", self.prefix, len(topology.hosts))

    # -- names and addresses -----------------------------------------------------------

    @property
    def hub(self) -> str:
        """The hub namespace's name."""
        return f"{self.prefix}hub"

    def namespace(self, host: str) -> str:
        """The namespace of `host`. Raises ConfigError: no such host."""
        return f"{self.prefix}{self.topology.host(host).name}"

    def address(self, host: str, nic: int = 0) -> str:
        """`host`'s IPv4 address on NIC `nic`. Raises ConfigError: no such host or NIC."""
        spec = self.topology.host(host)
        self._check_nic(spec, nic)
        return str(self._subnets[nic].network_address + self.topology.hosts.index(spec) + 1)

    def addresses(self, host: str) -> list[str]:
        """`host`'s addresses, NIC by NIC."""
        return [self.address(host, k) for k in range(self.topology.host(host).num_nics)]

    def host_id(self, host: str) -> str:
        """The identity `host`'s processes report (TSUKIMI_HOST_ID)."""
        return f"lab/{self.namespace(host)}"

    def shape(self, host: str, nic: int = 0) -> LinkShape:
        """The current shape of `host`'s NIC `nic` link."""
        self._check_nic(self.topology.host(host), nic)
        return self._shapes[host, nic]

    @staticmethod
    def _check_nic(spec: HostSpec, nic: int) -> None:
        if not 0 <= nic < spec.num_nics:
            raise ConfigError(f"host {spec.name!r} has NICs 0..{spec.num_nics - 1}, not {nic}")

    # -- building ----------------------------------------------------------------------

    def _start_janitor(self) -> subprocess.Popen[bytes]:
        """Started first: from here on, this process dying leaves nothing behind."""
        argv = [sys.executable, "-m", "tsukimi.lab.janitor", str(self._lifeline.read_fd), self.prefix]
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=self._lifeline.pass_fds
        )

    def _build(self) -> None:
        netns.run_tool("ip", "netns", "add", self.hub)
        for k in range(self.topology.num_nics):
            netns.run_tool("ip", "-n", self.hub, "link", "add", f"br{k}", "type", "bridge")
            netns.run_tool("ip", "-n", self.hub, "link", "set", f"br{k}", "up")
        for host in self.topology.hosts:
            ns = self.namespace(host.name)
            netns.run_tool("ip", "netns", "add", ns)
            netns.run_tool("ip", "-n", ns, "link", "set", "lo", "up")
            for k in range(host.num_nics):
                self._make_link(host.name, k)

    def _make_link(self, host: str, nic: int, mac: str | None = None) -> None:
        """One link, as its shape needs: a veth pair, or a delay line (two TAPs and the
        forwarder between them, tsukimi/lab/delay_line.py) when it has delay or jitter."""
        ns, (_, port) = self.namespace(host), self._ends(host, nic)[1]
        shape, device = self._shapes[host, nic], f"eth{nic}"
        if shape.delayed:
            self._lines[host, nic] = DelayLine(ns, device, self.hub, port, Timing(shape.delay_ms, shape.jitter_ms))
        else:
            netns.run_tool("ip", "-n", self.hub, "link", "add", port, "type", "veth", "peer", device, "netns", ns)
        if mac is not None:
            netns.run_tool("ip", "-n", ns, "link", "set", device, "address", mac)
        netns.run_tool("ip", "-n", self.hub, "link", "set", port, "master", f"br{nic}", "up")
        netns.run_tool("ip", "-n", ns, "addr", "add", f"{self.address(host, nic)}/24", "dev", device)
        netns.run_tool("ip", "-n", ns, "link", "set", device, "up")
        self._apply(host, nic)

    def _ends(self, host: str, nic: int) -> list[tuple[str, str]]:
        """(namespace, device) of both ends of a link: the host's, then the hub's."""
        return [
            (self.namespace(host), f"eth{nic}"),
            (self.hub, f"h{self.topology.hosts.index(self.topology.host(host))}n{nic}"),
        ]

    def _apply(self, host: str, nic: int) -> None:
        """Set the link's shape and drop filters on both of its ends (idempotent)."""
        shape = self._shapes[host, nic]
        blocked = sorted(a for other in self._blocked[host] for a in self.addresses(other))
        line = self._lines.get((host, nic))
        if line is not None and line.timing != Timing(shape.delay_ms, shape.jitter_ms):
            line.retime(Timing(shape.delay_ms, shape.jitter_ms))
        for end, (ns, device) in enumerate(self._ends(host, nic)):
            first, *rest = root_commands(ns, device, shape)
            netns.run_tool(*first, check=False)
            for command in rest:
                netns.run_tool(*command)
            reset, install = filter_commands(ns, device, shape.loss_pct, blocked if end == 0 else ())
            for command in reset:
                netns.run_tool(*command, check=False)
            if install is not None:
                netns.run_tool(*install)

    # -- processes ---------------------------------------------------------------------

    def env(self, host: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment a process started in `host` gets: ours, `extra`, TSUKIMI_HOST_ID."""
        return {**os.environ, **(extra or {}), HOST_ID_ENV: self.host_id(host)}

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` run inside `host` (`ip netns exec NS ...`; pure)."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def popen(
        self,
        host: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        stdin: Stream = subprocess.DEVNULL,
        stdout: Stream = None,
        stderr: Stream = None,
    ) -> subprocess.Popen[bytes]:
        """Start `argv` inside `host`, in a session of its own (a process group `close()`
        kills), with `env` added to ours and TSUKIMI_HOST_ID set (mutates: the lab owns it).

        Raises:
            ConfigError: no such host, or the lab is closed. OSError: it could not start.
        """
        if self._closed:
            raise ConfigError("the lab is closed")
        proc = subprocess.Popen(
            self.command(host, argv),
            env=self.env(host, env),
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
        self._procs.append(proc)
        return proc

    def run(
        self, host: str, argv: Sequence[str], env: Mapping[str, str] | None = None, timeout_s: float = 60.0
    ) -> subprocess.CompletedProcess[bytes]:
        """Run `argv` inside `host` to its end; its exit status, stdout and stderr (not checked).

        Raises:
            subprocess.TimeoutExpired: it ran past `timeout_s` (it is killed first).
            ConfigError / OSError: as `popen`.
        """
        proc = self.popen(host, argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            raise
        finally:
            self._procs.remove(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def entered(self, host: str) -> contextlib.AbstractContextManager[None]:
        """While inside, the calling thread's sockets and children are in `host`'s network
        (setns; netns.py `entered`). Processes forked there get no TSUKIMI_HOST_ID: use `env`."""
        return netns.entered(self.namespace(host))

    # -- faults (all idempotent) -------------------------------------------------------

    def set_link(self, host: str, nic: int = 0, **shape: str) -> LinkShape:
        """Reshape a link at runtime, both directions: `rate="100mbit"`, `delay="50ms"`,
        `jitter="5ms"`, `loss="1%"`; unnamed settings keep their value. The new shape.

        A delay line (tsukimi/lab/delay_line.py) is retimed in place. A veth link given delay
        or jitter is rebuilt as a delay line: its NIC goes away for a few ms and comes back
        with the same MAC and address (open connections survive; the link is up after it,
        also if it was down). A delay line set back to 0 ms stays one (forwarding at once).

        Raises:
            ConfigError: no such host/NIC, a bad setting, or the delay line could not start.
        """
        self._check_nic(self.topology.host(host), nic)
        before = self._shapes[host, nic]
        self._shapes[host, nic] = before.with_settings(shape, f"set_link({host!r}, {nic})")
        rebuild = self._shapes[host, nic].delayed and (host, nic) not in self._lines
        mac = self._mac(host, nic) if rebuild else None
        try:
            if rebuild:
                self._rebuild(host, nic, mac)
            else:
                self._apply(host, nic)
        except ConfigError:
            self._shapes[host, nic] = before  # NOTE: the link keeps its old shape, not none
            if rebuild:
                self._rebuild(host, nic, mac)
            else:
                self._apply(host, nic)
            raise
        return self._shapes[host, nic]

    def _mac(self, host: str, nic: int) -> str:
        shown = netns.run_tool("ip", "-n", self.namespace(host), "-o", "link", "show", f"eth{nic}")
        words = shown.split()
        return words[words.index("link/ether") + 1]

    def _rebuild(self, host: str, nic: int, mac: str | None) -> None:
        """Delete the link (both ends) and make it again as its shape needs, keeping `mac`."""
        line = self._lines.pop((host, nic), None)
        if line is not None:
            line.close()
        netns.run_tool("ip", "-n", self.hub, "link", "del", self._ends(host, nic)[1][1], check=False)
        self._make_link(host, nic, mac)

    def link_down(self, host: str, nic: int = 0) -> None:
        """Take `host`'s NIC `nic` down (its peer on the hub loses carrier)."""
        self._check_nic(self.topology.host(host), nic)
        netns.run_tool("ip", "-n", self.namespace(host), "link", "set", f"eth{nic}", "down")

    def link_up(self, host: str, nic: int = 0) -> None:
        """Bring `host`'s NIC `nic` back up (its address and subnet route come back)."""
        self._check_nic(self.topology.host(host), nic)
        netns.run_tool("ip", "-n", self.namespace(host), "link", "set", f"eth{nic}", "up")

    def partition(self, a: str, b: str) -> None:
        """Drop every packet between hosts `a` and `b`, both ways, on every NIC, silently (as
        a cut cable: connections time out); the others still reach both."""
        self.topology.host(a), self.topology.host(b)
        self._blocked[a].add(b)
        self._blocked[b].add(a)
        self._reapply(a, b)

    def heal(self, a: str | None = None, b: str | None = None) -> None:
        """End the partition between `a` and `b`, or every partition when not given."""
        if a is None or b is None:
            touched = [h for h, blocked in self._blocked.items() if blocked]
            for blocked in self._blocked.values():
                blocked.clear()
        else:
            touched = [a, b]
            self._blocked[a].discard(b)
            self._blocked[b].discard(a)
        self._reapply(*touched)

    def _reapply(self, *hosts: str) -> None:
        for host in hosts:
            for k in range(self.topology.host(host).num_nics):
                self._apply(host, k)

    # -- teardown ----------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process started (process groups: SIGTERM, SIGKILL after a grace), then
        anything left inside the namespaces, and delete them all; stop the janitor. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=_STOP_GRACE_S)
            _kill_group(proc)
        self._procs.clear()
        for line in self._lines.values():
            line.close()  # NOTE: after the processes: their clean stops may still need the link
        self._lines.clear()
        netns.delete_namespaces([n for n in netns.lab_namespaces() if n.startswith(self.prefix)])
        self._lifeline.close()  # NOTE: the janitor wakes up, finds nothing left, and exits
        try:
            self._janitor.wait(timeout=_JANITOR_EXIT_S)
        except subprocess.TimeoutExpired:
            self._janitor.kill()
            self._janitor.wait()
        logger.info("lab %s closed", self.prefix)

    def __enter__(self) -> Lab:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL `proc`'s process group (it leads its session) and reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
