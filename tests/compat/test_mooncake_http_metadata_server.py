"""`mooncake.http_metadata_server` on tsukimi: `python -m mooncake.http_metadata_server` under
`tsukimi compat exec` (how SGLang's test utilities and Mooncake's scripts start it) serves
Mooncake's /metadata protocol and stops on SIGTERM; `KVBootstrapServer` in a thread."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tsukimi.compat.mooncake.http_metadata_server import KVBootstrapServer, KVPoll
from tsukimi.netio import free_port
from tsukimi.testing.processes import wait_until

pytestmark = pytest.mark.timeout(60)


def _round_trip(base: str) -> None:
    url = f"{base}/metadata"
    assert httpx.put(url, params={"key": "seg/a"}, content=b"descriptor").status_code == 200
    assert httpx.get(url, params={"key": "seg/a"}).content == b"descriptor"
    assert httpx.delete(url, params={"key": "seg/a"}).status_code == 200
    assert httpx.get(url, params={"key": "seg/a"}).status_code == 404


def test_the_module_runs_under_compat_exec_and_stops_on_sigterm() -> None:
    port = free_port()
    cmd = [str(Path(sys.executable).with_name("tsukimi")), "compat", "exec", "--"]
    cmd += [sys.executable, "-m", "mooncake.http_metadata_server", "--port", str(port), "--log-level", "WARNING"]
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE)
    try:
        base = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert server.poll() is None, server.stderr.read().decode() if server.stderr else ""
            try:
                return httpx.get(f"{base}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, timeout_s=30)
        _round_trip(base)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=15) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_kv_bootstrap_server_in_a_thread() -> None:
    server = KVBootstrapServer(free_port())
    assert server.poll() is KVPoll.Failed  # not started
    assert server.run() is not None and server.poll() is KVPoll.Success
    try:
        _round_trip(f"http://127.0.0.1:{server.port}")
        taken = KVBootstrapServer(server.port)
        assert taken.run() is None and taken.poll() is KVPoll.Failed  # the port is in use
    finally:
        server.close()
    assert server.poll() is KVPoll.Failed
    server.close()  # idempotent
