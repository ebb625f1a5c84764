"""The one settings loader: defaults, then a TOML file, then `section.key=value` overrides,
built into any frozen config dataclass (`load(Config, ...)`, `load(ClusterConfig, ...)`).

Unknown sections and keys are errors naming the valid ones; values are type-checked against
the dataclass's annotations (ints widen to floats, `Literal`s name their choices), then each
dataclass validates itself in `__post_init__`. A field whose metadata holds `INLINE_KEYS`
is a nested dataclass read from the enclosing table: `[workers] num_blocks = 64` sets
`workers.worker.num_blocks` (only the keys listed there may be given).
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Literal, get_args, get_origin

from tsukimi.errors import ConfigError

__all__ = ["INLINE_KEYS", "build_dataclass", "load", "read_settings", "require"]

INLINE_KEYS = "tsukimi.config.inline_keys"
T = typing.TypeVar("T")


def require(ok: bool, message: str) -> None:
    """Raises ConfigError(message) unless `ok` (the configs' `__post_init__` checks)."""
    if not ok:
        raise ConfigError(message)


def load(schema: type[T], path: str | Path | None = None, overrides: Iterable[str] = ()) -> T:
    """Builds `schema` (a config dataclass) from its defaults, an optional TOML file and
    overrides. Pure apart from reading the file.

    Args:
        schema: the dataclass the file describes: its dataclass fields are `[tables]`, its
            other fields top-level keys.
        path: the TOML file, or None for defaults and overrides only.
        overrides: `section.key=value` items (`key=value` too when `schema` has top-level
            keys); a value is read as TOML, else taken as a bare string (`model=tiny`).

    Returns:
        The validated, frozen config.

    Raises:
        ConfigError: an unreadable file, a malformed override, an unknown section or key,
            a wrong type, an invalid value.
    """
    hints = typing.get_type_hints(schema)
    fields = dataclasses.fields(schema)  # type: ignore[arg-type]
    top_level_keys = any(not dataclasses.is_dataclass(hints[f.name]) for f in fields)
    return build_dataclass(schema, read_settings(path, overrides, top_level_keys), "")


def read_settings(
    path: str | Path | None, overrides: Iterable[str], top_level_keys: bool = False
) -> dict[str, typing.Any]:
    """The tables of an optional TOML file with `section.key=value` overrides applied (a value
    is read as TOML, else taken as a bare string: `model=tiny`); with `top_level_keys`,
    `key=value` sets a top-level key too. Pure apart from reading the file.

    Raises:
        ConfigError: an unreadable file, a malformed override, an override into a non-table.
    """
    data: dict[str, typing.Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    for item in overrides:
        key, sep, raw = item.partition("=")
        *sections, leaf = key.strip().split(".")
        shape = "[section.]key=value" if top_level_keys else "section.key=value"
        require(
            bool(sep and leaf) and (bool(sections) or top_level_keys), f"override must look like {shape}, got {item!r}"
        )
        node = data
        for name in sections:
            node = node.setdefault(name, {})
            require(isinstance(node, dict), f"{key}: {name} is not a section")
        node[leaf] = _parse_scalar(raw.strip())
    return data


def _parse_scalar(raw: str) -> object:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def build_dataclass(cls: type[T], data: Mapping[str, typing.Any], where: str, base: T | None = None) -> T:
    """Instantiates dataclass `cls` from a mapping, recursing into nested dataclasses (pure).

    Args:
        where: the dotted path of `data` in the file ("" at the top), for messages.
        base: the values of the keys `data` does not give (None: the class's defaults); a nested
            field's own default (its default_factory's) is its base, so a table that sets one key
            keeps the others of that default, not of the class.

    Raises:
        ConfigError: `data` is not a table, an unknown key, a wrong type, an invalid value.
    """
    require(isinstance(data, dict), f"{where or 'config'} must be a table")
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    inline = {f.name: tuple(f.metadata[INLINE_KEYS]) for f in fields if INLINE_KEYS in f.metadata}
    routed = {key: name for name, keys in inline.items() for key in keys}
    valid = {f.name for f in fields if f.name not in inline} | set(routed)
    unknown = sorted(set(data) - valid)
    require(not unknown, f"unknown key(s) {unknown} in {where or 'config'}; valid: {sorted(valid)}")
    kwargs: dict[str, object] = {}
    nested: dict[str, dict[str, object]] = {}
    for name, value in data.items():
        if name in routed:
            nested.setdefault(routed[name], {})[name] = value
            continue
        kind, dotted = hints[name], f"{where}.{name}" if where else name
        if dataclasses.is_dataclass(kind):
            field = next(f for f in fields if f.name == name)
            default = field.default_factory() if field.default_factory is not dataclasses.MISSING else None
            kwargs[name] = build_dataclass(typing.cast(type, kind), value, dotted, default)
        else:
            kwargs[name] = _coerce(kind, value, dotted)
    for name, values in nested.items():
        # NOTE: the inlined keys sit in this table, so their messages name it (workers.num_blocks)
        kwargs[name] = build_dataclass(typing.cast(type, hints[name]), values, where)
    return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)  # type: ignore[type-var]


def _coerce(kind: object, value: object, where: str) -> object:
    if get_origin(kind) is Literal:
        require(value in get_args(kind), f"{where} must be one of {get_args(kind)}, got {value!r}")
        return value
    if get_origin(kind) in (types.UnionType, typing.Union) and type(None) in get_args(kind):
        # NOTE: TOML has no null, so an optional field read from a file always has a value
        (inner,) = (arg for arg in get_args(kind) if arg is not type(None))
        return _coerce(inner, value, where)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind in (int, float, str, bool):
        ok = isinstance(value, typing.cast(type, kind)) and not (kind is int and isinstance(value, bool))
        require(ok, f"{where} must be {typing.cast(type, kind).__name__}, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported config type {kind}")
