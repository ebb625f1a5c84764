"""The optional parts of tsukimi's dependencies (pyproject.toml's extras) and the one error that
names what to install when one is missing.

    bench   h11          `tsukimi bench` (the overload benchmark's raw HTTP/1.1 client)
    plots   matplotlib   the simulator's PNGs (`tsukimi sim ... --plot`, `tsukimi sim experiment`)
    dev     both, and the test tools (`make test` installs it)

Serving, the store, the Transfer Engine and the simulator's tables need none of them: a plain
`pip install tsukimi` runs `tsukimi up`.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Literal

from tsukimi.errors import ConfigError

Extra = Literal["bench", "plots"]
EXTRAS: dict[Extra, tuple[str, ...]] = {"bench": ("h11",), "plots": ("matplotlib",)}


def require(extra: Extra, needed_by: str) -> None:
    """Check that every module of `extra` imports (importing them).

    Args:
        extra: the pyproject extra.
        needed_by: what needs it, for the message (e.g. "tsukimi bench").
    Raises:
        ConfigError: one is missing; the message names `pip install 'tsukimi[EXTRA]'`.
    """
    for module in EXTRAS[extra]:
        load(module, extra, needed_by)


def load(module: str, extra: Extra, needed_by: str) -> ModuleType:
    """Import `module`, which the extra `extra` installs.

    Raises:
        ConfigError: it is not installed; the message names `pip install 'tsukimi[EXTRA]'`.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"{needed_by} needs {module}, which is not installed: pip install 'tsukimi[{extra}]'"
        ) from exc
