"""Config loading: defaults, TOML, overrides, and the errors for each kind of mistake, over
every schema the one loader reads (`Config`, `RouterAppConfig`, `ClusterConfig`, `SimConfig`)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import tsukimi.config
from tsukimi.config import (
    SHARED_WORKER_KEYS,
    ClusterConfig,
    Config,
    MetadataConfig,
    RouterAppConfig,
    SimConfig,
    TransferConfig,
    WorkerConfig,
    load,
)
from tsukimi.errors import ConfigError


def test_defaults_bind_loopback() -> None:
    cfg = load(Config)
    assert cfg == Config()
    assert cfg.transfer.bind_host == "127.0.0.1" and cfg.metadata.url == "p2p"
    assert WorkerConfig().host == ClusterConfig().host == "127.0.0.1"


def test_toml_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[transfer]\nnum_connections = 2\ntimeout_s = 3\n[metadata]\nurl = "etcd://127.0.0.1:2379"\n')
    cfg = load(Config, path, ["transfer.num_connections=8", "transfer.transport=tcp"])
    assert cfg.transfer.num_connections == 8 and cfg.transfer.transport == "tcp"
    assert cfg.transfer.timeout_s == 3.0 and isinstance(cfg.transfer.timeout_s, float)
    assert cfg.metadata == MetadataConfig(url="etcd://127.0.0.1:2379")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["transfer.bogus=1"], r"unknown key\(s\) \['bogus'\] in transfer"),
        (["nosection.x=1"], r"unknown key\(s\) \['nosection'\]"),
        (["transfer.transport=no-such thing"], "must be auto or a transport's name"),
        (["transfer.num_connections=0"], "num_connections must be in 1..64"),
        (["transfer.num_connections=two"], "must be int"),
        (["transfer.num_connections=true"], "must be int"),
        (["transfer.slice_bytes=100"], "slice_bytes must be in 4096"),
        (["metadata.url=ftp://x"], "metadata.url must be"),
        (["noequals"], "section.key=value"),
        (["transfer=1"], "section.key=value"),
    ],
)
def test_mistakes_are_config_errors_naming_the_fix(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(Config, None, overrides)


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load(Config, tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[transfer\n")
    with pytest.raises(ConfigError, match="cannot read"):
        load(ClusterConfig, bad)


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        TransferConfig(timeout_s=-1)


# -- the router's file ------------------------------------------------------------------------


def test_router_file_overrides_both_tables(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text('[router]\npolicy = "round_robin"\n[conductor]\nttft_slo_s = 2\n')
    settings = load(RouterAppConfig, path, ["router.cost.decode_step_s=0.05", "conductor.rejection=early"])
    assert (settings.router.policy, settings.router.cost.decode_step_s) == ("round_robin", 0.05)
    assert (settings.conductor.ttft_slo_s, settings.conductor.rejection) == (2.0, "early")
    assert load(RouterAppConfig) == RouterAppConfig()


def test_router_file_bad_key_names_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['nope'\] in router; valid: \[.*'poll_interval_s'"):
        load(RouterAppConfig, None, ["router.nope=1"])
    with pytest.raises(
        ConfigError, match=r"unknown key\(s\) \['transfer'\] in config; valid: \[.*'conductor'.*'router'"
    ):
        load(RouterAppConfig, None, ["transfer.port=1"])
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['mode'\] in config"):
        load(RouterAppConfig, None, ["mode=pd"])
    with pytest.raises(ConfigError, match=r"router\.mode must be one of"):
        load(RouterAppConfig, None, ["router.mode=mixed"])


# -- the cluster's file -------------------------------------------------------------------------


def test_cluster_workers_table_sets_the_shared_worker_config(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text('[workers]\ndecode = 2\nnum_blocks = 64\ndtype = "bfloat16"\n')
    config = load(ClusterConfig, path, ["model=tiny", "workers.prefix_caching=false", "workers.segment_bytes=1024"])
    assert (config.model, config.workers.decode, config.workers.prefill) == ("tiny", 2, 1)
    shared = WorkerConfig(num_blocks=64, dtype="bfloat16", prefix_caching=False, segment_bytes=1024)
    assert config.workers.worker == shared
    assert load(ClusterConfig) == ClusterConfig() and ClusterConfig().workers.worker == WorkerConfig()


def test_cluster_workers_bad_key_names_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['prefil'\] in workers; valid: \[") as info:
        load(ClusterConfig, None, ["workers.prefil=1"])
    valid = {
        "prefill",
        "decode",
        "colocated",
        "base_port",
        "cpp_groups",
        "cpp_stages",
        "cpp_chunk_tokens",
        "nice",
        *SHARED_WORKER_KEYS,
    }
    assert str(info.value).endswith(str(sorted(valid)))
    # NOTE: the cluster sets each worker's name, role, port and master; the shared config is flat
    for key in ("name", "port", "master", "worker.num_blocks"):
        with pytest.raises(ConfigError, match="unknown key"):
            load(ClusterConfig, None, [f"workers.{key}=1"])


def test_cluster_workers_values_are_checked_where_they_are_written() -> None:
    with pytest.raises(ConfigError, match=r"workers\.num_blocks must be int"):
        load(ClusterConfig, None, ["workers.num_blocks='8'"])
    with pytest.raises(
        ConfigError, match=r"workers\.dtype must be one of \('auto', 'float32', 'bfloat16', 'float16'\)"
    ):
        load(ClusterConfig, None, ["workers.dtype=float64"])
    with pytest.raises(ConfigError, match="worker device must be one of auto, cpu, cuda or cuda:N"):
        load(ClusterConfig, None, ["workers.device=gpu"])
    assert load(ClusterConfig, None, ["workers.device=cuda"]).workers.worker.device == "cuda"
    with pytest.raises(ConfigError, match="num_blocks must be >= 0"):  # NOTE: 0 = from kv_cache_memory
        load(ClusterConfig, None, ["workers.num_blocks=-1"])


# -- any dataclass -----------------------------------------------------------------------------


def test_sim_config_loads_top_level_keys_and_optional_values() -> None:
    sim = load(SimConfig, None, ["shape=colocated", "cache_blocks=100", "speed=2"])
    assert (sim.shape, sim.cache_blocks, sim.speed) == ("colocated", 100, 2.0)
    with pytest.raises(ConfigError, match="cache_blocks must be int"):
        load(SimConfig, None, ["cache_blocks=lots"])


def test_config_imports_nothing_above_it() -> None:
    """config is the bottom layer: the standard library, tsukimi.errors and tsukimi.eviction only."""
    allowed = {"tsukimi.errors", "tsukimi.eviction", "tsukimi.config"}
    for path in Path(tsukimi.config.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                top = name.split(".")[0]
                ok = top in sys.stdlib_module_names or any(name.startswith(a) for a in allowed)
                assert ok, f"{path.name} imports {name}"
