"""The command line: bad bench arguments, the demo and the metadata server, end to end (small).
Every bench's report: tests/bench/test_reports.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tsukimi.errors import MetadataError

pytestmark = pytest.mark.timeout(120)


def _tsukimi(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tsukimi.cli", *args], capture_output=True, text=True, timeout=110, check=False
    )


def test_bench_rejects_bad_arguments_clearly() -> None:
    out = _tsukimi("bench", "transfer", "--transport", "rdma", "--quick")
    assert out.returncode == 2 and "transport must be one of auto, shm, cma" in out.stdout + out.stderr
    out = _tsukimi("bench", "transfer", "--block-sizes", "lots")
    assert out.returncode == 2 and "not a size" in out.stderr


def test_demo_moves_bytes_both_ways() -> None:
    out = _tsukimi("demo", "--seconds", "0.2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("yes") == 2 and "shm" in out.stdout and "tcp" in out.stdout


def test_metadata_server_command_serves_and_stops_on_sigterm() -> None:
    from tsukimi.netio import free_port
    from tsukimi.transfer.metadata.http_client import HttpMetadata

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tsukimi.cli", "metadata-server", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        client = HttpMetadata(f"http://127.0.0.1:{port}/metadata", timeout_s=1.0)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.put("tsukimi/segments/x", b"descriptor")
                break
            except MetadataError:
                assert time.monotonic() < deadline, "metadata-server did not come up"
                time.sleep(0.1)
        assert client.get("tsukimi/segments/x") == b"descriptor"
        client.close()
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught
        assert proc.wait(timeout=10) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
