"""`tsukimi p2p publish / fetch / ls` as a user runs them: real processes, one metadata server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tsukimi.testing.processes import wait_until
from tsukimi.transfer.metadata.http import ServerHandle, start_in_thread

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def server() -> Iterator[ServerHandle]:
    handle, _ = start_in_thread()
    yield handle
    handle.stop()


def tsukimi(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tsukimi.cli", *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )


def test_publish_fetch_and_list_a_file(server: ServerHandle, tmp_path: Path) -> None:
    source = tmp_path / "weights.bin"
    payload = os.urandom(3_000_000)
    source.write_bytes(payload)
    url = server.url
    publisher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tsukimi.cli",
            "p2p",
            "publish",
            str(source),
            "--name",
            "w",
            "--metadata",
            url,
            "--shard-bytes",
            "1000000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until(lambda: "w" in tsukimi("p2p", "ls", "--metadata", url).stdout, timeout_s=30, interval_s=0.3)
        out = tmp_path / "copy.bin"
        fetched = tsukimi("p2p", "fetch", "w", "--out", str(out), "--metadata", url)
        assert fetched.returncode == 0, fetched.stdout + fetched.stderr
        assert "3000000 bytes" in fetched.stdout
        assert out.read_bytes() == payload
        listed = tsukimi("p2p", "ls", "--metadata", url)
        assert "w" in listed.stdout and "3000000" in listed.stdout and "1..1" in listed.stdout
    finally:
        publisher.send_signal(signal.SIGTERM)
        publisher.wait(timeout=20)
    assert publisher.returncode == 0
    assert "published w: 3000000 bytes in 3 shards" in (publisher.stdout.read() if publisher.stdout else "")
    assert "w" not in tsukimi("p2p", "ls", "--metadata", url).stdout.split("copies")[-1]  # withdrawn on exit


def test_errors_are_one_line_and_exit_2(server: ServerHandle, tmp_path: Path) -> None:
    missing = tsukimi("p2p", "fetch", "nothing", "--out", str(tmp_path / "x"), "--metadata", server.url)
    assert missing.returncode == 2 and "no P2P payload 'nothing'" in missing.stdout + missing.stderr
    no_service = tsukimi("p2p", "ls")
    assert no_service.returncode == 2 and "needs a metadata service" in no_service.stdout + no_service.stderr
