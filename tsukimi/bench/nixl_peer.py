"""NIXL itself as a baseline of `tsukimi bench transfer` (--compare-nixl): two processes, each
one NIXL agent (UCX backend, no listener, no progress thread), one registered arena each.

The initiator measures batches of `batch` blocks with one prepared transfer handle re-posted
every batch (NIXL's fastest use, "handle reused"); the target progresses its agent every 10 ms
(an agent nobody progresses stalls its peers after UCX's keepalive interval). Metadata goes
over the JSON control channel of `JsonWorker`, never through NIXL's own listener.

    python -m tsukimi.bench.child nixl-peer target SIZE     -> {"metadata": b64, "base": addr}
    python -m tsukimi.bench.child nixl-peer initiator SIZE  <- {"metadata", "base", "op", "block_bytes", ...}
"""

from __future__ import annotations

import base64
import json
import os
import select
import sys
from typing import Any

import numpy as np

from tsukimi.bench.measure import rate
from tsukimi.testing.processes import child_reply

os.environ.setdefault("UCX_MODULES", "^efa")  # NOTE: see tsukimi/transfer/transports/nixl.py
os.environ.setdefault("UCX_NET_DEVICES", "lo")  # NOTE: one host: its control traffic on loopback


def nixl_available() -> bool:
    try:
        import nixl_cu12  # noqa: F401
    except ImportError:
        return False
    return True


def _agent(name: str) -> Any:
    from nixl_cu12 import nixl_agent, nixl_agent_config

    import tsukimi.transfer.transports.nixl  # noqa: F401 - takes NIXL's logging off stdout (our protocol)

    config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"])
    return nixl_agent(name, config)


def run_target(size: int) -> None:
    agent = _agent("bench-target")
    arena = np.full(size, 7, np.uint8)
    agent.register_memory([(int(arena.ctypes.data), size, 0, "")], "DRAM")
    metadata = base64.b64encode(bytes(agent.get_agent_metadata())).decode()
    child_reply({"metadata": metadata, "base": int(arena.ctypes.data)})
    while True:  # progress the agent until stdin closes
        agent.get_new_notifs()
        if select.select([sys.stdin], [], [], 0.01)[0] and not sys.stdin.readline():
            return


def run_initiator(size: int) -> None:
    agent = _agent("bench-initiator")
    local = np.full(size, 3, np.uint8)
    agent.register_memory([(int(local.ctypes.data), size, 0, "")], "DRAM")
    peers: dict[str, str] = {}
    child_reply({})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd["metadata"] not in peers:
            name = agent.add_remote_agent(base64.b64decode(cmd["metadata"]))
            peers[cmd["metadata"]] = name.decode() if isinstance(name, bytes) else str(name)
        try:
            child_reply({"gbps": _measure(agent, peers[cmd["metadata"]], int(local.ctypes.data), cmd)})
        except Exception as exc:  # NOTE: reported to the driver, which raises it there
            child_reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


def _measure(agent: Any, peer: str, local_base: int, cmd: dict[str, Any]) -> float:
    """Whole batches with one re-posted handle for duration_s after warmup_s; GB/s."""
    block, batch = cmd["block_bytes"], cmd["batch"]
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(local_base + i * block, block, 0) for i in range(batch)], "DRAM")
    remote = agent.prep_xfer_dlist(peer, [(cmd["base"] + i * block, block, 0) for i in range(batch)], "DRAM")
    handle = agent.make_prepped_xfer(cmd["op"].upper(), local, list(range(batch)), remote, list(range(batch)))

    def step() -> int:
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"nixl transfer ended {state}")
        return int(block * batch)

    try:
        return rate(step, cmd["warmup_s"], cmd["duration_s"]) / 1e9
    finally:
        handle.release()
        local.release()
        remote.release()


def main(argv: list[str]) -> None:
    """Run `target SIZE` or `initiator SIZE` (see the module) until stdin closes."""
    role, size = argv[0], int(argv[1])
    if role == "target":
        run_target(size)
    elif role == "initiator":
        run_initiator(size)
    else:
        raise SystemExit(f"unknown role {role}")
