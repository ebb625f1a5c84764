"""What tests/lab share: the reason the machine refuses namespaces (None where it lets the lab
make them: then every lab test runs), running a Python snippet inside an emulated host, and
timing a wait."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from tsukimi.errors import ConfigError
from tsukimi.lab import Lab
from tsukimi.lab.netns import require_namespaces
from tsukimi.testing.processes import wait_until


def _refused() -> str | None:
    try:
        require_namespaces()
    except ConfigError as exc:
        return f"this machine refuses network namespaces: {exc}"
    return None


REFUSED = _refused()
needs_namespaces = pytest.mark.skipif(REFUSED is not None, reason=REFUSED or "")


def python_in(lab: Lab, host: str, code: str, timeout_s: float = 30.0) -> str:
    """Run `code` with this interpreter inside `host`; its stdout (asserting it exited 0)."""
    done = lab.run(host, [sys.executable, "-c", code], timeout_s=timeout_s)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    return done.stdout.decode()


def popen_python(lab: Lab, host: str, code: str) -> subprocess.Popen[bytes]:
    """Start `code` inside `host`, stdin and stdout piped."""
    return lab.popen(host, [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def timed_wait(condition: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> float:
    """Seconds until `condition()` held. Raises PeerError: not within `timeout_s`."""
    start = time.monotonic()
    wait_until(condition, timeout_s=timeout_s, interval_s=interval_s)
    return time.monotonic() - start
