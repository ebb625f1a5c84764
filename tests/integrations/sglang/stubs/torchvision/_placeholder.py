"""Placeholders for every torchvision name the stub does not define: importable, not callable."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import types
from collections.abc import Callable, Sequence
from typing import NoReturn


class Placeholder:
    """Stands for a torchvision object; any call or attribute use says it is a stub."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(
            f"{self._name}: torchvision is an import stub in tsukimi's SGLang venv "
            "(tests/integrations/sglang/stubs); no Mooncake path uses it"
        )

    def __getattr__(self, attr: str) -> Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{self._name}.{attr}")

    def __mro_entries__(self, bases: tuple[object, ...]) -> tuple[type, ...]:
        # NOTE: lets `class X(T.Compose)` at import time succeed; instantiating it still fails.
        return (object,)


def placeholder_getattr(module: str) -> Callable[[str], Placeholder]:
    """A module `__getattr__` that answers any public name with a placeholder."""

    def __getattr__(name: str) -> Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{module}.{name}")

    return __getattr__


class SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes any `<package>.*` submodule without a file a module of placeholders."""

    def __init__(self, package: str) -> None:
        self._prefix = package + "."

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(self._prefix):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []
        module.__getattr__ = placeholder_getattr(module.__name__)  # type: ignore[method-assign]
