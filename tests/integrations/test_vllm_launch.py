"""`tsukimi up --engine vllm`'s plan (pure): the processes, their flags and environments."""

from __future__ import annotations

import json
import os
from itertools import count
from pathlib import Path

import pytest

from tsukimi.errors import ConfigError
from tsukimi.integrations.vllm.backend import parse_event_sources
from tsukimi.integrations.vllm.launch import VllmClusterConfig, plan_vllm


def _config(tmp_path: Path, **kw: object) -> VllmClusterConfig:
    venv, model = tmp_path / "venv", tmp_path / "models" / "tiny"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    (venv / "bin" / "python").touch()
    (venv / "bin" / "mooncake_master").touch()
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text("{}")
    return VllmClusterConfig(venv=str(venv), models_dir=str(tmp_path / "models"), **kw)  # type: ignore[arg-type]


def _flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_colocated_plan(tmp_path: Path) -> None:
    ports = count(20000)
    groups = plan_vllm(_config(tmp_path), tmp_path, lambda: next(ports))
    assert [[s.name for s in g] for g in groups] == [["vllm-0", "vllm-1"], ["router"]]
    v0, v1 = groups[0]
    assert [dict(v.env)["VLLM_CPU_OMP_THREADS_BIND"] for v in (v0, v1)] == ["0", "1"]
    assert dict(v0.env)["VLLM_CPU_KVCACHE_SPACE"] == "1" and v0.health == "http"
    # NOTE: what vLLM leaves in $TMPDIR goes to the cluster's folder; its AOT cache cannot load on this torch
    assert dict(v0.env)["TMPDIR"] == str(tmp_path.resolve())
    assert dict(v0.env)["VLLM_USE_AOT_COMPILE"] == os.environ.get("VLLM_USE_AOT_COMPILE", "0")
    assert (_flag(v0.argv, "--dtype"), _flag(v0.argv, "--model")) == ("float32", str(tmp_path / "models" / "tiny"))
    events = json.loads(_flag(v0.argv, "--kv-events-config"))
    assert events["endpoint"] == f"ipc://{tmp_path.resolve()}/vllm-0-events" and events["publisher"] == "zmq"
    assert "--kv-transfer-config" not in v0.argv
    router = groups[1][0].args
    assert _flag(router, "--backend") == "vllm" and "--pool" not in router
    assert (_flag(router, "--model"), _flag(router, "--served-model-name")) == (
        str(tmp_path / "models" / "tiny"),
        "tiny",
    )
    assert _flag(router, "--workers") == f"vllm-0=colocated@{v0.url},vllm-1=colocated@{v1.url}"
    sources = parse_event_sources(_flag(router, "--kv-events"), "kv")
    assert sources["vllm-1"].replay_endpoint == f"ipc://{tmp_path.resolve()}/vllm-1-replay"


def test_pool_and_pd_plans(tmp_path: Path) -> None:
    groups = plan_vllm(_config(tmp_path, mode="pd", connector="tsukimi"), tmp_path)
    assert [[s.name for s in g] for g in groups] == [["master"], ["vllm-0", "vllm-1"], ["router"]]
    roles = [json.loads(_flag(s.argv, "--kv-transfer-config"))["kv_role"] for s in groups[1]]
    assert roles == ["kv_producer", "kv_consumer"]
    transfer = json.loads(_flag(groups[1][0].argv, "--kv-transfer-config"))
    assert transfer["kv_connector_module_path"] == "tsukimi.integrations.vllm.connector"
    assert transfer["kv_connector_extra_config"]["master"].startswith("tcp://127.0.0.1:")
    assert "--pool" in groups[2][0].args
    mooncake = plan_vllm(_config(tmp_path, connector="mooncake_store"), tmp_path)
    assert mooncake[0][0].argv[0].endswith("mooncake_master")
    env = dict(mooncake[1][0].env)
    assert json.loads(Path(env["MOONCAKE_CONFIG_PATH"]).read_text())["protocol"] == "tcp"
    assert env["MC_TCP_BIND_ADDRESS"] == "127.0.0.1" and env["MOONCAKE_REQUESTER_LOCAL_HOSTNAME"]


def test_bad_configs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="pd needs a connector"):
        VllmClusterConfig(mode="pd")
    with pytest.raises(ConfigError, match="exactly 2"):
        VllmClusterConfig(mode="pd", connector="tsukimi", instances=3)
    with pytest.raises(ConfigError, match="tcp:// or ipc://"):
        parse_event_sources("v0=http://x", "kv")


def test_the_planned_router_arguments_are_the_routers_config(tmp_path: Path) -> None:
    """`tsukimi up --engine vllm` runs `tsukimi router` with flags that map onto its config,
    the vLLM backend offered by the CLI (`args.backends`)."""
    from tsukimi.cli import build_parser
    from tsukimi.serving.router.commands import settings

    groups = plan_vllm(_config(tmp_path, mode="pd", connector="tsukimi"), tmp_path)
    args = build_parser().parse_args(list(groups[-1][0].args))
    config = settings(args)
    assert (config.backend, config.model, config.served_model_name) == ("vllm", str(tmp_path / "models/tiny"), "tiny")
    assert (config.router.policy, config.vllm.read_timeout_s, config.vllm.pool) == ("conductor", 300.0, True)
    assert set(parse_event_sources(config.vllm.kv_events, config.vllm.kv_events_topic)) == {"vllm-0", "vllm-1"}
    assert "vllm" in args.backends
