"""A Transfer Engine in one emulated host reads and writes a segment of one in another: over
tcp (the host identities differ, so "auto" cannot pick shm or CMA), byte-exact; a partition
fails a transfer within its timeout with a clear error, and healing lets the next one work."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tsukimi.lab import Lab, Topology
from tsukimi.testing.processes import wait_until

from .conftest import needs_namespaces

pytestmark = needs_namespaces

PEER = str(Path(__file__).with_name("te_peer.py"))
SIZE = 1 << 20


def _line(proc: subprocess.Popen[bytes]) -> dict[str, object]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "the peer exited"
    reply: dict[str, object] = json.loads(line)
    return reply


def _step(client: subprocess.Popen[bytes], seed: int) -> dict[str, object]:
    assert client.stdin is not None
    client.stdin.write(f"{seed}\n".encode())
    client.stdin.flush()
    return _line(client)


def test_a_te_reaches_another_hosts_segment_over_tcp_and_a_partition_fails_it() -> None:
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
    with Lab(Topology.of("a", "b")) as lab:
        server = lab.popen("b", [sys.executable, PEER, "serve", lab.address("b"), str(SIZE)], **pipes)
        served = _line(server)
        assert served["host_id"] == lab.host_id("b")
        argv = [sys.executable, PEER, "client", lab.address("a"), str(served["name"]), str(served["base"]), str(SIZE)]
        client = lab.popen("a", argv, **pipes)
        first = _step(client, 1)
        assert first == {"ok": True, "transport": "tcp", "host_id": lab.host_id("a")}

        lab.partition("a", "b")
        start = time.monotonic()
        failed = _step(client, 2)
        elapsed_s = time.monotonic() - start
        assert failed["ok"] is False, failed
        assert str(failed["error"]).startswith(("PeerError", "RpcTimeout", "TransferError")), failed
        assert lab.address("b") in str(failed["error"]), failed
        assert elapsed_s < 3.0 + 2.0, f"failed after {elapsed_s:.1f} s; the transfer timeout is 3 s"

        lab.heal()
        # NOTE: the write of step 1 left pattern 2 there; the failed step wrote nothing new
        wait_until(lambda: _step(client, 2)["ok"] is True, timeout_s=20, interval_s=0.1)
