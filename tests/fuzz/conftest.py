"""The bounded fuzz pass: one example budget for every target, and a count of what was tried.

Every fuzz test runs `FUZZ_EXAMPLES` Hypothesis examples (TSUKIMI_FUZZ_EXAMPLES, default 200),
derandomized unless TSUKIMI_FUZZ_RANDOM=1, and wraps each example in `fuzz_input(target)`.
At the end of the session one line per target is printed ("fuzz <target>: N inputs, 0
crashes"); with TSUKIMI_FUZZ_REPORT=PATH the same figures are written there as JSON
{target: {"inputs": N, "crashes": C}}. A crash is an example whose checks failed (Hypothesis
replays a failing example while shrinking, so one bug may count several times).

`thread_crashes` fails a test when any thread (a server's connection thread) died with an
exception during it: a server that survives by losing a thread has still crashed.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, settings

from tsukimi.config import MasterConfig
from tsukimi.store.master.server import MasterServer

FUZZ_EXAMPLES = int(os.environ.get("TSUKIMI_FUZZ_EXAMPLES", "200"))
DERANDOMIZE = os.environ.get("TSUKIMI_FUZZ_RANDOM", "") != "1"

_inputs: Counter[str] = Counter()
_crashes: Counter[str] = Counter()


def fuzz_settings(examples: int | None = None) -> settings:
    """The Hypothesis settings of one fuzz target (`examples` scales a slow target down)."""
    return settings(
        max_examples=examples or FUZZ_EXAMPLES,
        deadline=None,
        derandomize=DERANDOMIZE,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


@contextmanager
def fuzz_input(target: str) -> Iterator[None]:
    """Counts one input of `target`; an exception out of the block counts as a crash."""
    _inputs[target] += 1
    try:
        yield
    except BaseException:
        _crashes[target] += 1
        raise


def report() -> dict[str, dict[str, int]]:
    """{target: {"inputs": N, "crashes": C}} so far."""
    return {t: {"inputs": _inputs[t], "crashes": _crashes[t]} for t in sorted(_inputs)}


@pytest.fixture
def thread_crashes() -> Iterator[list[threading.ExceptHookArgs]]:
    """Records exceptions that end threads during the test; fails the test if there were any."""
    seen: list[threading.ExceptHookArgs] = []
    previous = threading.excepthook
    threading.excepthook = seen.append
    try:
        yield seen
    finally:
        threading.excepthook = previous
    assert not seen, [f"{a.thread.name if a.thread else '?'}: {a.exc_type.__name__}: {a.exc_value}" for a in seen]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    figures = report()
    if not figures:
        return
    terminalreporter.section("fuzz")
    for target, counts in figures.items():
        terminalreporter.write_line(f"fuzz {target}: {counts['inputs']} inputs, {counts['crashes']} crashes")
    path = os.environ.get("TSUKIMI_FUZZ_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=2, sort_keys=True)


@pytest.fixture(scope="module")
def master() -> Iterator[MasterServer]:
    """One store master per module (the fuzz targets share it; tests/conftest.py's is per test)."""
    with MasterServer(MasterConfig(rpc_port=0, http_port=0)) as server:
        yield server
