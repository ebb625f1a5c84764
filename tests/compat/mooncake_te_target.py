"""A pytest plugin that runs Mooncake's `transfer_engine_target.py` beside its initiator test.

Mooncake's `transfer_engine_initiator_test.py` expects a target engine to be running already
(Mooncake's CI starts `transfer_engine_target.py` in the background first); the shared
`run.sh` starts only the master. Load this plugin on run.sh's pytest command line:

    PYTHONPATH=$PWD MODE=tsukimi bash ../shared/mooncake-tests/run.sh \\
        transfer_engine_initiator_test.py -p tests.compat.mooncake_te_target

Before collection it starts the target with this interpreter and this environment (under
`tsukimi compat exec` the child sees `mooncake.*` as tsukimi too, in MODE=real the wheel),
waits for its "Target server ready" line, and kills it (its own process group) at the end.
The target's stderr goes to TE_TARGET_LOG (default /tmp/mooncake-tests-te-target.log).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

SCRIPT = "transfer_engine_target.py"
READY = "Target server ready"
START_TIMEOUT_S = 60.0

_target: subprocess.Popen[str] | None = None


def pytest_configure(config: pytest.Config) -> None:
    """Start the target and wait until it says it is ready (mutates the module's state)."""
    global _target
    script = Path(os.environ.get("TE_TARGET_SCRIPT", SCRIPT)).resolve()
    if not script.exists():
        raise pytest.UsageError(f"{script} not found: run from Mooncake's test directory")
    log = open(os.environ.get("TE_TARGET_LOG", "/tmp/mooncake-tests-te-target.log"), "w")  # noqa: SIM115
    _target = subprocess.Popen(
        [sys.executable, "-u", str(script)],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,
    )
    log.close()
    lines: list[str] = []
    ready = threading.Event()

    def drain() -> None:  # NOTE: keeps reading, so the target never blocks on a full pipe
        assert _target is not None and _target.stdout is not None
        for line in _target.stdout:
            lines.append(line.rstrip())
            if READY in line:
                ready.set()

    threading.Thread(target=drain, name="te-target-stdout", daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.wait(0.1):
        if _target.poll() is not None or time.monotonic() > deadline:
            _stop()
            raise pytest.UsageError(f"{SCRIPT} did not become ready; it printed: {lines}")


def pytest_unconfigure(config: pytest.Config) -> None:
    _stop()


def _stop() -> None:
    """Kill the target's process group (the one this plugin started)."""
    global _target
    if _target is None:
        return
    if _target.poll() is None:
        os.killpg(_target.pid, signal.SIGKILL)
    _target.wait()
    _target = None
