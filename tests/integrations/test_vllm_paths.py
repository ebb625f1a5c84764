"""Where `tsukimi up --engine vllm` and the vLLM test kit find the vLLM venv and the models
(tsukimi/integrations/vllm/paths.py): the flags, else $TSUKIMI_VLLM_VENV / $TSUKIMI_MODELS_DIR,
else .venv-vllm / .models in the current directory, never where tsukimi is installed; made
absolute when read; a missing one is an error naming `make vllm`, the flag and the variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from tsukimi import cli
from tsukimi.errors import ConfigError
from tsukimi.integrations.vllm import paths
from tsukimi.integrations.vllm.launch import VllmClusterConfig, cluster_config, plan_vllm
from tsukimi.testing.vllm_server import VllmServerConfig, missing_reason


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The current directory is `tmp_path`, and the environment names no venv or models."""
    monkeypatch.delenv(paths.VENV_ENV, raising=False)
    monkeypatch.delenv(paths.MODELS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _built(root: Path) -> None:
    """What `make vllm` leaves under `root`: .venv-vllm's python and .models/tiny."""
    (root / ".venv-vllm" / "bin").mkdir(parents=True)
    (root / ".venv-vllm" / "bin" / "python").touch()
    (root / ".models" / "tiny").mkdir(parents=True)
    (root / ".models" / "tiny" / "config.json").write_text("{}")
    (root / ".models" / "tiny" / ".complete").touch()


def test_the_defaults_are_the_current_directorys(elsewhere: Path) -> None:
    config = VllmClusterConfig()
    assert (config.venv, config.models_dir) == (str(elsewhere / ".venv-vllm"), str(elsewhere / ".models"))
    server = VllmServerConfig()
    assert (server.venv, server.model) == (elsewhere / ".venv-vllm", elsewhere / ".models" / "tiny")
    assert (
        missing_reason()
        == f"{elsewhere / '.venv-vllm' / 'bin' / 'python'} is missing (make vllm, or set $TSUKIMI_VLLM_VENV)"
    )
    _built(elsewhere)
    assert missing_reason() == ""
    assert config.model_path() == elsewhere / ".models" / "tiny"


def test_the_environment_overrides_the_current_directory(elsewhere: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(paths.VENV_ENV, "venvs/vllm")  # NOTE: relative: to the current directory, when read
    monkeypatch.setenv(paths.MODELS_ENV, str(elsewhere / "models"))
    config = VllmClusterConfig()
    assert (config.venv, config.models_dir) == (str(elsewhere / "venvs" / "vllm"), str(elsewhere / "models"))
    assert VllmServerConfig().model == elsewhere / "models" / "tiny"
    assert missing_reason(models=elsewhere).startswith(str(elsewhere / "venvs" / "vllm" / "bin" / "python"))


def test_the_flags_override_the_environment(elsewhere: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(paths.VENV_ENV, "/nowhere/venv")
    parser = cli.build_parser()
    args = parser.parse_args(["up", "--engine", "vllm", "--vllm-venv", "v", "--models-dir", "m"])
    config = cluster_config(args)
    assert (config.venv, config.models_dir, config.python) == ("v", "m", elsewhere / "v" / "bin" / "python")
    defaults = cluster_config(parser.parse_args(["up", "--engine", "vllm"]))
    assert (defaults.venv, defaults.models_dir) == ("/nowhere/venv", str(elsewhere / ".models"))


def test_missing_ones_name_make_vllm_the_flag_and_the_variable(elsewhere: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"\.venv-vllm/bin/python is missing: run make vllm .*--vllm-venv or \$TSUKIMI_VLLM_VENV"
    ):
        VllmClusterConfig().model_path()
    _built(elsewhere)
    with pytest.raises(
        ConfigError,
        match=r"model folder .*/\.models/smollm2 is missing .*make vllm.*--models-dir or \$TSUKIMI_MODELS_DIR",
    ):
        VllmClusterConfig(model="smollm2").model_path()


def test_the_processes_get_absolute_paths_whatever_their_directory(elsewhere: Path) -> None:
    _built(elsewhere)
    config = VllmClusterConfig(venv=".venv-vllm", models_dir=".models", instances=1)
    [[vllm], _router] = plan_vllm(config, elsewhere, pick=iter(range(7000, 7100)).__next__)
    argv = vllm.argv
    assert argv[0] == str(elsewhere / ".venv-vllm" / "bin" / "python")
    assert argv[argv.index("--model") + 1] == str(elsewhere / ".models" / "tiny")
