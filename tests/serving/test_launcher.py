"""The cluster launcher (tsukimi/serving/cluster/launcher.py) on small stand-in processes (Python's
http.server answering /health with a file): groups start in order, each once the one before is
healthy; a failure stops everything started; a later group that fails is dropped alone; kill,
restart and tending act on one child; `with_args` changes one planned child."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

from tsukimi.config import ClusterRestartConfig
from tsukimi.errors import ConfigError, PeerError
from tsukimi.netio import free_port
from tsukimi.serving.cluster.launcher import LaunchConfig, LaunchedCluster, with_args
from tsukimi.serving.cluster.process_spec import ProcessSpec
from tsukimi.testing.processes import wait_until

pytestmark = pytest.mark.timeout(60)


def _web(name: str, root: Path, role: str = "web") -> ProcessSpec:
    """A process whose /health answers 200 (a file called health under `root`)."""
    (root / "health").write_text("ok")
    port = free_port()
    argv = (sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(root))
    return ProcessSpec(name, role, (), f"http://127.0.0.1:{port}", argv=argv, health="http")


def _dies(name: str) -> ProcessSpec:
    return ProcessSpec(
        name, "broken", (), "http://127.0.0.1:9", argv=(sys.executable, "-c", "raise SystemExit(3)"), health="http"
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_groups_start_in_order_and_stop_on_exit(tmp_path: Path) -> None:
    master, api = _web("master", tmp_path, "master"), _web("api", tmp_path, "router")
    with LaunchedCluster([[master], [api]], LaunchConfig(tmp_path, startup_timeout_s=30)) as cluster:
        assert [p.name for p in cluster.processes] == ["master", "api"]
        assert (cluster.api, cluster.master) == (api.url, master.url)
        assert httpx.get(api.url + "/health", timeout=5).status_code == 200
        state = cluster.state()
        assert state["api"] == api.url and [p["name"] for p in state["processes"]] == ["master", "api"]  # type: ignore[union-attr]
        pids = [p.pid for p in cluster.processes]
    wait_until(lambda: not any(_alive(pid) for pid in pids), 10)


def test_a_child_that_dies_while_starting_stops_everything_started(tmp_path: Path) -> None:
    first = _web("first", tmp_path)
    cluster = LaunchedCluster([[first], [_dies("broken")]], LaunchConfig(tmp_path, startup_timeout_s=30))
    with pytest.raises(PeerError, match="broken exited with code 3"):
        cluster.start()
    assert cluster.processes == [] and cluster.supervisor.groups == []


def test_a_later_group_that_fails_is_dropped_alone(tmp_path: Path) -> None:
    with LaunchedCluster([[_web("base", tmp_path)]], LaunchConfig(tmp_path, startup_timeout_s=30)) as cluster:
        with pytest.raises(PeerError):
            cluster.start_group([_dies("broken")])
        assert [p.name for p in cluster.processes] == ["base"]
        extra = _web("extra", tmp_path)
        assert cluster.start_group([extra]) and cluster.api == extra.url
        cluster.drop_group()
        assert [p.name for p in cluster.processes] == ["base"]


def test_kill_restart_and_tending_act_on_one_child(tmp_path: Path) -> None:
    restart = ClusterRestartConfig(max_restarts=3, initial_backoff_s=0.1, max_backoff_s=0.1)
    config = LaunchConfig(tmp_path, startup_timeout_s=30, restart=restart)
    with LaunchedCluster([[_web("a", tmp_path), _web("b", tmp_path)]], config) as cluster:
        a, b = cluster.process("a"), cluster.process("b")
        cluster.restart("a")
        assert cluster.process("a").pid != a.pid and not _alive(a.pid)
        assert httpx.get(a.url + "/health", timeout=5).status_code == 200  # same port, answering again
        with cluster.tending():
            cluster.kill("b")
            wait_until(lambda: cluster.process("b").pid != b.pid, 10)
            wait_until(lambda: httpx.get(b.url + "/health", timeout=1).status_code == 200, 10)
        with pytest.raises(ConfigError, match="no process"):
            cluster.kill("nobody")


def test_with_args_appends_to_one_planned_child(tmp_path: Path) -> None:
    groups = [
        [ProcessSpec("w", "worker", ("worker", "--num-blocks", "0"), "")],
        [ProcessSpec("r", "router", ("router",), "")],
    ]
    changed = with_args(groups, "w", "--num-blocks", "64")
    assert changed[0][0].args == ("worker", "--num-blocks", "0", "--num-blocks", "64") and changed[1] == groups[1]
    with pytest.raises(ConfigError):
        with_args(groups, "nobody", "--x")
