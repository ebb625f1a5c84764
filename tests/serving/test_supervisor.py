"""The supervisor of `tsukimi up` (tsukimi/serving/cluster/supervisor.py) and the children's lifeline
(tsukimi/lifeline.py), on tiny real processes: a child that dies is restarted with a doubling,
capped backoff until a crash loop stops it; a child whose parent's lifeline closes stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.serving.test_cluster import alive, children_of
from tsukimi.config import ClusterRestartConfig
from tsukimi.errors import ConfigError, PeerError
from tsukimi.lifeline import Lifeline
from tsukimi.serving.cluster.process_spec import ProcessSpec
from tsukimi.serving.cluster.supervisor import Supervisor
from tsukimi.testing.processes import wait_until


def test_backoff_doubles_up_to_its_cap() -> None:
    policy = ClusterRestartConfig(initial_backoff_s=0.5, max_backoff_s=3.0)
    assert [policy.backoff_s(n) for n in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    with pytest.raises(ConfigError, match="max_restarts"):
        ClusterRestartConfig(max_restarts=-1)


def crasher(tmp_path: Path) -> ProcessSpec:
    """A child that counts its starts in a file and exits at once."""
    code = f"import pathlib; p = pathlib.Path({str(tmp_path / 'starts')!r}); p.write_text(p.read_text() + 'x')"
    (tmp_path / "starts").write_text("")
    return ProcessSpec("crasher", "test", (), "http://127.0.0.1:1", argv=(sys.executable, "-c", code), health="none")


@pytest.mark.timeout(30)
def test_a_child_runs_at_its_specs_nice_value(tmp_path: Path) -> None:
    """`ProcessSpec.nice` (the engines' `workers.nice`) is the child's priority from its start,
    and a respawned child's too."""
    code = "import time; time.sleep(60)"
    spec = ProcessSpec("niced", "test", (), "http://127.0.0.1:1", argv=(sys.executable, "-c", code), nice=7)
    supervisor = Supervisor(tmp_path, stop_timeout_s=5)
    try:
        supervisor.start_group([spec])
        child = supervisor.children[0]
        expected = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 7)  # NOTE: added to ours, as `nice -n 7`
        assert os.getpriority(os.PRIO_PROCESS, child.proc.pid) == expected
        supervisor.respawn(child)
        assert os.getpriority(os.PRIO_PROCESS, child.proc.pid) == expected
    finally:
        supervisor.stop()


@pytest.mark.timeout(60)
def test_a_dying_child_is_restarted_until_a_crash_loop_stops_the_supervisor(tmp_path: Path) -> None:
    restart = ClusterRestartConfig(max_restarts=3, initial_backoff_s=0.05, max_backoff_s=0.1)
    supervisor = Supervisor(tmp_path, stop_timeout_s=5, restart=restart)
    try:
        supervisor.start_group([crasher(tmp_path)])
        errors: list[PeerError] = []

        def tended() -> bool:
            try:
                supervisor.tend()
            except PeerError as exc:
                errors.append(exc)
            return bool(errors)

        wait_until(tended, 30, interval_s=0.01)
        assert "crasher exited with code 0 (3 restarts in 300 s)" in str(errors[0])
        assert (tmp_path / "starts").read_text() == "xxxx"  # the first start and 3 restarts
    finally:
        supervisor.stop()


@pytest.mark.timeout(60)
def test_without_restarts_a_dying_child_stops_the_supervisor(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path, stop_timeout_s=5)
    try:
        supervisor.start_group([crasher(tmp_path)])
        supervisor.children[0].proc.wait(10)
        with pytest.raises(PeerError, match="crasher exited with code 0"):
            supervisor.tend()
    finally:
        supervisor.stop()


@pytest.mark.timeout(60)
def test_a_child_stops_when_its_lifeline_closes() -> None:
    lifeline = Lifeline()
    code = "import threading, tsukimi.lifeline as l; l.watch_from_env(); threading.Event().wait(60)"
    child = subprocess.Popen(
        [sys.executable, "-c", code], env={**os.environ, **lifeline.env()}, pass_fds=lifeline.pass_fds
    )
    try:
        threading.Event().wait(0.5)  # NOTE: not required: EOF is seen whenever the watcher starts
        assert child.poll() is None
        lifeline.close()
        assert child.wait(30) == -15  # SIGTERM: the command's own clean shutdown
    finally:
        child.kill()
        child.wait()


@pytest.mark.timeout(60)
def test_a_foreign_command_under_the_wrapper_stops_with_the_lifeline() -> None:
    lifeline = Lifeline()
    cmd = [sys.executable, "-m", "tsukimi.lifeline", "sleep", "60"]
    wrapper = subprocess.Popen(
        cmd, env={**os.environ, **lifeline.env()}, pass_fds=lifeline.pass_fds, start_new_session=True
    )
    try:
        wait_until(lambda: bool(children_of(wrapper.pid)), 30)
        [sleeper] = children_of(wrapper.pid)
        lifeline.close()
        assert wrapper.wait(30) == 128 + 15  # sleep ended by the SIGTERM passed on
        wait_until(lambda: not alive(sleeper), 10)
    finally:
        if wrapper.poll() is None:
            os.killpg(wrapper.pid, signal.SIGKILL)
        wrapper.wait()
