"""`mooncake.store.bind_to_numa_node`: pin the calling thread to a NUMA node's CPUs and
prefer that node's memory for what it allocates from then on.

As the wheel does (libnuma's numa_run_on_node, then numa_set_preferred): the thread's CPU
affinity becomes the CPUs of /sys/devices/system/node/node{N}/cpulist, and its memory policy
MPOL_PREFERRED for node N (set_mempolicy(2), through ctypes on libc's `syscall`). Node -1
undoes both: every CPU, and local allocation. Nothing is raised for a node that does not
exist, as in the wheel: it logs a warning ("Invalid NUMA node: 999. Valid range: 0-0") and
each step that fails logs one more; a machine without NUMA logs one and binds nothing.
Linux only (x86_64 and aarch64 know set_mempolicy's number here).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

NODES = Path("/sys/devices/system/node")
MPOL_DEFAULT = 0
MPOL_PREFERRED = 1
_MAX_NODES = 1024  # NOTE: the nodemask's bits; the kernel's MAX_NUMNODES is at most 1024
_WORD_BITS = 8 * ctypes.sizeof(ctypes.c_ulong)
_SYSCALLS = {"x86_64": (238, 239), "aarch64": (237, 236)}  # set_mempolicy, get_mempolicy


@dataclass(frozen=True, slots=True)
class MemoryPolicy:
    """The calling thread's memory policy: `mode` (MPOL_*) and the nodes of its mask."""

    mode: int
    nodes: frozenset[int]


def bind_to_numa_node(node: int) -> None:
    """Bind the calling thread, and the memory it allocates from now on, to NUMA node `node`
    (-1: unbind). Logs a warning, and raises nothing, for a node that does not exist.

    Args:
        node: the node's number (as in /sys/devices/system/node/node{N}), or -1.

    Raises:
        TypeError: `node` is not an int (the wheel's binding raises the same).
    """
    if isinstance(node, bool) or not isinstance(node, int):
        raise TypeError(f"bind_to_numa_node(): node must be an int, got {type(node).__name__}")
    nodes = online_nodes()
    if not nodes:
        logger.warning("NUMA is not available on this system; binding skipped")
        return
    if node not in nodes and node != -1:
        logger.warning("Invalid NUMA node: %d. Valid range: %s", node, _text(nodes))
        if node < -1:
            return
    cpus = node_cpus(node)
    if cpus is None:
        logger.warning("numa_run_on_node failed for node %d", node)
    else:
        try:
            os.sched_setaffinity(0, cpus)  # NOTE: pid 0 is the calling thread, not the whole process
        except OSError as exc:  # e.g. none of the node's CPUs is in this container's cpuset
            logger.warning("numa_run_on_node failed for node %d: %s", node, exc)
    mask = frozenset() if node < 0 else frozenset({node})
    problem = _set_mempolicy(MPOL_PREFERRED, mask)
    if problem:
        logger.warning("set_mempolicy(MPOL_PREFERRED, node %d): %s", node, problem)


def online_nodes() -> frozenset[int]:
    """The NUMA nodes this machine has online (empty: no NUMA, e.g. not Linux)."""
    try:
        return frozenset(_parse_list((NODES / "online").read_text()))
    except OSError:
        return frozenset()


def memory_policy() -> MemoryPolicy:
    """The calling thread's memory policy (get_mempolicy(2)).

    Raises:
        OSError: the call failed, or this machine's set_mempolicy number is not known here.
    """
    mode = ctypes.c_int(0)
    words = (ctypes.c_ulong * (_MAX_NODES // _WORD_BITS))()
    if _syscall(1, ctypes.byref(mode), words, ctypes.c_ulong(_MAX_NODES), None, ctypes.c_ulong(0)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"get_mempolicy: {os.strerror(err)}")
    nodes = {w * _WORD_BITS + b for w, word in enumerate(words) for b in range(_WORD_BITS) if word >> b & 1}
    return MemoryPolicy(mode.value, frozenset(nodes))


def node_cpus(node: int) -> set[int] | None:
    """The CPUs of NUMA node `node` (-1: of every online node); None: no such node, or one
    without CPUs."""
    if node < 0:
        found = {cpu for n in online_nodes() for cpu in (node_cpus(n) or ())}
        return found or None
    try:
        found = set(_parse_list((NODES / f"node{node}" / "cpulist").read_text()))
    except OSError:
        return None
    return found or None  # NOTE: a memory-only node has no CPU to run on


def _set_mempolicy(mode: int, nodes: frozenset[int]) -> str:
    """set_mempolicy(2) for the calling thread: "" when it took, else why not."""
    if any(not 0 <= n < _MAX_NODES for n in nodes):
        return "Invalid argument"
    words = (ctypes.c_ulong * (_MAX_NODES // _WORD_BITS))()
    for n in nodes:
        words[n // _WORD_BITS] |= 1 << (n % _WORD_BITS)
    try:
        if _syscall(0, ctypes.c_int(mode), words, ctypes.c_ulong(_MAX_NODES + 1)) != 0:
            return os.strerror(ctypes.get_errno())
    except OSError as exc:
        return str(exc)
    return ""


def _syscall(which: int, *args: object) -> int:
    """set_mempolicy (which=0) or get_mempolicy (1) through libc's `syscall`. Raises OSError
    where the machine's numbers are not known here."""
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        raise OSError(f"set_mempolicy's syscall number is not known for {platform.machine()}")
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    result: int = libc.syscall(ctypes.c_long(numbers[which]), *args)
    return result


def _parse_list(text: str) -> list[int]:
    """The numbers of a kernel list such as "0-3,8,10-11"."""
    found: list[int] = []
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            found.extend(range(int(first), int(last or first) + 1))
    return found


def _text(nodes: frozenset[int]) -> str:
    return f"{min(nodes)}-{max(nodes)}"
