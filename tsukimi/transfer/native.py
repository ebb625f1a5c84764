"""The optional native loops of the same-host fast path (tsukimi/transfer/_native.c).

A repeated 64 KiB x 4 `transfer()` to a same-host peer spent ~3 us computing the plan memo's
key in Python, ~1.2 us in four ctypes.memmove calls and ~1.1 us checking the peer (select on
its pidfd, fstat of its file), against ~6 us of copying; NIXL does the whole batch in ~10 us
(profile in docs/benchmarks.md, "Same host, 64 KiB x 4"). Four loops move to C: the key
(`memo_key`, the same tuple `PlanMemo.key` makes), the copies of a prepared call
(`copy_packed`, one call, the GIL released), the peer check (`still_there`) and cma's
prepared call (`cma_run`: checks and process_vm_readv/writev in one call).

The extension is optional: setup.py builds it where a C compiler is present (`pip install
-e .`, `make`), and without it (or with TSUKIMI_NATIVE=0) tsukimi runs the Python code,
which stays the reference (tests/transfer/test_native.py holds both equal). `NATIVE` is the
module, or None; `WHY_NOT` says why it is None.
"""

from __future__ import annotations

import importlib
import os
import select
from array import array
from collections.abc import Sequence
from types import ModuleType

from tsukimi.transfer.batch import OpCode, SegmentHandle

Copy = tuple[int, int, int]  # (destination address, source address, bytes)

VERSION = 1  # _native.c's VERSION: bump both together when its functions change
NATIVE: ModuleType | None = None
WHY_NOT = ""


def _load() -> tuple[ModuleType | None, str]:
    if os.environ.get("TSUKIMI_NATIVE", "1") == "0":
        return None, "TSUKIMI_NATIVE=0"
    try:
        module = importlib.import_module("tsukimi.transfer._native")  # NOTE: a C module: no .py to check
    except ImportError as exc:  # NOTE: not built here (no C compiler), or built for another Python
        return None, f"not built ({exc}); `pip install -e .` with a C compiler builds it"
    if getattr(module, "VERSION", None) != VERSION:  # NOTE: built from an older _native.c: rebuild (make)
        return None, f"built from another _native.c (version {getattr(module, 'VERSION', None)}, want {VERSION})"
    return module, ""


def configure(host_classes: Sequence[type], by_name: object, by_address: object) -> None:
    """Tell the key which classes and markers `PlanMemo.key` uses (plan_memo.py calls this)."""
    if NATIVE is not None:
        NATIVE.configure(tuple(host_classes), OpCode, OpCode.READ, SegmentHandle, by_name, by_address)


def still_there(pidfd: int, fds: tuple[int, ...]) -> bool:
    """Whether the process `pidfd` pins still runs and every file in `fds` is still linked
    (its owner did not release it); False too for a bad descriptor."""
    if NATIVE is not None:
        return bool(NATIVE.still_there(pidfd, fds))
    try:
        readable, _, _ = select.select([pidfd], [], [], 0)
        return not readable and all(os.fstat(fd).st_nlink > 0 for fd in fds)
    except (OSError, ValueError):
        return False


def packed(copies: Sequence[Copy]) -> array[int]:
    """`copies` as `copy_packed` takes them: native uint64 triples."""
    flat = array("Q")
    for triple in copies:
        flat.extend(triple)
    return flat


NATIVE, WHY_NOT = _load()
