"""`tsukimi up`: its configuration, the processes it plans, and real runs with the tiny model
(every process answers /health; SIGTERM, or a worker that fails to start, leaves no process)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tsukimi.config import ClusterConfig, Config, WorkerConfig, load
from tsukimi.errors import ConfigError
from tsukimi.netio import free_port
from tsukimi.serving.cluster.up import plan
from tsukimi.serving.worker.commands import add_parser, worker_args, worker_config
from tsukimi.testing.processes import wait_until


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def test_config_from_toml_and_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, 'model = "tiny"\n[workers]\ndecode = 2\nnum_blocks = 64\n[router]\nport = 9000\n')
    config = load(ClusterConfig, path, ["workers.prefill=3", "mode=pd", "stop_timeout_s=2"])
    assert (config.model, config.mode, config.stop_timeout_s) == ("tiny", "pd", 2.0)
    assert (config.workers.prefill, config.workers.decode, config.workers.worker.num_blocks) == (3, 2, 64)
    assert config.router.port == 9000 and config.master.rpc_port == 0


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("modell = 'tiny'", r"unknown key\(s\) \['modell'\]"),
        ("[workers]\nprefil = 1", r"unknown key\(s\) \['prefil'\] in workers"),
        ("[routers]\nport = 1", r"unknown key\(s\) \['routers'\]"),
        ("mode = 'mixed'", "mode must be one of"),
        ("[workers]\ndecode = 0", "needs workers.prefill >= 1 and workers.decode >= 1"),
        ("mode = 'colocated'\n[workers]\ncolocated = 0", "needs workers.colocated >= 1"),
        ("[router]\nport = 70000", "router.port must be in 0..65535"),
        ("[workers]\nnum_blocks = '8'", "workers.num_blocks must be int"),
        ("model = ", "cannot read config file"),
    ],
)
def test_config_errors_name_the_key(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load(ClusterConfig, write(tmp_path, text))


def test_plan_pd_starts_master_then_workers_then_router() -> None:
    ports = itertools.count(7001)
    config = ClusterConfig(model="tiny")
    first, workers, router = plan(config, lambda: next(ports))
    assert [(s.name, s.role, s.url) for s in first] == [
        ("master", "master", "http://127.0.0.1:7002"),
        ("metadata", "metadata", "http://127.0.0.1:7003"),
    ]
    assert first[0].args[1:4] == (
        '--set=master.host="127.0.0.1"',
        "--set=master.rpc_port=7001",
        "--set=master.http_port=7002",
    )
    assert first[1].args == ("metadata-server", "--host", "127.0.0.1", "--port", "7003")
    assert [(s.name, s.role, s.url) for s in workers] == [
        ("prefill-0", "prefill", "http://127.0.0.1:7004"),
        ("decode-0", "decode", "http://127.0.0.1:7005"),
    ]
    args = workers[0].args
    assert args[:7] == ("worker", "--name", "prefill-0", "--role", "prefill", "--port", "7004")
    assert args[args.index("--master") + 1] == "tcp://127.0.0.1:7001" and args[args.index("--model") + 1] == "tiny"
    assert args[args.index("--metadata-url") + 1] == "http://127.0.0.1:7003/metadata"  # live weight updates
    assert router[0].url == "http://127.0.0.1:8000"
    listed = router[0].args[router[0].args.index("--workers") + 1]
    assert listed == "prefill-0=prefill@http://127.0.0.1:7004,decode-0=decode@http://127.0.0.1:7005"


def test_plan_passes_the_master_settings_of_the_cluster_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[master]\nhot_threshold = 5\nhot_max_replicas = 2\n")
    config = load(ClusterConfig, path, ["master.hot_cool_down_s=7.5"])
    master = plan(config, itertools.count(7001).__next__)[0][0]
    sets = [arg.removeprefix("--set=") for arg in master.args[1:]]
    store = load(Config, None, sets).master  # what `tsukimi master` builds from these
    assert (store.hot_threshold, store.hot_max_replicas, store.hot_cool_down_s) == (5.0, 2, 7.5)
    assert (store.rpc_port, store.http_port) == (7001, 7002)
    default = load(Config, None, [a.removeprefix("--set=") for a in plan(ClusterConfig(), lambda: 1)[0][0].args[1:]])
    assert default.master.hot_threshold == 0.0  # off unless the cluster file says
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['lease_ttl_s'\] in master"):
        load(ClusterConfig, None, ["master.lease_ttl_s=1"])


def test_plan_colocated_has_no_master() -> None:
    config = load(ClusterConfig, None, ["mode=colocated", "workers.colocated=2", "workers.base_port=9100"])
    groups = plan(config, lambda: 1)
    assert [[s.name for s in g] for g in groups] == [["metadata"], ["colocated-0", "colocated-1"], ["router"]]
    assert [s.url for s in groups[1]] == ["http://127.0.0.1:9100", "http://127.0.0.1:9101"]
    assert "--master" not in groups[1][0].args and "--metadata-url" in groups[1][0].args


def test_plan_runs_the_engines_at_a_lower_cpu_priority_than_the_router() -> None:
    """`workers.nice` (default 10) goes to every engine, CPP stages included; the master, the
    metadata server and the router keep ours, so that the router's loop runs first."""
    groups = plan(load(ClusterConfig, None, ["model=tiny", "workers.cpp_groups=1"]), lambda: 1)
    assert [[(s.name, s.nice) for s in g] for g in groups] == [
        [("master", 0), ("metadata", 0)],
        [("prefill-0", 10), ("decode-0", 10), ("cpp-0", 10), ("cpp-0-s1", 10)],
        [("router", 0)],
    ]
    same = plan(load(ClusterConfig, None, ["model=tiny", "workers.nice=0"]), lambda: 1)
    assert {s.nice for g in same for s in g} == {0}
    with pytest.raises(ConfigError, match=r"workers\.nice"):
        load(ClusterConfig, None, ["workers.nice=20"])


