"""The testing kit's own machinery: `raises`, `run_checks`, the port and polling helpers, and
the deployment factory's refusal of an unknown shape. (The suites themselves run in
tests/transfer/test_conformance.py and tests/store/test_semantics.py.)"""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from tsukimi.errors import ConfigError, PeerError
from tsukimi.netio import free_port
from tsukimi.testing.assertions import check_name, raises, run_checks
from tsukimi.testing.deployments import start_deployment
from tsukimi.testing.processes import JsonWorker, WorkerError, wait_until


def test_raises_accepts_the_expected_error_and_a_matching_message() -> None:
    with raises(KeyError):
        raise KeyError("k")
    with raises((KeyError, ValueError), match=r"bad \d+"):
        raise ValueError("a bad 42 value")


def test_raises_fails_when_nothing_or_a_mismatch_is_raised() -> None:
    with pytest.raises(AssertionError, match="did not raise KeyError, ValueError"), raises((KeyError, ValueError)):
        pass
    mismatch = "ValueError raised, but 'other' does not match 'bad'"
    with pytest.raises(AssertionError, match=mismatch), raises(ValueError, match="bad"):
        raise ValueError("other")
    with pytest.raises(TypeError), raises(ValueError):  # any other error passes through unchanged
        raise TypeError("not mine")


def test_run_checks_runs_in_order_and_names_the_failing_check() -> None:
    seen: list[str] = []

    def first(maker: str) -> None:
        seen.append(f"first {maker}")

    def second(maker: str) -> None:
        raise AssertionError(f"second broke on {maker}")

    def third(maker: str) -> None:
        seen.append("third")

    with pytest.raises(AssertionError, match="second broke on M") as caught:
        run_checks("demo", [first, second, third], "M")
    assert seen == ["first M"]
    assert caught.value.__notes__ == ["in the demo check 'second'"]
    assert check_name(second) == "second"


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_wait_until_polls_tolerates_http_errors_and_gives_up() -> None:
    answers = iter([httpx.ConnectError("starting"), False, True])

    def condition() -> bool:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    wait_until(condition, timeout_s=5.0, interval_s=0.001)
    with pytest.raises(PeerError, match=r"within 0\.05 s"):
        wait_until(lambda: False, timeout_s=0.05, interval_s=0.01)


def test_an_unknown_deployment_shape_is_refused() -> None:
    with pytest.raises(ConfigError, match="inprocess, multiprocess"):
        start_deployment("cloud")


def test_a_json_worker_child_gets_the_callers_path_first(tmp_path: Path) -> None:
    (tmp_path / "echo_child.py").write_text(
        "import json, sys\nprint(json.dumps({'ok': True, 'path': sys.path}), flush=True)\nsys.stdin.read()\n"
    )
    worker = JsonWorker("echo", ["echo_child"], pythonpath=[tmp_path])
    try:
        assert str(tmp_path) in worker.ready["path"]
    finally:
        worker.stop()
    with pytest.raises(WorkerError, match="No module named echo_child"):
        JsonWorker("echo", ["echo_child"], startup_timeout_s=10)
