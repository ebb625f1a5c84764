"""A pytest plugin that runs the standalone client `test_dummy_client.py` talks to.

Mooncake's dummy-client tests (`setup_dummy(..., "127.0.0.1:50052")`) expect a
`mooncake_client` process holding the memory; the shared `run.sh` starts only the master.
Load this plugin on run.sh's pytest command line:

    PYTHONPATH=$PWD MODE=tsukimi bash ../shared/mooncake-tests/run.sh \\
        test_dummy_client.py -p tests.compat.mooncake_dummy_client

Before collection it starts `tsukimi compat mooncake-client` (MODE=tsukimi) or the wheel's
`mooncake_client` (MODE=real) against MASTER_SERVER / MC_METADATA_SERVER, waits until its
port answers, and kills its process group at the end. Its output goes to
DUMMY_CLIENT_LOG (default /tmp/mooncake-tests-dummy-client.log).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HOST, PORT = "127.0.0.1", 50052  # the address the test file hard-codes
START_TIMEOUT_S = 60.0

_client: subprocess.Popen[bytes] | None = None


def _command() -> list[str]:
    flags = [
        f"--host={HOST}",
        f"--port={PORT}",
        f"--master_server_address={os.environ.get('MASTER_SERVER', '127.0.0.1:50051')}",
        f"--metadata_server={os.environ.get('MC_METADATA_SERVER', 'P2PHANDSHAKE')}",
        f"--global_segment_size={os.environ.get('DUMMY_CLIENT_SEGMENT', '4GB')}",
    ]
    if os.environ.get("MODE", "tsukimi") == "real":
        return [str(Path(sys.executable).parent / "mooncake_client"), *flags]
    return [
        sys.executable,
        "-c",
        "import sys; from tsukimi.cli import main; sys.exit(main())",
        "compat",
        "mooncake-client",
        *flags,
    ]


def _answers() -> bool:
    try:
        with socket.create_connection((HOST, PORT), timeout=0.5):
            return True
    except OSError:
        return False


def pytest_configure(config: pytest.Config) -> None:
    """Start the client and wait until its port answers (mutates the module's state)."""
    global _client
    if _answers():
        raise pytest.UsageError(f"{HOST}:{PORT} is taken: another client is running")
    with open(os.environ.get("DUMMY_CLIENT_LOG", "/tmp/mooncake-tests-dummy-client.log"), "wb") as log:
        _client = subprocess.Popen(_command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _answers():
        if _client.poll() is not None or time.monotonic() > deadline:
            _stop()
            raise pytest.UsageError(f"the dummy client did not come up on {HOST}:{PORT}: {_command()}")
        time.sleep(0.2)
    time.sleep(0.5)  # NOTE: mooncake_client may open its port before its memory is mounted (tsukimi: after)


def pytest_unconfigure(config: pytest.Config) -> None:
    _stop()


def _stop() -> None:
    """Kill the client's process group (the one this plugin started)."""
    global _client
    if _client is None:
        return
    if _client.poll() is None:
        os.killpg(_client.pid, signal.SIGTERM)
        try:
            _client.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(_client.pid, signal.SIGKILL)
    _client.wait()
    _client = None
