"""`mooncake.mooncake_config` on tsukimi: MooncakeConfig's fields, from_file and load_from_env,
and the wheel's parsing rules for sizes and booleans. Where the real wheel is installed
(`make test` installs it for side-by-side checks), every case is also run through the wheel's
own module and the answers must agree."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest

from tsukimi.compat.mooncake import mooncake_config as ours
from tsukimi.compat.mooncake.mooncake_config import MooncakeConfig

SIZES: list[object] = [4096, "4096", " 16MB ", "16mb", "1.5gb", "2G", "3t", "7k", "512b", "1kb", 2.5]
BAD_SIZES: list[object] = ["", "mb", "1GiB", "lots"]
BOOLS: list[object] = [True, False, 1, 0, 0.0, None, "", "TRUE", "yes", "On", "enable", "0", "off", "disable"]
BAD_BOOLS: list[object] = ["maybe", "2"]
ENV = {
    "MOONCAKE_MASTER": "10.0.0.1:50051",
    "MOONCAKE_LOCAL_HOSTNAME": "node1",
    "MOONCAKE_GLOBAL_SEGMENT_SIZE": "4gb",
    "MOONCAKE_PROTOCOL": "RDMA",
    "MOONCAKE_OFFLOAD_ENABLED": "yes",
    "MOONCAKE_CLIENT_HTTP_PORT": "9400",
}
FILE = {
    "local_hostname": "localhost",
    "metadata_server": "P2PHANDSHAKE",
    "master_server_address": "localhost:50051",
    "global_segment_size": "1.5 GB",
    "local_buffer_size": 0,
    "tenant_id": None,
    "enable_client_http_server": "on",
}


def _wheel() -> ModuleType | None:
    try:
        return importlib.import_module("mooncake.mooncake_config")
    except Exception:  # NOTE: the real wheel is optional here (and may not load at all)
        return None


WHEEL = _wheel()
MODULES = [pytest.param(ours, id="tsukimi")] + ([pytest.param(WHEEL, id="wheel")] if WHEEL is not None else [])


def _outcome(call: object, value: object) -> object:
    try:
        return call(value)  # type: ignore[operator]
    except ValueError:
        return ValueError


def test_sizes_and_booleans_parse_as_the_wheel_documents() -> None:
    sizes = [4096, 4096, 16 << 20, 16 << 20, 3 << 29, 2 << 30, 3 << 40, 7 << 10, 512, 1024, 2]
    assert [ours.parse_size(v) for v in SIZES] == sizes
    for bad in BAD_SIZES:
        with pytest.raises(ValueError):
            ours.parse_size(bad)
    assert [ours.parse_bool(v) for v in BOOLS] == [True, False, True, False, False, False, False] + [True] * 4 + [
        False
    ] * 3
    for bad in BAD_BOOLS:
        with pytest.raises(ValueError):
            ours.parse_bool(bad)


@pytest.mark.skipif(WHEEL is None, reason="the real mooncake wheel is not installed here")
def test_the_wheel_parses_every_case_the_same() -> None:
    assert WHEEL is not None
    for value in SIZES + BAD_SIZES:
        assert _outcome(ours.parse_size, value) == _outcome(WHEEL._parse_segment_size, value), value
    for value in BOOLS + BAD_BOOLS:
        assert _outcome(ours.parse_bool, value) == _outcome(WHEEL._parse_bool, value), value


@pytest.mark.parametrize("module", MODULES)
def test_load_from_env_and_from_file(module: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("MOONCAKE_CONFIG_PATH", "MOONCAKE_MASTER"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="MOONCAKE_MASTER"):
        module.MooncakeConfig.load_from_env()
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    env = module.MooncakeConfig.load_from_env()
    assert (env.master_server_address, env.local_hostname, env.metadata_server) == (
        "10.0.0.1:50051",
        "node1",
        "P2PHANDSHAKE",
    )
    assert (env.global_segment_size, env.local_buffer_size, env.protocol) == (4 << 30, 1 << 30, "rdma")
    assert (env.enable_ssd_offload, env.tenant_id, env.client_http_port) == (True, "default", 9400)
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(FILE))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    loaded = module.MooncakeConfig.load_from_env()
    assert (loaded.global_segment_size, loaded.local_buffer_size, loaded.protocol) == (3 << 29, 0, "tcp")
    assert (loaded.tenant_id, loaded.enable_client_http_server, loaded.device_name) == ("default", True, "")
    path.write_text(json.dumps({k: v for k, v in FILE.items() if k != "master_server_address"}))
    with pytest.raises(ValueError, match="master_server_address"):
        module.MooncakeConfig.from_file(str(path))


@pytest.mark.parametrize("module", MODULES)
def test_invariants(module: ModuleType) -> None:
    good = {
        "local_hostname": "h",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": 1,
        "local_buffer_size": 1,
        "protocol": " TCP ",
        "device_name": "",
        "master_server_address": "m:1",
    }
    assert module.MooncakeConfig(**good).protocol == "tcp"
    assert module.MooncakeConfig(**{**good, "protocol": "warp"}).protocol == "warp"  # warned, passed on
    for bad in ({"protocol": ""}, {"protocol": 7}, {"local_buffer_size": -1}, {"local_hostname": " "}):
        with pytest.raises(ValueError):
            module.MooncakeConfig(**{**good, **bad})


def test_the_shim_serves_it_as_mooncake_mooncake_config() -> None:
    assert MooncakeConfig.__module__ == "tsukimi.compat.mooncake.mooncake_config"
    assert ours.DEFAULT_GLOBAL_SEGMENT_SIZE == 3_355_443_200 and ours.DEFAULT_LOCAL_BUFFER_SIZE == 1 << 30