def parse_worker(args: tuple[str, ...]) -> WorkerConfig:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return worker_config(parser.parse_args(list(args)))


def test_worker_args_are_the_inverse_of_the_worker_command() -> None:
    config = WorkerConfig(
        name="d1",
        role="decode",
        model="tiny",
        host="::1",
        port=9002,
        block_tokens=8,
        num_blocks=64,
        max_batched_tokens=128,
        master="tcp://[::1]:1",
        segment_bytes=1 << 20,
        threads=2,
        dtype="bfloat16",
        prefix_caching=False,
        metadata_url="http://127.0.0.1:1/metadata",
    )
    assert parse_worker(worker_args(config)) == config
    assert parse_worker(("worker",)) == WorkerConfig() == parse_worker(worker_args(WorkerConfig()))


def test_plan_gives_every_worker_the_shared_settings() -> None:
    overrides = ["model=tiny", "workers.num_blocks=64", "workers.prefix_caching=false", "workers.decode=2"]
    config = load(ClusterConfig, None, overrides)
    ports = itertools.count(7001)
    _, workers, _ = plan(config, lambda: next(ports))
    shared = dataclasses.replace(
        config.workers.worker,
        model="tiny",
        master="tcp://127.0.0.1:7001",
        metadata_url="http://127.0.0.1:7003/metadata",
    )
    assert [parse_worker(s.args) for s in workers] == [
        dataclasses.replace(shared, name="prefill-0", role="prefill", port=7004),
        dataclasses.replace(shared, name="decode-0", role="decode", port=7005),
        dataclasses.replace(shared, name="decode-1", role="decode", port=7006),
    ]
    assert "--no-prefix-caching" in workers[0].args


def up(tmp_path: Path, text: str) -> subprocess.Popen[bytes]:
    config = write(tmp_path, text)
    cmd = [sys.executable, "-m", "tsukimi.cli", "up", "--config", str(config), "--state-file", str(tmp_path / "state")]
    env = {**os.environ, "COLUMNS": "200"}
    with (tmp_path / "up.log").open("wb") as out:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, env=env)


