"""Network namespaces as the lab uses them: running `ip` and `tc`, the names that tie each
namespace to the process that made it, reaping those of dead runners, and entering one.

    tsk<PID>x<N>-hub            the lab's hub: one bridge per NIC index (br0, br1)
    tsk<PID>x<N>-<HOST>         one emulated host (lo, eth0[, eth1])
      PID: the runner (the process that made lab N); once PID is gone, everything named
      tsk<PID>x... is a leftover: `reap_dead()` deletes it (and kills what runs inside)

Nothing here touches the root namespace's interfaces, routes, firewall or qdiscs: every
`ip`/`tc` command names a lab namespace (`-n NS`), and veth pairs are created inside the hub
with their peer moved straight into a host, so no interface ever exists outside the lab.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tsukimi.errors import ConfigError
from tsukimi.owners import pid_alive

logger = logging.getLogger(__name__)

NETNS_DIR = Path("/run/netns")
_NAME = re.compile(r"^tsk(\d+)x(\d+)-[a-z0-9-]+$")
_CLONE_NEWNET = 0x40000000
_COMMAND_TIMEOUT_S = 20.0


def lab_prefix(pid: int, serial: int) -> str:
    """The prefix of every namespace of the runner `pid`'s lab number `serial`."""
    return f"tsk{pid}x{serial}-"


def runner_of(namespace: str) -> int | None:
    """The pid of the runner that made the lab namespace `namespace`, or None when the name is
    not a lab's (pure)."""
    match = _NAME.match(namespace)
    return int(match[1]) if match else None


def require_namespaces() -> None:
    """Check, before anything is created, that this machine lets the lab make namespaces.

    Raises:
        ConfigError: naming what is missing: root, `ip` or `tc` on PATH, network namespace
            support in the kernel, or the right to create one.
    """
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ConfigError(f"the lab needs {' and '.join(missing)} on PATH (Debian: apt-get install iproute2)")
    if os.geteuid() != 0:
        raise ConfigError("the lab needs root (it creates network namespaces, veth pairs and qdiscs)")
    if not Path("/proc/self/ns/net").exists():
        raise ConfigError("this kernel has no network namespaces (CONFIG_NET_NS)")
    if shutil.which("unshare") is not None:
        probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, timeout=_COMMAND_TIMEOUT_S)
        if probe.returncode != 0:
            why = probe.stderr.decode(errors="replace").strip()
            raise ConfigError(f"this machine refuses new network namespaces (unshare --net: {why})")


def run_tool(*argv: str, check: bool = True) -> str:
    """Run one `ip`/`tc` command; its stdout.

    Raises:
        ConfigError: with `check`, the command failed (the machine cannot do what the lab
            asked: its stderr is quoted).
    """
    done = subprocess.run(list(argv), capture_output=True, timeout=_COMMAND_TIMEOUT_S)
    if check and done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip()
        raise ConfigError(f"`{' '.join(argv)}` failed: {why}")
    return done.stdout.decode(errors="replace")


def lab_namespaces() -> list[str]:
    """Every namespace named as a lab's, whoever made it (reads /run/netns)."""
    try:
        names = os.listdir(NETNS_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if runner_of(n) is not None)


def delete_namespaces(names: list[str]) -> None:
    """Kill every process inside each namespace, then delete them, hosts before hubs (the
    veth pairs and bridges go with them). Idempotent; never raises for one already gone."""
    for name in names:
        for pid_text in run_tool("ip", "netns", "pids", name, check=False).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_text), signal.SIGKILL)
    for name in sorted(names, key=lambda n: n.endswith("-hub")):
        run_tool("ip", "netns", "delete", name, check=False)


def reap_dead() -> list[str]:
    """Delete the namespaces of every runner that is no longer alive (see the module);
    the names deleted."""
    dead = [name for name in lab_namespaces() if not pid_alive(runner_of(name) or 0)]
    if dead:
        logger.info("reaping %d namespaces of dead lab runners: %s", len(dead), ", ".join(dead))
        delete_namespaces(dead)
    return dead


def reap_all() -> list[str]:
    """Delete every lab namespace, live runners' too (`tsukimi lab down --all`); the names."""
    names = lab_namespaces()
    delete_namespaces(names)
    return names


def switch_to(namespace: str) -> None:
    """Move the calling thread into `namespace`'s network for good (setns(2)); in a
    single-threaded process (the delay line, tsukimi/lab/delay_line.py) that is the process,
    so `ip netns pids` lists it there (mutates the thread).

    Raises:
        ConfigError: no such namespace, or setns failed.
    """
    try:
        target = os.open(NETNS_DIR / namespace, os.O_RDONLY)
    except FileNotFoundError:
        raise ConfigError(f"no network namespace {namespace!r}") from None
    try:
        _setns(target, namespace)
    finally:
        os.close(target)


def _setns(fd: int, namespace: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        raise ConfigError(f"setns into {namespace!r} failed: {os.strerror(ctypes.get_errno())}")


@contextlib.contextmanager
def entered(namespace: str) -> Iterator[None]:
    """Run the body with the calling thread inside `namespace`'s network (setns(2)): the
    sockets it opens and the processes it forks live there; other threads are unaffected.
    Back in the thread's own namespace on the way out.

    Raises:
        ConfigError: no such namespace, or setns failed.
    """
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        switch_to(namespace)
        try:
            yield
        finally:
            _setns(own, "the thread's own namespace")  # NOTE: cannot fail for a namespace we came from
    finally:
        os.close(own)
