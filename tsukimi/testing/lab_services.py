"""The processes the cross-host suites (tests/lab) start inside a lab's emulated hosts
(tsukimi/lab): an HTTP metadata server, and JSON-lines children (`JsonWorker`) such as the
transport suite's target (target_peer.py) or P2P stores (p2p_peer.py).

    url = start_metadata_server(lab, "meta")                 http://<meta's address>:8080/metadata
    peer = worker_in(lab, "b", "target", ["tsukimi.testing.target_peer", url])

Both run in their host with its identity (TSUKIMI_HOST_ID) and are killed with the lab at the
latest; stop a worker yourself (`worker.stop()`) to see it exit cleanly.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import httpx

from tsukimi.lab import HOST_ID_ENV, Lab
from tsukimi.testing.processes import JsonWorker, wait_until

METADATA_PORT = 8080  # NOTE: a fresh namespace has every port free
_STARTUP_S = 30.0


def start_metadata_server(lab: Lab, host: str, port: int = METADATA_PORT) -> str:
    """Start `tsukimi metadata-server` in `host` on its address; its URL once it answers
    (checked from inside `host`).

    Raises:
        PeerError: it did not answer within 30 s. ConfigError: no such host.
    """
    address = lab.address(host)
    argv = [sys.executable, "-m", "tsukimi.cli", "metadata-server", "--host", address, "--port", str(port)]
    lab.popen(host, argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://{address}:{port}/metadata"
    with lab.entered(host):
        wait_until(lambda: httpx.get(url, params={"key": "probe"}, timeout=1).status_code == 404, _STARTUP_S)
    return url


def worker_in(
    lab: Lab, host: str, label: str, module_args: list[str], pythonpath: Sequence[str | Path] = ()
) -> JsonWorker:
    """A JsonWorker child (`python -m MODULE_ARGS`) started inside `host`, with its identity.

    Raises:
        WorkerError: it did not say it was ready. ConfigError: no such host.
    """
    return JsonWorker(
        f"{label} on {host}",
        module_args,
        startup_timeout_s=_STARTUP_S,
        env={HOST_ID_ENV: lab.host_id(host)},
        pythonpath=pythonpath,
        wrapper=lab.command(host, []),
    )
