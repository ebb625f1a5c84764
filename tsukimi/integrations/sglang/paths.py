"""Where the SGLang virtualenv is: what `make sglang` builds (`.venv-sglang`), found from the
environment or the current directory, never from where tsukimi is installed.

    the SGLang venv    $TSUKIMI_SGLANG_VENV, else ./.venv-sglang

Relative paths are made absolute against the current directory when read. A missing venv is
an error naming `make sglang` and the variable (`check_venv`).
"""

from __future__ import annotations

import os
from pathlib import Path

from tsukimi.errors import ConfigError

VENV_ENV = "TSUKIMI_SGLANG_VENV"
DEFAULT_VENV = ".venv-sglang"


def sglang_venv() -> Path:
    """The SGLang virtualenv: $TSUKIMI_SGLANG_VENV, else .venv-sglang in the current directory
    (absolute; it may not exist)."""
    return Path(os.environ.get(VENV_ENV) or DEFAULT_VENV).absolute()


def check_venv(venv: Path | None = None) -> Path:
    """The SGLang venv's python.

    Raises:
        ConfigError: the venv is not there (run `make sglang`, or point $TSUKIMI_SGLANG_VENV at one).
    """
    root = venv or sglang_venv()
    python = root / "bin" / "python"
    if not os.access(python, os.X_OK):
        raise ConfigError(f"no SGLang venv at {root}: run `make sglang`, or set ${VENV_ENV} to one")
    return python