@contextlib.contextmanager
def running(tmp_path: Path, text: str, timeout_s: float = 60) -> Iterator[dict[str, object]]:
    """`tsukimi up` of the cluster `text`, once it is up: its state file (the API's URL, the
    processes); stopped with SIGTERM after (SIGKILL when it does not stop in 30 s)."""
    supervisor = up(tmp_path, text)
    try:
        wait_until(lambda: (tmp_path / "state").exists() or supervisor.poll() is not None, timeout_s)
        assert supervisor.poll() is None, (tmp_path / "up.log").read_text()
        yield json.loads((tmp_path / "state").read_text())
    finally:
        supervisor.send_signal(signal.SIGTERM)
        try:
            supervisor.wait(timeout=30)
        finally:
            if supervisor.poll() is None:
                supervisor.kill()
                supervisor.wait()


def children_of(pid: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def tiny_cluster(tmp_path: Path, model: str = "tiny") -> str:
    return (
        f'model = "{model}"\nlog_dir = "{tmp_path / "logs"}"\nstartup_timeout_s = 60\nstop_timeout_s = 5\n'
        f"[workers]\nnum_blocks = 64\nsegment_bytes = {16 << 20}\n[router]\nport = {free_port()}\n"
    )


@pytest.mark.timeout(90)
def test_up_serves_on_every_process_and_sigterm_stops_every_child(tmp_path: Path) -> None:
    supervisor = up(tmp_path, tiny_cluster(tmp_path))
    try:
        wait_until(lambda: (tmp_path / "state").exists() or supervisor.poll() is not None, 60)
        assert supervisor.poll() is None, (tmp_path / "up.log").read_text()
        state = json.loads((tmp_path / "state").read_text())
        processes = {p["name"]: p for p in state["processes"]}
        assert sorted(processes) == ["decode-0", "master", "metadata", "prefill-0", "router"]
        assert children_of(supervisor.pid) == {p["pid"] for p in processes.values()}
        for name, process in processes.items():
            health = httpx.get(process["url"] + "/health", timeout=5).json()
            assert health["status"] == "ok"
            if process["role"] in ("prefill", "decode"):
                assert (health["name"], health["role"]) == (name, process["role"])
        assert [w["healthy"] for w in httpx.get(state["api"] + "/health", timeout=5).json()["workers"]] == [True] * 2
        request = {"model": "tiny", "prompt": "Hi", "max_tokens": 3}
        completion = httpx.post(state["api"] + "/v1/completions", json=request, timeout=30)
        assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] >= 1
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=30) == 0
        assert not (tmp_path / "state").exists()  # it describes a running cluster only
        assert [name for name, p in processes.items() if alive(p["pid"])] == []
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()


@pytest.mark.timeout(90)
def test_a_worker_failing_to_start_stops_everything_started(tmp_path: Path) -> None:
    rpc_port = free_port()
    supervisor = up(tmp_path, tiny_cluster(tmp_path, model="no-such-model") + f"[master]\nrpc_port = {rpc_port}\n")
    try:
        assert supervisor.wait(timeout=60) == 2
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()
    output = (tmp_path / "up.log").read_text()
    assert "exited with code 2" in output and "no-such-model" in output
    assert (tmp_path / "logs" / "master.log").exists()  # the master was started ...
    marker = f"master.rpc_port={rpc_port}".encode()
    assert [pid for pid in Path("/proc").glob("[0-9]*") if marker in cmdline(pid)] == []  # ... and stopped


def cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def test_plan_gives_the_router_its_health_port_when_set() -> None:
    """`router.health_port` (0: none) reaches the router as its `health_port` setting."""
    [router] = plan(load(ClusterConfig, None, ["model=tiny", "router.health_port=8001"]), lambda: 1)[-1]
    assert router.args[-1] == "--set=health_port=8001"
    [plain] = plan(load(ClusterConfig, None, ["model=tiny"]), lambda: 1)[-1]
    assert not any("health_port" in arg for arg in plain.args)
