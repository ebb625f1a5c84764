"""Mooncake's SSD offload on tsukimi's disk tier, for `MooncakeDistributedStore`: where a
client keeps its disk (replicas.py tells memory from disk replicas).

A Mooncake client offloads to disk when the master runs with `--enable_offload` and either
the client asked (`setup(..., enable_ssd_offload=True)`, its directory `ssd_offload_path` or
the environment's MOONCAKE_OFFLOAD_FILE_STORAGE_PATH) or the master was given a
`--root_fs_dir`. tsukimi's disks belong to one process each, so a client takes the first free
`tsukimi-disk-N` directory under that root (a restarted client finds its own again, unless
another took it meanwhile) and offers 90 % of the free space of its filesystem.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from tsukimi.rpc import RpcClient
from tsukimi.store import protocol as p
from tsukimi.store.disk_protocol import MasterInfo, MasterInfoResult

PATH_ENV = "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH"
MAX_SLOTS = 64
_FREE_SHARE = 0.9


def disk_root(master: str, enable_ssd_offload: bool, ssd_offload_path: str, timeout_s: float = 5.0) -> str:
    """The directory this client's disk goes under, or "" for none (asks the master whether
    it offloads at all). Raises what an RPC to the master raises."""
    with RpcClient(p.CODEC, master, timeout_s) as rpc:
        info = rpc.call_as(MasterInfo(), MasterInfoResult)
    if info.offload == "off":
        return ""
    asked = ssd_offload_path or (os.environ.get(PATH_ENV, "") if enable_ssd_offload else "")
    return asked or info.disk_root


def free_slot(root: str) -> tuple[str, int]:
    """A directory under `root` no live process holds, and the bytes it may use.

    Raises:
        OSError: `root` cannot be created, or every slot is taken.
    """
    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    for n in range(MAX_SLOTS):
        slot = base / f"tsukimi-disk-{n}"
        slot.mkdir(exist_ok=True)
        with open(slot / ".lock", "a+b") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue
            fcntl.flock(lock, fcntl.LOCK_UN)
        return str(slot), max(1 << 20, int(_FREE_SHARE * shutil.disk_usage(slot).free))
    raise OSError(f"every one of the {MAX_SLOTS} disk directories under {root} is in use")
